"""Folding evicted KV pairs into kept ones (LOOK-M eq. 9-12).

Eq. 9: each evicted key k_e (per head) is assigned to the kept key of that head with the highest
cosine similarity c_e (ties: lowest slot, i.e. lowest position; a zero key has cosine 0 with
everything). Its value goes to the same slot. With n_s evicted pairs assigned to kept slot s,
the multi-assignment form of the authors' code (mean over the kept pair and its merged pairs):

  averaged (eq. 10): k_s <- (k_s + sum_e k_e) / (1 + n_s)
  pivotal  (eq. 11): k_s <- (k_s + sum_e (k_e + k_s) / 2) / (1 + n_s)
  weighted (eq. 12): k_s <- (k_s + sum_e c_e k_e) / (1 + n_s)

and the same for values with the keys' assignment and weights. Averaged and pivotal are convex
combinations. Weighted is not: its weights sum to (1 + sum_e c_e) / (1 + n_s) <= 1, and a
negative cosine (an evicted key at an obtuse angle to every kept key) enters with a negative
weight: the evicted key and value are *subtracted*, pushing the merged pair away from the evicted
one while still counting in the 1 / (1 + n_s) denominator, so the result also shrinks. This is
eq. 12 taken literally, as the authors' code does; it is not clipped.

With `same_modality` (not in the paper) an evicted pair may only merge into a kept slot of its own
modality (image into image, text into text); a pair with no kept slot of its modality in its head
is evicted without merging.

A merged slot stands for 1 + n_s tokens but is attended as one. Size-aware slots (not in the paper;
ToMe's proportional attention applied to a KV cache) keep log(1 + n_s) per slot, which attention adds
to that slot's logit at every later query: n identical keys merged into one are then attended exactly
as the n originals were.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from lookm_jax.reductions import first_max
from lookm_jax.compression.select import per_head

MERGES = ("averaged", "pivotal", "weighted")


def _unit(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.maximum((x * x).sum(-1, keepdims=True), jnp.finfo(jnp.float32).tiny))


def assign(keys: jax.Array, kept_keys: jax.Array, slot_mask: jax.Array, *, block: int,
           groups: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, jax.Array]:
    """Most cosine-similar kept slot of every token (eq. 9), blockwise over tokens.

    keys [B, H, L, D], kept_keys [B, H, S, D], slot_mask [B, H, S]; block: static tokens per scan
    step (memory O(block x S)); groups: (token group [B, L], slot group [B, H, S]) bool, when a
    token may only go to a slot of its own group. Returns target [B, H, L] int32 and its cosine
    [B, H, L] fp32 (-inf where a head has no kept slot the token may go to).
    """
    b, h, l, d = keys.shape
    n_blk = -(-l // block)
    k = jnp.pad(_unit(keys), ((0, 0), (0, 0), (0, n_blk * block - l), (0, 0)))
    k = jnp.moveaxis(k.reshape(b, h, n_blk, block, d), 2, 0)  # [n_blk, B, H, blk, D]
    token_group, slot_group = groups if groups is not None else (jnp.zeros((b, l), bool), jnp.zeros((b, h, 1), bool))
    token_group = jnp.pad(token_group, ((0, 0), (0, n_blk * block - l)))
    token_group = jnp.moveaxis(token_group.reshape(b, n_blk, block), 1, 0)  # [n_blk, B, blk]
    kk = _unit(kept_keys)  # [B, H, S, D]

    def step(_, inputs):
        kb, gb = inputs
        sim = jnp.einsum("bhld,bhsd->bhls", kb, kk, precision=lax.Precision.HIGHEST)
        allowed = slot_mask[:, :, None, :] & (gb[:, None, :, None] == slot_group[:, :, None, :])
        return None, first_max(jnp.where(allowed, sim, -jnp.inf))  # [B, H, blk, S]

    _, (target, cos) = lax.scan(step, None, (k, token_group))
    target = jnp.moveaxis(target, 0, 2).reshape(b, h, -1)[..., :l]
    cos = jnp.moveaxis(cos, 0, 2).reshape(b, h, -1)[..., :l]
    return target, cos


def similarity_filter(evicted: jax.Array, cos: jax.Array) -> jax.Array:
    """Authors'-code filter: which evicted tokens may merge ([B, H, L] bool).

    Every head of a row evicts the same number E of tokens; the t-th evicted token of each head
    (position order) gets m_t = mean over heads of its best cosine. Evicted tokens whose m_t is
    below the row mean of m_t (over t < E) are dropped instead of merged.
    """
    l = evicted.shape[-1]
    rank = jnp.where(evicted, jnp.cumsum(evicted, -1) - 1, l)  # [B, H, L]; l = not evicted
    by_rank = per_head(lambda r, c: jnp.zeros(l, jnp.float32).at[r].set(c, mode="drop"))(rank, cos)
    m = by_rank.mean(1)  # [B, L] m_t
    n_evicted = evicted[:, 0].sum(-1)  # [B] = E
    live = jnp.arange(l)[None, :] < n_evicted[:, None]
    threshold = jnp.where(live, m, 0.0).sum(-1) / jnp.maximum(n_evicted, 1)  # [B]
    passes = m >= threshold[:, None]  # [B, L] per rank
    return evicted & jnp.take_along_axis(passes[:, None, :], jnp.minimum(rank, l - 1), axis=-1)


@functools.partial(jax.jit, static_argnames=("mode", "use_similarity_filter", "block"))
def merge_evicted(
    keys: jax.Array,
    values: jax.Array,
    kept_keys: jax.Array,
    kept_values: jax.Array,
    slot_mask: jax.Array,
    evicted: jax.Array,
    *,
    mode: str,
    use_similarity_filter: bool = False,
    block: int = 128,
    modalities: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Merge every evicted pair into its most similar kept pair (eq. 9-12, module docstring).

    Args:
      keys: [B, H, L, D]; values: [B, H, L, Dv], the full prompt cache.
      kept_keys: [B, H, S, D]; kept_values: [B, H, S, Dv], the kept slots.
      slot_mask: [B, H, S] bool, kept slots. evicted: [B, H, L] bool, valid tokens not kept.
      mode: static, "averaged" | "pivotal" | "weighted".
      use_similarity_filter: static; drop, rather than merge, the evicted tokens that fail
        ``similarity_filter`` (authors' code).
      block: static token block of the similarity scan.
      modalities: (is_image [B, L], slot_is_image [B, H, S]) to merge within each modality only
        (module docstring); None merges across them, as the paper does.
    Returns:
      merged (kept_keys, kept_values), in the kept arrays' dtypes, and the prompt tokens each kept
      slot now holds [B, H, S] fp32: 1 + the pairs merged into it (1 in empty slots too).
    """
    if mode not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {mode!r}")
    s = kept_keys.shape[2]
    target, cos = assign(keys, kept_keys, slot_mask, block=block, groups=modalities)
    merging = evicted & (cos > -jnp.inf)  # a token with no slot it may go to is evicted unmerged
    if use_similarity_filter:
        merging = merging & similarity_filter(evicted, cos)
    target = jnp.where(merging, target, s)  # s = dropped by the scatter
    weight = {"averaged": 1.0, "pivotal": 0.5, "weighted": cos}[mode]
    weight = jnp.where(merging, weight, 0.0)[..., None]  # [B, H, L, 1]

    def to_slots(updates):  # [B, H, L, ...] fp32 -> [B, H, S, ...]: summed into each token's target slot
        return per_head(lambda t, u: jnp.zeros((s, *u.shape[1:]), jnp.float32).at[t].add(u, mode="drop"))(
            target, updates)

    n = to_slots(jnp.ones(target.shape, jnp.float32))[..., None]
    self_weight = 1.0 + 0.5 * n if mode == "pivotal" else 1.0  # [B, H, S, 1] or scalar

    def fold(full, kept):
        acc = to_slots(weight * full.astype(jnp.float32))
        return ((self_weight * kept.astype(jnp.float32) + acc) / (1.0 + n)).astype(kept.dtype)

    return fold(keys, kept_keys), fold(values, kept_values), 1.0 + n[..., 0]
