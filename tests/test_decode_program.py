"""The compiled decode program: no weight- or cache-sized buffer is copied inside its while loop.

Compiled (not run) from shapes alone. Sizes are picked so that every weight and every layer's
cache is larger than any activation of a decode step (logits, scores, MLP activations), so an
instruction in a loop body whose result is that large is a copy of a weight or of the cache: a
slice of a stacked array, a copy before an update, a transposed read. The cache's in-place
updates (dynamic-update-slice fusions, whose result is the buffer they update) are the exception.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp

from lookm_jax import generate as gen
from lookm_jax.cache import KVCache
from lookm_jax.convert.tables import llama_shapes
from lookm_jax.models import llama
from lookm_jax.models.config import LlamaConfig

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=16, tie_word_embeddings=True)
BATCH, CAPACITY, NEW = 2, 48, 8
# The smallest weight (wo: 64 x 64) and one layer's cache keys (2 x 2 x 16 x 48) are both >= this;
# no activation of a decode step is (the largest, the logits, is 2 x 96).
BIG = 2048
_PASS_THROUGH = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional",
                 "constant", "after-all", "opt-barrier"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(?P<name>\S+) = (?P<shape>.+?) (?P<op>[a-z][a-z0-9\-]*)\(")


def _computations(hlo: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines, from compiled HLO text."""
    comps, current = {}, None
    for line in hlo.splitlines():
        if current is None and line[:1] not in ("", " ") and line.rstrip().endswith("{"):
            current = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            comps[current] = []
        elif line.strip() == "}":
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps


def _elements(shape: str) -> int:
    return max((math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\[([\d,]*)\]", shape)),
               default=1)


def loop_body_buffers(hlo: str, threshold: int) -> list[tuple[str, str, str]]:
    """(op, shape, name) of every instruction run by a while loop body (nested loops, calls and
    branches included; not the insides of fusions) whose result has >= threshold elements, except
    pass-through ops and in-place dynamic-update-slice fusions."""
    comps = _computations(hlo)
    todo = [m for lines in comps.values() for line in lines if " while(" in line
            for m in re.findall(r"body=%?([\w.\-]+)", line)]
    seen, found = set(), []
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            match = _INSTRUCTION.match(line)
            if not match or match["op"] == "fusion" and "dynamic-update-slice_fusion" in match["name"]:
                continue
            if match["op"] != "fusion":
                todo += re.findall(r"(?:body|to_apply|true_computation|false_computation)=%?([\w.\-]+)", line)
                todo += [c.strip().lstrip("%") for c in re.findall(r"branch_computations=\{([^}]*)\}", line)
                         for c in c.split(",")]
            if match["op"] not in _PASS_THROUGH and _elements(match["shape"]) >= threshold:
                found.append((match["op"], match["shape"].split("{")[0], match["name"]))
    return found


def _abstract(tree):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), tree, is_leaf=lambda x: isinstance(x, tuple))


def _decode_hlo() -> str:
    shapes = {k: v for k, v in llama_shapes(CFG).items() if k != "lm_head"}
    stored = {"layers": {}}
    for path, shape in shapes.items():
        (stored["layers"] if path.startswith("layers.") else stored)[path.split(".")[-1]] = shape
    params = jax.eval_shape(functools.partial(llama.runtime_params, CFG), _abstract(stored))
    kv = jax.ShapeDtypeStruct((BATCH, CFG.num_kv_heads, CAPACITY, CFG.head_dim), jnp.float32)
    keys = jax.ShapeDtypeStruct((BATCH, CFG.num_kv_heads, CFG.head_dim, CAPACITY), jnp.float32)  # [B, Hkv, D, S]
    positions = jax.ShapeDtypeStruct(kv.shape[:-1], jnp.int32)
    n = CFG.num_layers
    cache = KVCache(layer_keys=(keys,) * n, layer_values=(kv,) * n, layer_positions=(positions,) * n,
                    cursor=jax.ShapeDtypeStruct((), jnp.int32), next_position=jax.ShapeDtypeStruct((BATCH,), jnp.int32))
    first = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
    return gen.decode.lower(CFG, params, first, cache, jax.random.key(0), max_new_tokens=NEW,
                            sampling=gen.Sampling(), eos_ids=(1,)).compile().as_text()


def test_decode_loop_copies_no_weight_or_cache_buffer():
    hlo = _decode_hlo()
    assert " while(" in hlo
    assert not loop_body_buffers(hlo, BIG)


def test_detector_sees_stacked_weights_sliced_in_a_loop():
    """Positive control: a scan over stacked layer weights inside a while loop (the layout before
    the per-layer one) slices, hence copies, a weight on every step."""
    weights = jax.ShapeDtypeStruct((CFG.num_layers, 64, 64), jnp.float32)

    def run(w):
        def body(state):
            i, h = state
            return i + 1, jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), h, w)[0]

        return jax.lax.while_loop(lambda s: s[0] < NEW, body, (0, jnp.ones((1, 64))))[1]

    found = loop_body_buffers(jax.jit(run).lower(weights).compile().as_text(), BIG)
    assert any(shape.endswith("[64,64]") for _, shape, _ in found), found
