"""Reductions shared by selection, merging and greedy decoding (no model code)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def first_max(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(index of the first maximum, the maximum) along the last axis: `jnp.argmax`'s index, as two
    plain reductions. XLA:CPU's argmax (one variadic reduce over values and indices) is 2.5-3.3x
    slower: `merge.assign` on a 4096 x 818-slot layer 41 -> 16 ms, greedy decode's [1, 49152]
    logits 210 -> 63 us."""
    top = x.max(-1, keepdims=True)
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    first = jnp.where(x == top, index, x.shape[-1] - 1).min(-1)  # a NaN row (no equal) -> the last index
    return first, top[..., 0]
