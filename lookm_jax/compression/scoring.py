"""Attention-received scores of prompt tokens, computed without an [L, L] matrix.

Every scorer here returns one score per KV head: with grouped-query attention the G = Hq / Hkv
query heads of a group are scored separately and their scores averaged (arithmetic mean).
Causality is by index along the prompt axis (query i sees keys j <= i); tokens with
``valid == False`` are neither queries nor keys.

Eq. 4 and RoCo only need column statistics of the prompt's softmax rows (``STATISTICS``: sums
and sums of squares over queries, per query head); KVzip's context-reconstruction score
(``RECONSTRUCTION``) is the column maximum over the queries of a second copy of the prompt
(``lookm_jax.compression.reconstruction``). The decoder's prefill attention accumulates
them while it attends (``models/llama.py``, ``causal_attention``), so a method that declares them
(``Method.statistics``) scores for almost nothing; those are the probabilities the model really
used (its dtype and matmul precision, softmax in fp32). The standalone functions here recompute
them from queries and keys: logits at Precision.HIGHEST (no TF32 / bf16 passes on GPU / TPU),
softmax and accumulation in fp32 whatever the input dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from lookm_jax.compression.select import count_from_end

_NEG = float(jnp.finfo(jnp.float32).min)  # finite mask value: an all-masked row gives no NaN


def _group(queries: jax.Array, num_kv_heads: int) -> jax.Array:
    """[B, Hq, L, D] -> [B, Hkv, G, L, D] fp32, scaled by 1/sqrt(D)."""
    b, hq, l, d = queries.shape
    if hq % num_kv_heads:
        raise ValueError(f"{hq} query heads do not split into {num_kv_heads} KV heads")
    q = queries.astype(jnp.float32) * d**-0.5
    return q.reshape(b, num_kv_heads, hq // num_kv_heads, l, d)


def _probs(q: jax.Array, k: jax.Array, q_pos: jax.Array, q_ok: jax.Array, k_ok: jax.Array) -> jax.Array:
    """Causal, padding-masked softmax rows of a set of queries over all keys.

    q [B, Hkv, G, Q, D] (pre-scaled fp32), k [B, Hkv, L, D], q_pos [B, Q] index of each query,
    q_ok [B, Q], k_ok [B, L]. Returns [B, Hkv, G, Q, L] fp32; rows of queries that are not q_ok
    are all zero.
    """
    logits = jnp.einsum("bhgqd,bhkd->bhgqk", q, k.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    k_pos = jnp.arange(k.shape[2])
    allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & k_ok[:, None, :]  # [B, Q, L]
    allowed = allowed[:, None, None]  # [B, 1, 1, Q, L]
    logits = jnp.where(allowed, logits, _NEG)
    e = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    return jnp.where(allowed & q_ok[:, None, None, :, None], p, 0.0)


SUMS = "sums"  # sum over valid queries i of p_ij (eq. 4 before the GQA mean)
SQUARES = "squares"  # sum over valid queries i of p_ij ** 2 (RoCo's spread)
STATISTICS = (SUMS, SQUARES)  # of the prompt's own attention
RECONSTRUCTION = "reconstruction"  # max over the queries of the prompt's second copy of p_ij (KVzip)
KNOWN_STATISTICS = STATISTICS + (RECONSTRUCTION,)


def counted_queries(names: tuple[str, ...], valid: jax.Array,
                    query_masks: dict[str, jax.Array] | None) -> dict[str, jax.Array]:
    """{name: [B, L] bool}: the queries each statistic counts, ``query_masks``' or else the valid ones.
    Refuses unknown names, and a reconstruction maximum without its queries (they exist only in a
    prefill of the prompt twice, `lookm_jax.compression.reconstruction`)."""
    unknown = set(names) - set(KNOWN_STATISTICS)
    if unknown:
        raise ValueError(f"unknown attention statistics {sorted(unknown)}; known: {KNOWN_STATISTICS}")
    if RECONSTRUCTION in names and RECONSTRUCTION not in (query_masks or {}):
        raise ValueError("the reconstruction statistic needs the queries of the prompt's second copy: run the "
                         "method through a prefill (Model.run, Model.prefill_context, generate_methods), or pass "
                         "query_masks={'reconstruction': mask}")
    return {name: (query_masks or {}).get(name, valid) for name in names}


def query_blocks(mask: jax.Array, block: int) -> jax.Array:
    """[B, L] bool -> [n_blocks, B, block]: the mask cut into query blocks, the last padded with False."""
    b, length = mask.shape
    n_blocks = -(-length // block)
    return jnp.moveaxis(jnp.pad(mask, ((0, 0), (0, n_blocks * block - length))).reshape(b, n_blocks, block), 1, 0)


def column_stats_of_block(p: jax.Array, q_ok: dict[str, jax.Array], names: tuple[str, ...]) -> dict[str, jax.Array]:
    """Column statistics of one block of softmax rows.

    p [B, Hkv, G, Q, K] fp32 probabilities of Q queries over K keys; q_ok {name: [B, Q]}: the queries
    each statistic counts (`counted_queries`; rows of other queries are ignored).
    Returns {name: [B, Hkv, G, K] fp32} for each of ``names`` (``KNOWN_STATISTICS``). Callers combine
    the blocks with ``accumulate``: ``causal_attention`` of the decoder does so while it attends, and
    ``column_stats`` here does so standalone.
    """
    out = {}
    for name in names:
        counted = jnp.where(q_ok[name][:, None, None, :, None], p, 0.0)  # p >= 0: a 0 row leaves a maximum as it is
        if name == RECONSTRUCTION:
            out[name] = counted.max(axis=-2)
        else:
            out[name] = (counted if name == SUMS else counted * counted).sum(axis=-2)
    return out


def accumulate(name: str, total: jax.Array, part: jax.Array) -> jax.Array:
    """A statistic over two sets of queries from its two parts: sums add, the maximum takes the larger."""
    return jnp.maximum(total, part) if name == RECONSTRUCTION else total + part


def column_stats(queries: jax.Array, keys: jax.Array, valid: jax.Array, names: tuple[str, ...],
                 *, block: int = 128, query_masks: dict[str, jax.Array] | None = None) -> dict[str, jax.Array]:
    """Column statistics of the causal, padding-masked attention of a prompt, per query head.

    Scans over query blocks of ``block`` rows; each step holds only [B, Hq, block, L] (every row
    of a block sees all keys, so its log-sum-exp is exact).

    Args:
      queries: [B, Hq, L, D]; keys: [B, Hkv, L, D], RoPE applied; valid: [B, L] bool.
      names: static, a tuple of ``KNOWN_STATISTICS`` entries.
      block: static; query rows per scan step (L need not be a multiple of it).
      query_masks: {name: [B, L] bool}, the queries a statistic counts (default: the valid ones;
        ``RECONSTRUCTION`` needs its own: the second copy's).
    Returns:
      {name: [B, Hkv, G, L] float32}, G = Hq // Hkv; 0 at padding.
    """
    return _column_stats(queries, keys, valid, counted_queries(names, valid, query_masks), names, block)


@functools.partial(jax.jit, static_argnames=("names", "block"))
def _column_stats(queries, keys, valid, masks, names, block):
    b, _, l, d = queries.shape
    hkv = keys.shape[1]
    q = _group(queries, hkv)  # [B, Hkv, G, L, D]
    g = q.shape[2]
    n_blk = -(-l // block)
    pad = n_blk * block - l
    q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0)))
    q = jnp.moveaxis(q.reshape(b, hkv, g, n_blk, block, d), 3, 0)  # [n_blk, B, Hkv, G, blk, D]
    q_ok = query_blocks(valid, block)
    q_pos = jnp.arange(n_blk * block, dtype=jnp.int32).reshape(n_blk, 1, block)
    q_pos = jnp.broadcast_to(q_pos, (n_blk, b, block))  # [n_blk, B, blk]

    def step(carry, xs):
        q_blk, pos_blk, ok_blk, counted = xs
        p = _probs(q_blk, keys, pos_blk, ok_blk, valid)  # [B, Hkv, G, blk, L]
        stats = column_stats_of_block(p, counted, names)
        return {name: accumulate(name, carry[name], stats[name]) for name in names}, None

    zeros = {name: jnp.zeros((b, hkv, g, l), jnp.float32) for name in names}
    counted = {name: query_blocks(mask, block) for name, mask in masks.items()}
    stats, _ = lax.scan(step, zeros, (q, q_pos, q_ok, counted))
    return stats


def scores_from_stats(stats: dict[str, jax.Array]) -> jax.Array:
    """Eq. 4 from column statistics: {SUMS: [B, Hkv, G, L]} -> A_s [B, Hkv, L], mean over the group."""
    return stats[SUMS].mean(axis=2)


def mean_std_from_stats(stats: dict[str, jax.Array], valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """RoCo statistics from {SUMS, SQUARES: [B, Hkv, G, L]} and valid [B, L] (see ``attention_mean_std``)."""
    n = jnp.where(valid, count_from_end(valid), 1).astype(jnp.float32)[:, None, None, :]  # n_j
    mean = stats[SUMS] / n
    std = jnp.sqrt(jnp.maximum(stats[SQUARES] / n - mean * mean, 0.0))
    return mean.mean(axis=2), std.mean(axis=2)


@functools.partial(jax.jit, static_argnames=("block",))
def attention_scores(queries: jax.Array, keys: jax.Array, valid: jax.Array, *, block: int = 128) -> jax.Array:
    """Accumulated attention each prompt token receives (LOOK-M eq. 4).

    A_s[j] = sum over valid queries i >= j of softmax_i(q_i k^T / sqrt(D) + causal/padding mask)[j],
    averaged over the query heads of each KV group.

    Args:
      queries: [B, Hq, L, D], RoPE already applied.
      keys: [B, Hkv, L, D], RoPE already applied; Hq % Hkv == 0.
      valid: [B, L] bool, True for real tokens (padding may be anywhere).
      block: static; query rows per scan step. Peak memory is O(B * Hq * block * L); L need not
        be a multiple of block.
    Returns:
      [B, Hkv, L] float32; 0 at padding.
    """
    return scores_from_stats(column_stats(queries, keys, valid, (SUMS,), block=block))


@functools.partial(jax.jit, static_argnames=("block",))
def attention_mean_std(
    queries: jax.Array, keys: jax.Array, valid: jax.Array, *, block: int = 128
) -> tuple[jax.Array, jax.Array]:
    """RoCo statistics: mean and std of the attention token j receives from the queries that see it.

    For each query head, over the n_j = #{valid i >= j} queries: mean_j = A_s[j] / n_j and
    std_j = sqrt(E[a_ij^2] - mean_j^2); both are then averaged over the heads of a KV group.
    Shapes and ``block`` (static) as in ``attention_scores``. Returns two [B, Hkv, L] float32
    arrays, 0 at padding.
    """
    return mean_std_from_stats(column_stats(queries, keys, valid, STATISTICS, block=block), valid)


def _pool(x: jax.Array, kernel_size: int, pooling: str) -> jax.Array:
    """1-D pooling over the last axis, stride 1, zero padding of kernel_size // 2 on each side.

    Matches torch's avg_pool1d (count_include_pad) and, for non-negative inputs, max_pool1d.
    """
    pad = [(0, 0)] * (x.ndim - 1) + [(kernel_size // 2, kernel_size // 2)]
    window = (1,) * (x.ndim - 1) + (kernel_size,)
    strides = (1,) * x.ndim
    if pooling == "max":
        return lax.reduce_window(x, 0.0, lax.max, window, strides, pad)
    return lax.reduce_window(x, 0.0, lax.add, window, strides, pad) / kernel_size


@functools.partial(jax.jit, static_argnames=("max_window", "kernel_size", "pooling"))
def window_scores(
    queries: jax.Array,
    keys: jax.Array,
    valid: jax.Array,
    candidates: jax.Array,
    window: jax.Array,
    *,
    max_window: int,
    kernel_size: int = 7,
    pooling: str = "max",
) -> jax.Array:
    """SnapKV observation-window scores.

    Sums, per query head, the attention that the last ``window[b]`` valid queries of row b pay to
    each key; zeroes keys that are not ``candidates`` (SnapKV scores only the prefix before its
    window: pass the non-recent valid tokens); pools over the sequence with ``kernel_size``
    (stride 1, zero padding k//2, as SnapKV's torch pooling); then averages the query heads of each
    KV group (as kvpress does).

    Args:
      queries: [B, Hq, L, D]; keys: [B, Hkv, L, D]; valid, candidates: [B, L] bool.
      window: [B] int, observation-window length per row (rows with fewer valid tokens use all).
      max_window: static upper bound of ``window`` (gather size).
      kernel_size: static, odd. pooling: static, "max" or "avg".
    Returns:
      [B, Hkv, L] float32.
    """
    if kernel_size % 2 != 1:
        raise ValueError(f"kernel_size must be odd, got {kernel_size}")
    if pooling not in ("max", "avg"):
        raise ValueError(f"pooling must be 'max' or 'avg', got {pooling!r}")
    b, hq, l, d = queries.shape
    w = min(max_window, l)
    idx = jnp.where(valid, jnp.arange(l, dtype=jnp.int32), -1)
    q_pos, _ = lax.top_k(idx, w)  # [B, W]: indices of the last W valid tokens, latest first
    n_valid = valid.sum(-1)
    q_ok = jnp.arange(w)[None, :] < jnp.minimum(window, n_valid)[:, None]  # [B, W]
    q_pos = jnp.maximum(q_pos, 0)
    q_obs = jnp.take_along_axis(queries, q_pos[:, None, :, None], axis=2)  # [B, Hq, W, D]
    q_obs = _group(q_obs, keys.shape[1])  # [B, Hkv, G, W, D]
    s = _probs(q_obs, keys, q_pos, q_ok, valid).sum(axis=-2)  # [B, Hkv, G, L]
    s = jnp.where(candidates[:, None, None, :], s, 0.0)
    return _pool(s, kernel_size, pooling).mean(axis=2)
