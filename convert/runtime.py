"""The decoder's runtime layout (models/llama.py's module doc) built on the host one tensor at a time.

`llama.runtime_params` turns a same stacked tree at once; loading instead fills each runtime
tensor from the stored layout's per-layer pieces as they are read (`tables.table_jobs` for a
checkpoint, `stored_jobs` for a converted folder) and hands it to `place` (onto the device or the
mesh) as soon as it is complete, so the host holds one runtime tensor and one piece at a time.
tests/test_convert.py checks that both give the same arrays.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from lookm_jax.convert.tables import aligned_empty, copy_into
from lookm_jax.models.config import LlamaConfig

Job = tuple[str, "int | None", Callable[[], np.ndarray]]  # (stored path, layer or None, take)
# Stored pieces per runtime tensor (the rest are one piece each).
_PARTS = {"w_qkv": 3, "b_qkv": 3, "w_gate_up": 2}


def _targets(cfg: LlamaConfig) -> dict[str, tuple[str, tuple[int, ...], Callable, Callable]]:
    """Stored leaf -> (runtime leaf, its shape, the part of it the piece fills, the piece in that part's layout)."""
    hkv, d, h, i = cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    g = cfg.num_heads // hkv
    heads = lambda w: w.T.reshape(hkv, -1, d, h)  # [H, Hkv*n*D] -> [Hkv, n, D, H]
    biases = lambda b: b.reshape(hkv, -1, d)  # [Hkv*n*D] -> [Hkv, n, D]
    same, t = (lambda a: a), (lambda w: w.T)
    qkv, b_qkv, gate_up = (hkv, g + 2, d, h), (hkv, g + 2, d), (i, 2, h)
    parts = {"q": slice(0, g), "k": slice(g, g + 1), "v": slice(g + 1, g + 2)}
    return {
        **{f"w{c}": ("w_qkv", qkv, lambda a, s=s: a[:, s], heads) for c, s in parts.items()},
        **{f"b{c}": ("b_qkv", b_qkv, lambda a, s=s: a[:, s], biases) for c, s in parts.items()},
        "w_gate": ("w_gate_up", gate_up, lambda a: a[:, 0], t), "w_up": ("w_gate_up", gate_up, lambda a: a[:, 1], t),
        "wo": ("wo", (h, cfg.num_heads * d), same, t), "w_down": ("w_down", (h, i), same, t),
        "attn_norm": ("attn_norm", (h,), same, same), "mlp_norm": ("mlp_norm", (h,), same, same),
        "embed": ("embed", (cfg.vocab_size, h), same, same), "final_norm": ("final_norm", (h,), same, same),
        "lm_head": ("lm_head", (cfg.vocab_size, h), same, t),  # stored [H, V] -> [V, H]
    }


def text_params(cfg: LlamaConfig, jobs: list[Job], dtype, place: Callable[[str, np.ndarray], object]) -> dict:
    """Stored-layout pieces (`jobs`, each layer's together) -> the runtime text params, each tensor
    built in `dtype` on the host and replaced by what `place("text.<path>", array)` returns."""
    targets = _targets(cfg)
    params: dict = {"layers": [{} for _ in range(cfg.num_layers)]}
    filling: dict[tuple, list] = {}  # (layer, runtime leaf) -> [array, pieces still to come]
    for path, index, take in jobs:
        name, shape, part, layout = targets[path.rsplit(".", 1)[-1]]
        key = (index, name)
        piece = take()  # checked against the config's shapes before the runtime tensor is allocated
        if key not in filling:
            filling[key] = [aligned_empty(shape, dtype), _PARTS.get(name, 1)]
        copy_into(part(filling[key][0]), layout(piece))  # cast to dtype while copied
        del piece  # before `place`: the runtime tensor is all that is left of it
        filling[key][1] -= 1
        if filling[key][1] == 0:
            where = f"layers.{index}.{name}" if index is not None else name
            (params if index is None else params["layers"][index])[name] = place(f"text.{where}", filling.pop(key)[0])
    if filling:
        raise ValueError(f"runtime tensors left incomplete: {sorted(filling)[:3]}")
    return {**params, "layers": tuple(params["layers"])}


def stored_jobs(tensors: dict, num_layers: int) -> list[Job]:
    """A converted folder's text tensors (stored path without "text." -> a handle with `read()` and,
    stacked, `layer(i)`) as `text_params`' jobs: the unstacked first, then layer after layer."""
    jobs: list[Job] = [(path, None, tensors[path].read) for path in tensors if not path.startswith("layers.")]
    for index in range(num_layers):
        jobs += [(path, index, tensors[path].layer(index).read) for path in tensors if path.startswith("layers.")]
    return jobs
