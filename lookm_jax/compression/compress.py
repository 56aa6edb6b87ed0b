"""One-shot compression of a layer's prompt cache: select -> gather -> merge."""

from __future__ import annotations

import dataclasses
import functools

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax.checks import is_int_at_least, is_real
from lookm_jax.errors import InputError
from lookm_jax.compression import heads as head_pool
from lookm_jax.compression.merge import MERGES, merge_evicted
from lookm_jax.compression.select import PROPORTIONAL, adaptive_head_slots, select_slots, text_window_slots

MERGE_SCOPES = ("any", "same_modality")


@flax.struct.dataclass
class CompressedKV:
    """A layer's compressed prompt cache; slots are in original-position order per head.

    Head-adaptive (``heads`` set): the second axis is the G head groups and the slot axis a pool of
    H_g x C slots (`lookm_jax.compression.heads`), ``heads`` naming each slot's KV head in its group."""

    keys: jax.Array  # [B, Hkv, S, D], RoPE of the original positions; 0 in empty slots (pooled: [B, G, P, D])
    values: jax.Array  # [B, Hkv, S, Dv]; 0 in empty slots
    positions: jax.Array  # [B, Hkv, S] int32 original prompt index, -1 = empty
    mask: jax.Array  # [B, Hkv, S] bool, True = occupied
    log_counts: jax.Array | None = None  # [B, Hkv, S] fp32 log(prompt tokens in the slot), size-aware only
    heads: jax.Array | None = None  # [B, G, P] int32 KV head within the group, -1 = empty; pooled only

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def per_head(self, num_heads: int, width: int) -> "CompressedKV":
        """A pooled result as per-head slots [B, num_heads, width] (each head's first, the rest empty);
        for inspection and tests."""
        def view(x, fill=0):
            return None if x is None else head_pool.unpool(x, self.heads, num_heads, width, fill)
        return CompressedKV(view(self.keys), view(self.values), view(self.positions, -1), view(self.mask, False),
                            view(self.log_counts))


@dataclasses.dataclass(frozen=True)
class SelectionSpec:
    """How kept slots are chosen and evicted pairs folded in; validated here, once, for every caller.

    text_prior: eq. 5, every text token outranks every image token.
    merge: None (evict only) | "averaged" | "pivotal" | "weighted" (eq. 9-12).
    n_sink: the first n_sink valid tokens are always kept, counted within N.
    similarity_filter: merge only evicted tokens whose best cosine passes the row mean (needs merge).
    keep_all_text: keep every text token even beyond N (needs text_prior).
    image_quota: None, a fraction in [0, 1] or "proportional": ranked slots reserved for the best
      image tokens (`lookm_jax.compression.select`).
    merge_scope: "any" (the paper's) or "same_modality": an evicted pair merges only into a kept
      slot of its own modality (`lookm_jax.compression.merge`).
    size_aware: each kept slot carries log(prompt tokens merged into it), added to its attention
      logit at every later query (`lookm_jax.compression.merge`). Needs merge.
    picture_balance: the image quota's slots go round-robin across the prompt's pictures, each
      picture's best first (`lookm_jax.compression.select`). Needs image_quota.
    text_window: the recent window holds only the tokens after the last picture, its unused slots
      ranked instead (`lookm_jax.compression.select`).
    """

    text_prior: bool = False
    merge: str | None = None
    n_sink: int = 0
    similarity_filter: bool = False
    keep_all_text: bool = False
    image_quota: float | str | None = None
    merge_scope: str = "any"
    size_aware: bool = False
    picture_balance: bool = False
    text_window: bool = False

    def __post_init__(self):
        flags = {"text_prior": self.text_prior, "similarity_filter": self.similarity_filter,
                 "keep_all_text": self.keep_all_text, "size_aware": self.size_aware,
                 "picture_balance": self.picture_balance, "text_window": self.text_window}
        not_bool = {name: value for name, value in flags.items() if not isinstance(value, (bool, np.bool_))}
        if not_bool:
            raise InputError(f"{', '.join(not_bool)} must be True or False, got {not_bool}")
        if self.merge is not None and self.merge not in MERGES:
            raise InputError(f"merge must be None or one of {MERGES}, got {self.merge!r}")
        if self.similarity_filter and self.merge is None:
            raise InputError("similarity_filter needs a merge mode")
        if self.keep_all_text and not self.text_prior:
            raise InputError("keep_all_text needs text_prior=True")
        if not is_int_at_least(self.n_sink, 0):
            raise InputError(f"n_sink must be an int >= 0, got {self.n_sink!r}")
        quota = self.image_quota
        if not (quota is None or quota == PROPORTIONAL or (is_real(quota) and not isinstance(quota, bool)
                                                           and 0 <= quota <= 1)):
            raise InputError(f"image_quota must be None, a fraction in [0, 1] or {PROPORTIONAL!r}, got {quota!r}")
        if quota is not None and self.keep_all_text:
            raise InputError("image_quota and keep_all_text cannot be combined (keep_all_text keeps every text token)")
        if self.merge_scope not in MERGE_SCOPES:
            raise InputError(f"merge_scope must be one of {MERGE_SCOPES}, got {self.merge_scope!r}")
        if self.merge_scope != "any" and (self.merge is None or self.similarity_filter):
            raise InputError(f"merge_scope {self.merge_scope!r} needs a merge mode and no similarity_filter")
        if self.size_aware and self.merge is None:
            raise InputError("size_aware needs a merge mode (without merging every slot holds one token)")
        if self.picture_balance and quota is None:
            raise InputError("picture_balance needs an image_quota (it shares the quota's slots among the pictures)")


def _static_capacity(n_recent, n_important, length: int) -> int:
    try:
        total = np.asarray(n_recent) + np.asarray(n_important)
    except jax.errors.TracerArrayConversionError as e:
        raise ValueError("pass capacity= when n_recent / n_important are traced") from e
    return min(int(total.max()), length)


def compress_kv(
    keys: jax.Array,
    values: jax.Array,
    scores: jax.Array,
    *,
    is_image: jax.Array,
    valid: jax.Array,
    n_recent,
    n_important,
    text_prior: bool = True,
    merge: str | None = None,
    n_sink: int = 0,
    similarity_filter: bool = False,
    keep_all_text: bool = False,
    image_quota: float | str | None = None,
    merge_scope: str = "any",
    size_aware: bool = False,
    picture_balance: bool = False,
    text_window: bool = False,
    capacity: int | None = None,
    block: int = 128,
    head_groups: int | None = None,
    head_floor: float = 0.2,
) -> CompressedKV:
    """Compress a prompt cache to a static number of slots per KV head (LOOK-M eq. 5-12).

    Keeps, per row and head, the last M valid tokens and the top N of the rest by ``scores``
    (rules and deterministic tie-breaking in ``lookm_jax.compression.select``), then optionally merges every
    evicted pair into its most similar kept pair (``lookm_jax.compression.merge``).

    Args:
      keys: [B, Hkv, L, D]; values: [B, Hkv, L, Dv]; scores: [B, Hkv, L] (e.g. ``attention_scores``).
      is_image, valid: [B, L] bool.
      n_recent, n_important: M and N, a Python int (all rows) or a [B] int array (per row).
      text_prior: eq. 5, every text token outranks every image token.
      merge: None (evict only) | "averaged" | "pivotal" | "weighted".
      n_sink: the first n_sink valid tokens are always kept, counted within N (authors' code
        keeps 4 in its non-text-prior merge variants). Default 0: off.
      similarity_filter: merge only evicted tokens whose head-averaged best cosine is >= its mean
        over the row's evicted tokens, dropping the rest (authors' code, averaged and weighted
        merges). Requires ``merge``. Default off.
      keep_all_text: keep every text token even when they exceed N (authors' code); the cache
        then overruns M + N, so give ``capacity`` (S_max); rows beyond it are truncated by rank.
        Requires ``text_prior``. Default off.
      image_quota, merge_scope, size_aware, picture_balance, text_window: see ``SelectionSpec``. Default
        off / "any" / off / off / off (the paper's).
      capacity: static S. Default: max over rows of M + N (needs concrete M, N), clipped to L.
      block: static token block of the similarity scan.
      head_groups: None (every head keeps M + N) or G, AdaKV's head-adaptive allocation within each
        of G groups of heads (`select.adaptive_head_slots`, floor ``head_floor``): each head's slots
        are chosen (and merged into) as above with its own N, and the result is pooled, H_g x S
        slots per group (`lookm_jax.compression.heads`). Needs no keep_all_text.

    The wrapper resolves the static capacity and then calls a jitted core whose static args are
    capacity, block and the selection spec's fields.
    """
    SelectionSpec(text_prior, merge, n_sink, similarity_filter, keep_all_text, image_quota, merge_scope,
                  size_aware, picture_balance, text_window)  # validates
    b, _, length, _ = keys.shape
    if capacity is None:
        capacity = _static_capacity(n_recent, n_important, length)
    n_recent = jnp.broadcast_to(jnp.asarray(n_recent, jnp.int32), (b,))
    n_important = jnp.broadcast_to(jnp.asarray(n_important, jnp.int32), (b,))
    return _compress(
        keys, values, scores, is_image, valid, n_recent, n_important,
        capacity=int(capacity), text_prior=text_prior, merge=merge, n_sink=n_sink,
        similarity_filter=similarity_filter, keep_all_text=keep_all_text, image_quota=image_quota,
        merge_scope=merge_scope, size_aware=size_aware, picture_balance=picture_balance, text_window=text_window,
        block=block, head_groups=head_groups, head_floor=head_floor,
    )


@functools.partial(
    jax.jit,
    static_argnames=("capacity", "text_prior", "merge", "n_sink", "similarity_filter", "keep_all_text",
                     "image_quota", "merge_scope", "size_aware", "picture_balance", "text_window", "block",
                     "head_groups", "head_floor"),
)
def _compress(keys, values, scores, is_image, valid, n_recent, n_important, *, capacity, text_prior, merge,
              n_sink, similarity_filter, keep_all_text, image_quota, merge_scope, size_aware, picture_balance,
              text_window, block, head_groups, head_floor) -> CompressedKV:
    b, h, length, _ = keys.shape
    if text_window:
        n_recent, n_important = text_window_slots(valid, is_image, n_recent, n_important)  # [B] each
    head_slots, per_head_capacity = None, capacity
    if head_groups is not None:
        if keep_all_text or h % head_groups:
            raise ValueError(f"head-adaptive budgets need no keep_all_text and head groups dividing {h} KV heads, "
                             f"got keep_all_text={keep_all_text}, {head_groups} groups")
        head_slots = adaptive_head_slots(scores, valid, is_image, n_recent, n_important, groups=head_groups,
                                         head_floor=head_floor, text_prior=text_prior, n_sink=n_sink,
                                         image_quota=image_quota, picture_balance=picture_balance)  # [B, Hkv]
        per_head_capacity = min(length, h // head_groups * capacity)  # a head may take its group's whole budget
    sel = select_slots(
        scores, valid, is_image, n_recent, n_important,
        capacity=per_head_capacity, text_prior=text_prior, n_sink=n_sink, keep_all_text=keep_all_text,
        image_quota=image_quota, picture_balance=picture_balance, head_slots=head_slots,
    )
    idx = sel.indices[..., None]  # [B, Hkv, S, 1]
    occupied = sel.mask[..., None]
    kept_keys = jnp.where(occupied, jnp.take_along_axis(keys, idx, axis=2), 0)  # [B, Hkv, S, D]
    kept_values = jnp.where(occupied, jnp.take_along_axis(values, idx, axis=2), 0)  # [B, Hkv, S, Dv]
    log_counts = None
    if merge is not None:
        evicted = valid[:, None, :] & ~sel.kept  # [B, Hkv, L]
        slot_is_image = jnp.take_along_axis(jnp.broadcast_to(is_image[:, None, :], evicted.shape), sel.indices, axis=-1)
        kept_keys, kept_values, counts = merge_evicted(
            keys, values, kept_keys, kept_values, sel.mask, evicted,
            mode=merge, use_similarity_filter=similarity_filter, block=block,
            modalities=(is_image, slot_is_image) if merge_scope == "same_modality" else None,
        )
        if size_aware:
            log_counts = jnp.where(sel.mask, jnp.log(counts), 0.0)  # [B, Hkv, S]
    positions = jnp.where(sel.mask, sel.indices, -1).astype(jnp.int32)
    if head_groups is None:
        return CompressedKV(kept_keys, kept_values, positions, sel.mask, log_counts)
    index, heads = head_pool.pool_layout(sel.mask, head_groups, h // head_groups * capacity)  # [B, G, P]

    def pooled(x):
        return None if x is None else head_pool.pool(x, index, heads)

    chex.assert_shape(heads, (b, head_groups, h // head_groups * capacity))
    return CompressedKV(pooled(kept_keys), pooled(kept_values), jnp.where(heads >= 0, pooled(positions), -1),
                        heads >= 0, pooled(log_counts), heads)
