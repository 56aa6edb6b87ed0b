"""Name-mapping tables: Hugging Face tensor names -> our params pytree, one table per architecture.

Every row is (our path, HF name, transform). "{i}" in an HF name marks a per-layer tensor; those
are stacked on a leading layer axis under our path. Transforms turn torch layouts into ours
([out, in] linear weights become [in, out]). Shapes are asserted against the config after mapping.
"""

from __future__ import annotations

import functools
import json
import math
import mmap
import os
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import ml_dtypes
import numpy as np

from lookm_jax.models.config import CLIPVisionConfig, LlamaConfig, LlavaConfig
from lookm_jax.models.llama import ADAPTED_WEIGHTS

Transform = Callable[[np.ndarray], np.ndarray] | None


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or holds tensors that do not fit its config."""


class ShapesOnly(dict):
    """An empty `tensors` for a converter's dry run: `apply_table` reads nothing and puts, in place of
    each tensor the config has, the shape it implies (a tuple, or a list of the accepted ones)."""


def accepted_shapes(expected: tuple | list) -> list[tuple[int, ...]]:
    """A shapes table's entry -> the shapes it accepts (`apply_table`, `hf.check_shapes`)."""
    return expected if isinstance(expected, list) else [expected]


def read_json_object(path: str, required: tuple[str, ...] = ()) -> dict:
    """A checkpoint's JSON file that must hold an object (with the `required` keys); anything else
    raises CheckpointError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, OSError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got a {type(data).__name__}")
    missing = [key for key in required if key not in data]
    if missing:
        raise CheckpointError(f"{path}: missing {', '.join(missing)}")
    return data


def _t(w: np.ndarray) -> np.ndarray:
    """torch Linear [out, in] -> ours [in, out] (a view; made contiguous once, when stacked)."""
    return w.T


def _conv_to_matrix(w: np.ndarray) -> np.ndarray:
    """Patch conv [Hv, C, p, p] -> [C*p*p, Hv], matching `clip.patchify`'s (C, p, p) order."""
    return w.reshape(w.shape[0], -1).T


LLAMA_TABLE: list[tuple[str, str, Transform]] = [
    ("embed", "model.embed_tokens.weight", None),
    ("final_norm", "model.norm.weight", None),
    ("lm_head", "lm_head.weight", _t),
    ("layers.attn_norm", "model.layers.{i}.input_layernorm.weight", None),
    ("layers.wq", "model.layers.{i}.self_attn.q_proj.weight", _t),
    ("layers.wk", "model.layers.{i}.self_attn.k_proj.weight", _t),
    ("layers.wv", "model.layers.{i}.self_attn.v_proj.weight", _t),
    ("layers.wo", "model.layers.{i}.self_attn.o_proj.weight", _t),
    ("layers.mlp_norm", "model.layers.{i}.post_attention_layernorm.weight", None),
    ("layers.w_gate", "model.layers.{i}.mlp.gate_proj.weight", _t),
    ("layers.w_up", "model.layers.{i}.mlp.up_proj.weight", _t),
    ("layers.w_down", "model.layers.{i}.mlp.down_proj.weight", _t),
    ("layers.bq", "model.layers.{i}.self_attn.q_proj.bias", None),
    ("layers.bk", "model.layers.{i}.self_attn.k_proj.bias", None),
    ("layers.bv", "model.layers.{i}.self_attn.v_proj.bias", None),
]
# Rows present only when the config has q/k/v biases (LlamaConfig.qkv_bias: Qwen2).
LLAMA_QKV_BIAS = ("layers.bq", "layers.bk", "layers.bv")

CLIP_TABLE: list[tuple[str, str, Transform]] = [
    ("patch_embed", "embeddings.patch_embedding.weight", _conv_to_matrix),
    ("class_embed", "embeddings.class_embedding", None),
    ("pos_embed", "embeddings.position_embedding.weight", None),
    ("pre_norm_w", "pre_layrnorm.weight", None),
    ("pre_norm_b", "pre_layrnorm.bias", None),
    *[(f"layers.{ours}_{wb}", f"encoder.layers.{{i}}.{hf}.{'weight' if wb == 'w' else 'bias'}", None)
      for ours, hf in (("ln1", "layer_norm1"), ("ln2", "layer_norm2")) for wb in "wb"],
    *[(f"layers.{ours}", f"encoder.layers.{{i}}.{hf}.weight", _t)
      for ours, hf in (("wq", "self_attn.q_proj"), ("wk", "self_attn.k_proj"), ("wv", "self_attn.v_proj"),
                       ("wo", "self_attn.out_proj"), ("fc1_w", "mlp.fc1"), ("fc2_w", "mlp.fc2"))],
    *[(f"layers.{ours}", f"encoder.layers.{{i}}.{hf}.bias", None)
      for ours, hf in (("bq", "self_attn.q_proj"), ("bk", "self_attn.k_proj"), ("bv", "self_attn.v_proj"),
                       ("bo", "self_attn.out_proj"), ("fc1_b", "mlp.fc1"), ("fc2_b", "mlp.fc2"))],
]
# Present in checkpoints, deliberately unused: CLIP's pooled-output norm and a position-id buffer.
CLIP_UNUSED = ("post_layernorm.weight", "post_layernorm.bias", "embeddings.position_ids")

# SigLIP (LLaVA-OneVision's tower): CLIP's layers, a biased patch conv, no class token or pre-layernorm.
SIGLIP_TABLE: list[tuple[str, str, Transform]] = [
    ("patch_bias", "embeddings.patch_embedding.bias", None),
    *[row for row in CLIP_TABLE if row[0] not in ("class_embed", "pre_norm_w", "pre_norm_b")],
]
# Deliberately unused: the post-layernorm and the attention-pooling head (`head.*`, saved when
# vision_use_head is true) only feed SigLIP's pooled output, which LLaVA-OneVision never reads.
SIGLIP_UNUSED = ("post_layernorm.weight", "post_layernorm.bias", "embeddings.position_ids")
SIGLIP_HEAD = "head."

PROJECTOR_TABLE: list[tuple[str, str, Transform]] = [
    ("w1", "linear_1.weight", _t), ("b1", "linear_1.bias", None),
    ("w2", "linear_2.weight", _t), ("b2", "linear_2.bias", None),
]

# LLaVA checkpoints name the same tensors several ways (hub: language_model.model.*,
# vision_tower.vision_model.*; transformers 5.x: vision_tower.*, model.language_model.*).
# Each is rewritten to one canonical prefix before the tables apply.
_PREFIXES = [
    # Original LLaVA layout (liuhaotian LLaVA-1.5, InternVL-Chat-ViT-6B, MobileVLM): the tower wrapper's
    # own `vision_tower` attribute; `mm_projector.{0,2}` is the llava-hf projector under other names.
    (r"^model\.vision_tower\.vision_tower\.(vision_model\.)?", "vision."),
    (r"^model\.mm_projector\.0\.", "projector.linear_1."),
    (r"^model\.mm_projector\.2\.", "projector.linear_2."),
    (r"^model\.mm_projector\.", "projector."),
    (r"^(model\.)?language_model\.model\.", "model."),
    (r"^model\.language_model\.", "model."),
    (r"^(model\.)?language_model\.lm_head\.", "lm_head."),
    (r"^(model\.)?vision_tower\.(vision_model\.)?", "vision."),
    (r"^(model\.)?multi_modal_projector\.", "projector."),
    (r"^(model\.)?image_newline$", "projector.image_newline"),  # LLaVA-NeXT's learned newline
    (r"^(model\.)?visual\.", "vision."),  # Qwen2-VL's tower and merger
]


def canonical_name(name: str) -> str:
    for pattern, repl in _PREFIXES:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    return name


def llama_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    n, h, d, i = cfg.num_layers, cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    return {"embed": (cfg.vocab_size, h), "final_norm": (h,), "lm_head": (h, cfg.vocab_size),
            "layers.attn_norm": (n, h), "layers.mlp_norm": (n, h),
            "layers.wq": (n, h, cfg.num_heads * d), "layers.wk": (n, h, cfg.num_kv_heads * d),
            "layers.wv": (n, h, cfg.num_kv_heads * d), "layers.wo": (n, cfg.num_heads * d, h),
            "layers.w_gate": (n, h, i), "layers.w_up": (n, h, i), "layers.w_down": (n, i, h),
            **({"layers.bq": (n, cfg.num_heads * d), "layers.bk": (n, cfg.num_kv_heads * d),
                "layers.bv": (n, cfg.num_kv_heads * d)} if cfg.qkv_bias else {})}


# Decoder adapters acting on image tokens only (`LlavaConfig.image_adapter_rank`, models/llava.py): only
# in lookm's own converted folders (the demo's), named image_adapters.{weight}.{a|b}, stacked over layers.
IMAGE_ADAPTER_TABLE: list[tuple[str, str, Transform]] = [
    (f"{weight}.{part}", f"layers.{{i}}.{weight}.{part}", None)
    for weight in ADAPTED_WEIGHTS for part in ("a", "b")]


def image_adapter_shapes(cfg: LlavaConfig) -> dict[str, tuple[int, ...]]:
    """a [N, R, In] and b [N, Out, R] of each adapted weight, seen as the [Out, In] matrix `llama.dense` uses."""
    text, r = cfg.text, cfg.image_adapter_rank
    h, i, d = text.hidden_size, text.intermediate_size, text.head_dim
    matrices = {"w_qkv": ((text.num_heads + 2 * text.num_kv_heads) * d, h), "wo": (h, text.num_heads * d),
                "w_gate_up": (2 * i, h), "w_down": (h, i)}
    return {f"{name}.{part}": (text.num_layers, *((r, inp) if part == "a" else (out, r)))
            for name, (out, inp) in matrices.items() for part in ("a", "b")}


def clip_shapes(cfg: CLIPVisionConfig) -> dict[str, tuple[int, ...]]:
    n, h, i = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    shapes = {"patch_embed": (cfg.num_channels * cfg.patch_size**2, h), "class_embed": (h,),
              "pos_embed": (cfg.num_patches + 1, h), "pre_norm_w": (h,), "pre_norm_b": (h,),
              "layers.fc1_w": (n, h, i), "layers.fc1_b": (n, i), "layers.fc2_w": (n, i, h),
              "layers.fc2_b": (n, h)}
    shapes.update({f"layers.{k}": (n, h, h) for k in ("wq", "wk", "wv", "wo")})
    shapes.update({f"layers.{k}": (n, h) for k in ("bq", "bk", "bv", "bo", "ln1_w", "ln1_b", "ln2_w", "ln2_b")})
    return shapes


def siglip_shapes(cfg: CLIPVisionConfig) -> dict[str, tuple[int, ...]]:
    shapes = {k: v for k, v in clip_shapes(cfg).items() if k not in ("class_embed", "pre_norm_w", "pre_norm_b")}
    shapes.update({"pos_embed": (cfg.num_patches, cfg.hidden_size), "patch_bias": (cfg.hidden_size,)})
    return shapes


def projector_shapes(cfg: LlavaConfig) -> dict[str, tuple[int, ...]]:
    h_in = cfg.vision.hidden_size * len(cfg.feature_layers)
    h = cfg.text.hidden_size
    return {"w1": (h_in, h), "b1": (h,), "w2": (h, h), "b2": (h,)}


def set_path(tree: dict, path: str, value) -> None:
    """tree["a"]["b"]["c"] = value for path "a.b.c", making the missing dicts."""
    *parents, leaf = path.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[leaf] = value


# Large tensors are checked, copied and cast in blocks on every core: NumPy releases the GIL meanwhile.
_THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_POOL = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="lookm-load")


def _on_every_core(work: Callable[[list], object], blocks: list) -> list:
    """work(every _THREADS-th block) on each thread -> their results (inline for a single block)."""
    if len(blocks) <= 1:
        return [work(blocks)]
    return list(_POOL.map(work, [blocks[i::_THREADS] for i in range(_THREADS)]))


_EXPONENT_BITS = {np.dtype(np.float16): 0x7C00, np.dtype(ml_dtypes.bfloat16): 0x7F80}
_FINITE_BLOCK = 1 << 18  # elements checked at once: the check's temporaries stay < 1 MiB, whatever the tensor


def all_finite(a: np.ndarray) -> bool:
    """No NaN or inf in `a`, checked block by block on every core. A 16-bit float is read as its bits:
    it is NaN or inf when its magnitude bits (sign cleared) reach all exponent bits set, so one masked
    copy into a reused buffer and one max per block do it, ~10x faster than NumPy's isfinite on
    float16 and bfloat16, which convert every element."""
    bits = _EXPONENT_BITS.get(a.dtype)
    if bits is None and a.dtype.kind not in "fc":  # bfloat16's kind is "V": it is known by its bits
        return True
    flat = a.reshape(-1)

    def finite(starts) -> bool:
        magnitude = np.empty(min(_FINITE_BLOCK, flat.size), np.uint16)
        for start in starts:
            block = flat[start:start + _FINITE_BLOCK]
            if bits is None:
                if not np.isfinite(block).all():
                    return False
                continue
            out = magnitude[:block.size]
            if np.bitwise_and(block.view(np.uint16), 0x7FFF, out=out).max() >= bits:
                return False
        return True

    return all(_on_every_core(finite, list(range(0, flat.size, _FINITE_BLOCK))))


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """np.empty on pages of its own: page-aligned, so XLA:CPU adopts the buffer as a device array
    without copying it (`jax.device_put`), and mapped without NumPy's huge-page advice, which where
    the kernel's THP defrag is `madvise` stalls first touches compacting memory (here 1 GiB was
    written in 1.4-2.6 s on NumPy's buffers, 0.4 s on plain pages). Unmapped when the array goes."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(pages, dtype, math.prod(shape)).reshape(shape)


_BLOCK_BYTES = 4 << 20
_TILE = 128


def _blocks(target: np.ndarray, source: np.ndarray) -> list:
    """Index expressions covering target: ~4 MiB row blocks (NumPy casts a whole contiguous array
    through a temporary as large as it), or, for a 2-D source read across its rows (a transposed
    view), 128 x 128 tiles, which keep both sides in cache (2.5x faster than row blocks)."""
    if target.ndim == 2 and source.strides[-1] != source.itemsize and min(target.shape) > _TILE:
        return [(slice(i, i + _TILE), slice(j, j + _TILE))
                for i in range(0, target.shape[0], _TILE) for j in range(0, target.shape[1], _TILE)]
    rows = max(1, _BLOCK_BYTES // max(target[:1].nbytes, 1))
    return [slice(first, first + rows) for first in range(0, len(target), rows)]


def copy_into(target: np.ndarray, source: np.ndarray) -> None:
    """target[...] = source (same shape, cast to target's dtype), in blocks copied by a thread per core."""
    if target.ndim == 0:
        target[...] = source
        return

    def copy(blocks):
        for block in blocks:
            target[block] = source[block]

    _on_every_core(copy, _blocks(target, source))


class Source(Mapping):
    """Checkpoint tensors by canonical name, each read from its file when it is taken (`pop` or
    `[]`), so that a converter holds one tensor at a time. A handle has `shape`, `dtype` and
    `read() -> np.ndarray`. `apply_table` hands each parameter it finishes to `place(path, array)`
    (e.g. onto a device, or into a file) and keeps what that returns."""

    def __init__(self, handles: dict, place: Callable[[str, np.ndarray], object] | None = None):
        self.handles = dict(handles)
        self._place = place

    def __getitem__(self, name: str) -> np.ndarray:
        return self.handles[name].read()

    def __contains__(self, name) -> bool:
        return name in self.handles

    def __iter__(self):
        return iter(self.handles)

    def __len__(self) -> int:
        return len(self.handles)

    def __delitem__(self, name: str) -> None:
        del self.handles[name]

    def pop(self, name: str) -> np.ndarray:
        return self.handles.pop(name).read()

    def place(self, path: str, value: np.ndarray):
        return value if self._place is None else self._place(path, value)


def drop(tensors, name: str) -> None:
    """Remove a tensor that is deliberately unused, without reading it."""
    if name in tensors:
        del tensors[name]


def _row_names(prefix: str, hf_name: str, num_layers: int) -> list[str]:
    return [prefix + hf_name.format(i=i) for i in range(num_layers)] if "{i}" in hf_name else [prefix + hf_name]


def _take(tensors, name: str, transform) -> np.ndarray:
    raw = tensors.pop(name)
    if not all_finite(raw):
        raise CheckpointError(f"checkpoint tensor {name} holds NaN or inf")
    return transform(raw)


def table_jobs(tensors, table, prefix: str, num_layers: int, shapes: dict, skip: tuple[str, ...] = (),
               layer_major: bool = False) -> list[tuple[str, int | None, Callable[[], np.ndarray]]]:
    """Every row's tensors as (our path, layer index or None, take), where `take()` pops the tensor
    out of `tensors` and returns it in our layout [*shape], checked finite and against the row's
    shape (a stacked row's without its leading layer axis); the caller holds the only reference,
    so it is freed as soon as the caller drops it. Rows in table order, each row's layers in
    turn; `layer_major`: the rows without layers, then every layer's rows together, layer after
    layer. A tensor missing from any row is refused here, before one is read."""
    last_layer = [prefix + hf_name.format(i=num_layers - 1) for ours, hf_name, _ in table
                  if ours not in skip and "{i}" in hf_name]  # before listing every layer's names (a config may say 2**31)
    if last_layer and last_layer[0] not in tensors:
        raise CheckpointError(f"the config gives {num_layers} layers, and the checkpoint lacks {last_layer[0]}")
    rows = [(ours, _row_names(prefix, hf_name, num_layers), "{i}" in hf_name, transform or (lambda a: a))
            for ours, hf_name, transform in table if ours not in skip]
    missing = [n for _, names, _, _ in rows for n in names if n not in tensors]
    if missing:
        raise CheckpointError(f"checkpoint lacks tensor(s) {missing[:3]}{'...' if len(missing) > 3 else ''}")

    def take(ours, index, name, transform):
        piece = _take(tensors, name, transform)
        accepted = [s[1:] if index is not None else s for s in accepted_shapes(shapes[ours])]
        if piece.shape not in accepted:
            raise CheckpointError(f"{name}: shape {piece.shape} after mapping to {ours!r}, config implies "
                                  f"{' or '.join(map(str, accepted))}{' per layer' if index is not None else ''}")
        return piece

    jobs = [(ours, i if stacked else None, functools.partial(take, ours, i if stacked else None, name, transform))
            for ours, names, stacked, transform in rows for i, name in enumerate(names)]
    if layer_major:
        jobs.sort(key=lambda job: -1 if job[1] is None else job[1])  # stable: table order within a layer
    return jobs


def apply_table(tensors: dict[str, np.ndarray], table, prefix: str, num_layers: int,
                shapes: dict[str, tuple[int, ...]], dtype, skip: tuple[str, ...] = (),
                placed_as: str | None = None) -> dict:
    """Take every row's tensors out of `tensors` (`table_jobs`) and build our nested params, each
    row's layers written into one stacked array of `dtype` (None: its first tensor's own dtype); a
    `Source` gets each finished row through its `place`, named `placed_as` (our params' prefix, when
    it is not the checkpoint's `prefix`) + the row's name. A `ShapesOnly` dry run: each row's
    expected shape, nothing read."""
    params: dict = {}
    if isinstance(tensors, ShapesOnly):
        for ours, _, _ in table:
            if ours not in skip:
                set_path(params, ours, shapes[ours])
        return params
    rows: dict[str, np.ndarray] = {}
    for ours, index, take in table_jobs(tensors, table, prefix, num_layers, shapes, skip):
        piece = take()
        if ours not in rows:
            rows[ours] = aligned_empty(piece.shape if index is None else (num_layers, *piece.shape), dtype or piece.dtype)
        copy_into(rows[ours] if index is None else rows[ours][index], piece)
        del piece  # before `place`: the row is all that is left of it
        if index is None or index == num_layers - 1:
            value = rows.pop(ours)
            name = (prefix if placed_as is None else placed_as) + ours
            set_path(params, ours, tensors.place(name, value) if isinstance(tensors, Source) else value)
    return params
