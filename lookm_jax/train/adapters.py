"""Low-rank adapters (LoRA) on the decoder's projections: made, applied on the fly, folded, stored.

Every layer gets one adapter per weight of `llama.ADAPTED_WEIGHTS` (the fused q/k/v projection, the
output projection, the fused gate/up projection and the down projection), each seen as one
[Out, In] matrix W of the runtime layout. The adapted weight is W + scale * b @ a, with a [R, In]
drawn at random and b [Out, R] zero at the start (LoRA's initialisation: training starts from the
frozen decoder's outputs exactly).

While training, `apply` puts {"a", "b" * scale} into each layer's params and `llama.dense` adds
(x @ a.T) @ b.T: no dense weight gradient is ever formed. Shipped, `fold` adds scale * b @ a into
the weights once, so the model stays a plain decoder and decode costs what it did. Adapters trained on
image tokens only (partial LoRA) are shipped unfolded (`stacked`, a model's "image_adapters"): a pass
over a prompt applies them at its image tokens, and decode, all text, runs the plain weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax.models import llama

Adapters = tuple  # one {weight name: {"a": [R, In], "b": [Out, R]}} per layer
# Which tokens a run's adapters update (`DecoderConfig.adapted_tokens`, an exported file's "adapted_tokens"):
# every token (folded when shipped), or the image tokens only (partial LoRA, as InternLM-XComposer2's: text
# tokens, and so every text-only prompt, run the frozen decoder exactly; shipped unfolded, `stacked`)
ADAPTED_TOKENS = ("all", "image")


def matrix_shape(weight: jax.Array) -> tuple[int, int]:
    """(Out, In) of a runtime weight as `llama.dense` uses it (its minor axis is In)."""
    return int(np.prod(weight.shape[:-1])), int(weight.shape[-1])


def init(text_params: dict, rank: int, seed: int) -> Adapters:
    """Adapters of `rank` for every layer of runtime text params: a ~ U(+-1/sqrt(In)) (kaiming-uniform
    as in LoRA), b = 0."""
    if rank < 1:
        raise ValueError(f"adapter rank must be >= 1, got {rank}")
    rng = np.random.default_rng(seed)
    layers = []
    for lp in text_params["layers"]:
        layer = {}
        for name in llama.ADAPTED_WEIGHTS:
            out, inp = matrix_shape(lp[name])
            bound = 1.0 / np.sqrt(inp)
            layer[name] = {"a": jnp.asarray(rng.uniform(-bound, bound, (rank, inp)), jnp.float32),
                           "b": jnp.zeros((out, rank), jnp.float32)}
        layers.append(layer)
    return tuple(layers)


def apply(text_params: dict, adapters: Adapters, scale: float, tokens: jax.Array | None = None) -> dict:
    """Runtime text params whose layers carry the adapters (b scaled), applied on the fly by `llama.dense`;
    only at the tokens marked in `tokens` [B, L] (bool, e.g. the image tokens) when given, everywhere else
    the frozen weights alone."""
    only = {} if tokens is None else {"tokens": tokens}
    layers = tuple({**lp, "adapters": {name: {"a": ad["a"], "b": scale * ad["b"], **only} for name, ad in layer.items()}}
                   for lp, layer in zip(text_params["layers"], adapters, strict=True))
    return {**text_params, "layers": layers}


def fold(text_params: dict, adapters: Adapters, scale: float) -> dict:
    """Runtime text params with W + scale * b @ a in place of each adapted W (computed in fp32, cast
    to W's dtype): the same function as `apply`, as plain weights."""
    def folded(w, ad):
        delta = scale * (ad["b"].astype(jnp.float32) @ ad["a"].astype(jnp.float32))  # [Out, In]
        return (w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype)

    layers = tuple({**lp, **{name: folded(lp[name], ad) for name, ad in layer.items()}}
                   for lp, layer in zip(text_params["layers"], adapters, strict=True))
    return {**text_params, "layers": layers}


def stacked(adapters: Adapters) -> dict:
    """{name: {"a": [N, R, In], "b": [N, Out, R]}} float32 numpy: a model's "image_adapters" (models/llava.py),
    for adapters that act on image tokens only and so cannot be folded."""
    return {name: {part: np.stack([np.asarray(layer[name][part], np.float32) for layer in adapters])
                   for part in ("a", "b")} for name in adapters[0]}


def flatten(adapters: Adapters) -> dict[str, np.ndarray]:
    """{"layers.{i}.{weight}.a" | ".b": array}: the safetensors names of the shipped adapters."""
    return {f"layers.{i}.{name}.{part}": np.asarray(ad[part], np.float32)
            for i, layer in enumerate(adapters) for name, ad in layer.items() for part in ("a", "b")}


def unflatten(flat: dict[str, np.ndarray], text_params: dict) -> Adapters:
    """The inverse of `flatten`, checked against runtime text params: every layer and weight present,
    shapes [R, In] and [Out, R] with one rank throughout (ValueError naming the first that is not)."""
    layers, ranks = [], set()
    expected = {f"layers.{i}.{name}.{part}" for i in range(len(text_params["layers"]))
                for name in llama.ADAPTED_WEIGHTS for part in ("a", "b")}
    if set(flat) != expected:
        odd = sorted(set(flat) ^ expected)
        raise ValueError(f"adapters do not match the decoder's {len(text_params['layers'])} layers "
                         f"(first differing tensor: {odd[0]})")
    for i, lp in enumerate(text_params["layers"]):
        layer = {}
        for name in llama.ADAPTED_WEIGHTS:
            a, b = flat[f"layers.{i}.{name}.a"], flat[f"layers.{i}.{name}.b"]
            out, inp = matrix_shape(lp[name])
            if a.ndim != 2 or b.ndim != 2 or a.shape[1] != inp or b.shape[0] != out or a.shape[0] != b.shape[1]:
                raise ValueError(f"adapter layers.{i}.{name}: a {a.shape} and b {b.shape} do not fit the weight "
                                 f"[{out}, {inp}] (need a [R, {inp}], b [{out}, R])")
            ranks.add(a.shape[0])
            layer[name] = {"a": jnp.asarray(a), "b": jnp.asarray(b)}
        layers.append(layer)
    if len(ranks) > 1:
        raise ValueError(f"adapters mix ranks {sorted(ranks)}")
    return tuple(layers)
