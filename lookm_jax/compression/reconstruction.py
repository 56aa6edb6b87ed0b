"""Context reconstruction (KVzip, Kim et al. 2025): a prompt encoded twice, so that how the second copy
reads the first scores the first's tokens without knowing the question that will follow.

The prefill (`lookm_jax.generate`) encodes each row as [prompt ; prompt] when a method asks for the
``RECONSTRUCTION`` statistic: the first copy's keys, values and hidden states are the plain prefill's
(attention is causal), and each first-copy token is scored by the largest attention any query of the
second copy pays it. The cache keeps first-copy slots only and continues after the first copy, so the
second copy costs prefill time (about twice the tokens, four times the attention) and no cache memory.
Pure array code: it imports no model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lookm_jax.compression.scoring import RECONSTRUCTION, STATISTICS


def _doubled_layout(valid: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """valid [B, L] -> [B, 2L] each: the first copy's positions, the second's, and the prompt token each copies."""
    length = valid.shape[1]
    n = valid.sum(axis=-1)[:, None]  # [B, 1]
    index = jnp.arange(2 * length)[None, :]  # [1, 2L]
    first = index < n
    second = (index >= n) & (index < 2 * n)
    return first, second, jnp.clip(jnp.where(first, index, index - n), 0, length - 1)


def doubled_marks(marks: jax.Array, valid: jax.Array) -> jax.Array:
    """Per-token marks [B, L] bool (e.g. `is_image`) -> [B, 2L], laid out as `doubled_prompt` lays out its rows."""
    first, second, source = _doubled_layout(valid)
    return jnp.take_along_axis(marks, source, axis=1) & (first | second)


def doubled_prompt(x: jax.Array, valid: jax.Array, positions: jax.Array,
                   next_position: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, dict]:
    """Right-padded rows, each followed by a copy of itself.

    x [B, L, H] embeddings, valid [B, L] (row b's n_b tokens first), positions [B, L] or M-RoPE's
    [3, B, L], next_position [B] (where a token after the prompt goes). Returns, over 2L: x, valid
    ([B, 2L]: row b's prompt at 0 .. n_b - 1, its copy at n_b .. 2 n_b - 1, then padding), positions
    (the copy's are the prompt's + next_position, as if it followed the prompt) and the queries each
    statistic counts: the prompt's own statistics (``STATISTICS``) the first copy's, ``RECONSTRUCTION``
    the second copy's.
    """
    first, second, source = _doubled_layout(valid)
    x2 = jnp.where((first | second)[..., None], jnp.take_along_axis(x, source[..., None], axis=1), 0).astype(x.dtype)
    shift = jnp.where(second, next_position[:, None], 0)  # [B, 2L]
    gathered = jnp.take_along_axis(positions, jnp.broadcast_to(source, positions.shape[:-1] + source.shape[-1:]),
                                   axis=-1)
    positions2 = jnp.where(first | second, gathered + shift, 0).astype(positions.dtype)
    query_masks = {name: first for name in STATISTICS} | {RECONSTRUCTION: second}
    return x2, first | second, positions2, query_masks
