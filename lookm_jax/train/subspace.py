"""Where the adapters may read: per adapted projection, the input directions that picture conversations
use and text-only prompts do not.

An adapted projection W + b @ a changes a token's output by b @ (a @ x): nothing for an input x with
a @ x = 0. Stage 2 (issue 29) must leave the frozen decoder's text behaviour alone while it teaches the
decoder to read pictures, and a replay penalty alone (`decoder.replay_metrics`) left 0.77 of the
greedy text tokens unchanged. So an adapter may be restricted to read only a k-dimensional subspace of
its input: the directions in which picture conversations' inputs carry the most energy relative to
text-only prompts' (the top-k generalized eigenvectors of the two second moments), where text-only
prompts carry almost none. Its a becomes (a @ Q) @ Q.T with Q [In, k] orthonormal; shipped, that is
an ordinary adapter (`adapters.fold` is unchanged).

The second moments are sums of x x^T over the valid tokens of each projection's input
(`input_moments`): over text-only prompts under the frozen decoder, and over picture conversations
under the model a run starts from (its adapters unrestricted: the inputs it learned to read). From its
first step the run applies its adapters restricted, the starting ones included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax.models import llama

Bases = tuple  # one {weight name: Q [In, k] fp32, orthonormal columns} per layer
RIDGE = 1e-3  # RIDGE x text's mean eigenvalue is added to its second moment's eigenvalues before whitening


def input_moments(cfg: llama.LlamaConfig, text_params: dict, x: jax.Array, valid: jax.Array) -> dict[str, jax.Array]:
    """Sum over valid tokens of x_in x_in^T for the input x_in of every adapted projection.

    x [B, L, H] embeddings, valid [B, L] -> {weight name (`llama.ADAPTED_WEIGHTS`): [N, In, In] fp32}, N
    layers. The decoder runs as `llama.encode` runs it (adapters in `text_params` applied)."""
    positions = jnp.broadcast_to(jnp.arange(x.shape[1]), valid.shape)
    cos, sin = llama.rope_tables(cfg, positions, x.dtype)
    counted = valid[..., None].astype(jnp.float32)  # [B, L, 1]
    branches = [lambda lp=lp: lp for lp in text_params["layers"]]

    def layer(h, index):
        lp = jax.lax.switch(index, branches)
        seen = {}

        def tap(name, inputs):  # inputs [B, L, In]
            inputs = inputs.astype(jnp.float32)
            seen[name] = jnp.einsum("bli,blj->ij", inputs * counted, inputs, precision=jax.lax.Precision.HIGHEST)

        q, k, v = llama.project_qkv(cfg, lp, h, cos, sin, tap=tap)
        attn, _ = llama.causal_attention(q, k, v, valid)
        return llama.finish_layer(cfg, lp, h, attn, tap=tap), seen

    _, moments = jax.lax.scan(layer, x, jnp.arange(len(text_params["layers"])))
    return moments


def top_directions(wanted: np.ndarray, avoided: np.ndarray, dims: int) -> np.ndarray:
    """Q [D, dims], orthonormal: the span of the `dims` directions u maximising
    (u^T wanted u) / (u^T avoided u) (each second moment [D, D] scaled to unit trace first; RIDGE x the
    mean eigenvalue added to `avoided`'s, so directions no text uses rank by `wanted` alone)."""
    size = wanted.shape[0]
    if not 1 <= dims <= size:
        raise ValueError(f"subspace dims must be in 1..{size} (the projection's input size), got {dims}")
    wanted, avoided = (np.asarray(m, np.float64) / max(np.trace(m), 1e-30) for m in (wanted, avoided))
    values, vectors = np.linalg.eigh(avoided)
    whiten = vectors / np.sqrt(np.maximum(values, 0.0) + RIDGE / size)  # whiten.T @ avoided @ whiten ~ I
    _, ranked = np.linalg.eigh(whiten.T @ wanted @ whiten)  # ascending
    basis, _ = np.linalg.qr(whiten @ ranked[:, -dims:])
    return basis.astype(np.float32)


def bases(picture_moments: dict, text_moments: dict, dims: int) -> Bases:
    """Per layer and adapted weight, `top_directions` of the picture conversations' inputs against the
    text-only prompts' (`input_moments` of each, summed over batches)."""
    layers = len(next(iter(text_moments.values())))
    return tuple({name: jnp.asarray(top_directions(picture_moments[name][i], text_moments[name][i], dims))
                  for name in llama.ADAPTED_WEIGHTS} for i in range(layers))


def restrict(adapters: tuple, restriction: Bases) -> tuple:
    """Adapters whose a [R, In] reads only its basis Q's span: a -> (a @ Q) @ Q.T."""
    return tuple({name: {**ad, "a": (ad["a"] @ basis[name]) @ basis[name].T} for name, ad in layer.items()}
                 for layer, basis in zip(adapters, restriction, strict=True))


def flatten(restriction: Bases) -> dict[str, np.ndarray]:
    return {f"layers.{i}.{name}": np.asarray(q) for i, layer in enumerate(restriction) for name, q in layer.items()}


def unflatten(flat: dict[str, np.ndarray], layers: int) -> Bases:
    return tuple({name: jnp.asarray(flat[f"layers.{i}.{name}"]) for name in llama.ADAPTED_WEIGHTS}
                 for i in range(layers))
