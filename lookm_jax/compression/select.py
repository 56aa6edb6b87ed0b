"""Static-budget selection of the prompt slots to keep (LOOK-M eq. 5-8).

Per row b and KV head h, with L_b valid tokens, M_b = n_recent[b], N_b = n_important[b]:
keep the last M_b valid tokens (recent window) and the N_b best of the others, i.e.
min(M_b + N_b, L_b) slots, stored in original-position order in a static capacity S.

Ranking is one lexicographic sort, highest first:
  1. class: recent window > attention sinks (first ``n_sink`` valid tokens) > image tokens
     reserved by an image quota > text (under text-prior) > everything else; padding is last and
     never kept;
  2. score, descending (sinks are ordered by position alone);
  3. position, ascending: ties are broken deterministically, lower position first.
Text-prior (eq. 5, A_s[text] += max(A_s)) is realised as the class level: in exact arithmetic
eq. 5 orders tokens exactly so (every valid token has A_s > 0, so each text score exceeds the
maximum), and the class form keeps that guarantee in fp32, where adding max(A_s) would absorb
tiny scores and turn them into ties.

An image quota (not in the paper) reserves floor(q * N_b) of the ranked slots for the best-scored
image tokens outside the window and the sinks (per head), so text-prior cannot spend the whole
budget on text: q is a fixed fraction, or "proportional", the image tokens' share of those
candidates. The rest of N is ranked as before. With ``picture_balance`` the reserved slots go
round-robin across the prompt's pictures (contiguous runs of image tokens): every picture's best
pool token first (by score, then position), then every picture's second best, and so on. Accumulated
attention favours early tokens (more queries see them), so without it the first pictures take most
of the quota and the last ones keep none (docs/RESULTS.md).

A text window (not in the paper) keeps the recent window off the pictures: it holds only the
valid tokens after the row's last image token (in a chat prompt, the turn's text after its last
picture: a question and the assistant's header when the prompt has them), at most M_b of them; the
window slots it leaves unused join the ranked N_b (`text_window_slots`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

PROPORTIONAL = "proportional"  # an image quota equal to the image tokens' share of the candidates


class Selection(NamedTuple):
    indices: jax.Array  # [B, H, S] int32 kept positions in ascending order; 0 in empty slots
    mask: jax.Array  # [B, H, S] bool, True for a kept slot
    kept: jax.Array  # [B, H, L] bool, True for a kept token


def per_head(fn):
    """``fn`` of one (row, head) mapped over leading [B, H] axes. Scatters written this way see B and
    H as batch dimensions, so on a mesh each device scatters its own rows and heads; indexed with
    explicit [B, H] iotas instead, XLA gathers the indices and all-reduces a full-size result."""
    return jax.vmap(jax.vmap(fn))


def count_from_end(valid: jax.Array) -> jax.Array:
    """[B, L] int: number of valid tokens at positions >= j (1 for the last valid token)."""
    return jnp.flip(jnp.cumsum(jnp.flip(valid, -1), -1), -1)


def recent_mask(valid: jax.Array, n_recent: jax.Array) -> jax.Array:
    """[B, L] bool: the last ``n_recent[b]`` valid tokens of each row (n_recent: [B] int)."""
    return valid & (count_from_end(valid) <= n_recent[:, None])


def text_window_slots(valid: jax.Array, is_image: jax.Array, n_recent: jax.Array,
                      n_important: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(window, ranked) [B] int32 of a text window: the window cut to the valid tokens after the row's
    last image token (all of a row without one), the slots it gives up added to the ranked ones, so
    their sum stays M_b + N_b. valid, is_image: [B, L] bool; n_recent, n_important: [B] int."""
    tail = (valid & (count_from_end(valid & is_image) == 0)).sum(-1, dtype=jnp.int32)  # [B] no image token at >= j
    window = jnp.minimum(n_recent, tail)
    return window, n_important + n_recent - window


def image_quota_slots(quota: float | str, n_important: jax.Array, pool: jax.Array, image_pool: jax.Array) -> jax.Array:
    """[B] int32 ranked slots reserved for image tokens: floor(quota * N_b) for a fraction (a static
    table over N, so fp32 never rounds the floor), or floor(N_b * images / candidates) for
    PROPORTIONAL. pool, image_pool: [B, L] bool, the ranked candidates and their image tokens."""
    if quota == PROPORTIONAL:
        return (n_important * image_pool.sum(-1)) // jnp.maximum(pool.sum(-1), 1)
    table = np.floor(quota * np.arange(pool.shape[-1] + 1)).astype(np.int32)
    return jnp.asarray(table)[jnp.clip(n_important, 0, pool.shape[-1])]


def _ranks(order: jax.Array) -> jax.Array:
    """[B, H, L] sorted order (positions) -> each position's rank in it."""
    l = order.shape[-1]
    return per_head(lambda o: jnp.zeros(l, jnp.int32).at[o].set(jnp.arange(l, dtype=jnp.int32)))(order)


def within_group_rank(scores: jax.Array, member: jax.Array) -> jax.Array:
    """[B, H, L] int32 rank of each member token among its row's members by score (0 = best; ties:
    lower position first); non-members rank after every member. member: [B, H, L] bool."""
    b, h, l = scores.shape
    pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, h, l))
    _, _, order = lax.sort(((~member).astype(jnp.int32), -scores.astype(jnp.float32), pos), num_keys=3)
    return _ranks(order)


def picture_ids(is_image: jax.Array) -> jax.Array:
    """[B, L] int32: each image token's picture, numbered 1, 2, ... by contiguous runs of image tokens
    in the row; 0 for text and padding."""
    starts = is_image & ~jnp.pad(is_image[:, :-1], ((0, 0), (1, 0)))
    return jnp.where(is_image, jnp.cumsum(starts, -1, dtype=jnp.int32), 0)


def round_robin_rank(scores: jax.Array, member: jax.Array, group: jax.Array) -> jax.Array:
    """[B, H, L] int32 rank of each member when members are taken round-robin across groups: every
    group's best (by score, ties: lower position), then every group's second best, ...; within a round
    by score, then position. Non-members rank after every member. member: [B, H, L] bool; group:
    [B, L] int."""
    b, h, l = scores.shape
    pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, h, l))
    outside = (~member).astype(jnp.int32)
    neg_score = -scores.astype(jnp.float32)
    groups = jnp.broadcast_to(group[:, None, :], (b, h, l))
    _, sorted_group, _, order = lax.sort((outside, groups, neg_score, pos), num_keys=4)  # by group, then score
    index = jnp.arange(l, dtype=jnp.int32)
    first = jnp.concatenate([jnp.ones((b, h, 1), bool), sorted_group[..., 1:] != sorted_group[..., :-1]], -1)
    start = lax.cummax(jnp.where(first, index, 0), axis=2)  # where each sorted group begins
    within = jnp.take_along_axis(index - start, _ranks(order), axis=-1)  # [B, H, L] rank inside its group
    _, _, _, order = lax.sort((outside, within, neg_score, pos), num_keys=4)
    return _ranks(order)


def _classes(scores, valid, is_image, n_recent, n_important, *, text_prior, n_sink, image_quota, picture_balance):
    """Rank classes [B, H, L] int32 (4 recent, 3 sink, 2 image-quota, 1 text-prior text, 0 other, -1
    padding) and the sink mask [B, L] (module docstring)."""
    b, h, l = scores.shape
    recent = recent_mask(valid, n_recent)  # [B, L]
    sink = valid & ~recent & (jnp.cumsum(valid, -1) <= n_sink)
    text = valid & ~is_image & text_prior
    cls = jnp.where(recent, 4, jnp.where(sink, 3, jnp.where(text, 1, 0)))
    cls = jnp.broadcast_to(jnp.where(valid, cls, -1).astype(jnp.int32)[:, None, :], (b, h, l))
    if image_quota is not None:
        pool = valid & ~recent & ~sink  # [B, L] the ranked candidates
        image_pool = jnp.broadcast_to((pool & is_image)[:, None, :], (b, h, l))
        rank = (round_robin_rank(scores, image_pool, picture_ids(is_image)) if picture_balance
                else within_group_rank(scores, image_pool))
        reserved = rank < image_quota_slots(image_quota, n_important, pool, pool & is_image)[:, None, None]
        cls = jnp.where(image_pool & reserved, 2, cls)  # [B, H, L]
    return cls, sink


def _rank_keys(scores, cls, sink):
    """Sort keys of the within-head priority: (-class, -score (sinks: 0, by position)), each [B, H, L]."""
    return -cls, jnp.where(sink[:, None, :], 0.0, -scores.astype(jnp.float32))


def adaptive_head_slots(
    scores: jax.Array,
    valid: jax.Array,
    is_image: jax.Array,
    n_recent: jax.Array,
    n_important: jax.Array,
    *,
    groups: int,
    head_floor: float,
    text_prior: bool,
    n_sink: int = 0,
    image_quota: float | str | None = None,
    picture_balance: bool = False,
) -> jax.Array:
    """AdaKV's allocation (Feng et al. 2024): each head's ranked slots [B, H] int32.

    The H heads split into ``groups`` consecutive groups of H_g (a device's heads on a mesh); per row
    and group the H_g x N_b ranked slots go, after a floor of F = min(floor(head_floor x N_b), C_b)
    per head (C_b = the row's candidates outside the recent window), to the best candidates of all
    the group's heads by ONE ranking: (class, score) as within a head (`select_slots`), then head,
    then position, ascending. A head's F floor slots are its own F best. Sums: H_g x min(N_b, C_b)
    per group; the heads' slots are then chosen per head by `select_slots(head_slots=...)`.
    """
    b, h, l = scores.shape
    hg = h // groups
    cls, sink = _classes(scores, valid, is_image, n_recent, n_important, text_prior=text_prior, n_sink=n_sink,
                         image_quota=image_quota, picture_balance=picture_balance)
    neg_cls, neg_score = _rank_keys(scores, cls, sink)
    pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, h, l))
    _, _, order = lax.sort((neg_cls, neg_score, pos), num_keys=3)
    rank = per_head(lambda o: jnp.zeros(l, jnp.int32).at[o].set(jnp.arange(l, dtype=jnp.int32)))(order)  # [B, H, L]
    candidates = valid.sum(-1) - jnp.minimum(n_recent, valid.sum(-1))  # [B] C_b
    table = np.floor(head_floor * np.arange(l + 1)).astype(np.int32)  # a static table: fp32 never rounds the floor
    floor = jnp.minimum(jnp.asarray(table)[jnp.clip(n_important, 0, l)], candidates)  # [B] F
    shared = hg * (jnp.minimum(n_important, candidates) - floor)  # [B] slots the group's top-k gives out
    # Candidates past each head's floor; recent and padding tokens rank first in their head (class 4)
    # or never (class -1), so a head's candidates are its ranks from min(M_b, L_b) on.
    eligible = (cls >= 0) & (cls < 4) & (rank >= (valid.sum(-1) - candidates + floor)[:, None, None])
    head = jnp.broadcast_to(jnp.arange(h, dtype=jnp.int32)[:, None], (b, h, l))

    def grouped(x):  # [B, H, L] -> [B, G, H_g * L], head-major
        return x.reshape(b, groups, hg * l)

    _, _, _, top_head, _ = lax.sort(tuple(grouped(x) for x in ((~eligible).astype(jnp.int32), neg_cls, neg_score,
                                                              head, pos)), num_keys=5)  # [B, G, H_g * L]
    won = jnp.arange(hg * l) < shared[:, None, None]  # [B, 1, H_g * L] the group's top-k
    local = top_head % hg
    counts = jnp.sum((local[..., None] == jnp.arange(hg)) & won[..., None], axis=-2)  # [B, G, H_g]
    return floor[:, None] + counts.reshape(b, h)


def select_slots(
    scores: jax.Array,
    valid: jax.Array,
    is_image: jax.Array,
    n_recent: jax.Array,
    n_important: jax.Array,
    *,
    capacity: int,
    text_prior: bool,
    n_sink: int = 0,
    keep_all_text: bool = False,
    image_quota: float | str | None = None,
    picture_balance: bool = False,
    head_slots: jax.Array | None = None,
) -> Selection:
    """Choose the kept slots of every head (pure; traceable).

    Args:
      scores: [B, H, L] float, higher = more important.
      valid, is_image: [B, L] bool.
      n_recent, n_important: [B] int, per-row M and N.
      capacity: static S; rows keep min(M + N, L_b, S) slots, spare slots are empty.
      text_prior: static; rank every text token above every image token (eq. 5).
      n_sink: static; the first n_sink valid tokens outrank all others outside the recent window
        (counted within N).
      keep_all_text: static; also keep every sink and (text-prior) text token even beyond N, so a
        row keeps M + max(N, #sink-or-text tokens outside the window), truncated to S.
      image_quota: static; None, a fraction in [0, 1] or PROPORTIONAL: ranked slots reserved for
        the best image tokens of each head (module docstring), floor(q N_b) of the row's N_b.
      picture_balance: static; the quota's slots go round-robin across pictures (module docstring).
      head_slots: [B, H] int, each head's own ranked slots instead of N_b (`adaptive_head_slots`);
        None: N_b in every head.
    """
    b, h, l = scores.shape
    pos = jnp.arange(l, dtype=jnp.int32)
    cls, sink = _classes(scores, valid, is_image, n_recent, n_important, text_prior=text_prior, n_sink=n_sink,
                         image_quota=image_quota, picture_balance=picture_balance)
    neg_cls, neg_score = _rank_keys(scores, cls, sink)
    _, _, order = lax.sort((neg_cls, neg_score, jnp.broadcast_to(pos, (b, h, l))), num_keys=3)

    if head_slots is not None:
        count = jnp.minimum(n_recent[:, None] + head_slots, valid.sum(-1)[:, None])  # [B, H]
        count = jnp.minimum(count, capacity)[:, :, None]
    else:
        count = n_recent + n_important
        if keep_all_text:
            must = ((cls[:, 0] == 1) | (cls[:, 0] == 3)).sum(-1)  # [B]: sinks and text, the same in every head
            count = n_recent + jnp.maximum(n_important, must)
        count = jnp.minimum(jnp.minimum(count, valid.sum(-1)), capacity)[:, None, None]  # [B, 1, 1]

    if capacity > l:
        order = jnp.pad(order, ((0, 0), (0, 0), (0, capacity - l)), constant_values=l)
    top = order[..., :capacity]  # [B, H, S] by priority
    slot = jnp.arange(capacity)
    chosen = jnp.sort(jnp.where(slot < count, top, l), axis=-1)  # [B, H, S], l = empty
    mask = chosen < l
    kept = per_head(lambda c: jnp.zeros(l, bool).at[c].set(True, mode="drop"))(chosen)  # [B, H, L]
    return Selection(jnp.where(mask, chosen, 0), mask, kept)
