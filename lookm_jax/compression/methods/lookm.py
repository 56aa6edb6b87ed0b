"""LOOK-M (Wan et al. 2024): text-prior eviction by accumulated attention, then KV merging."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from lookm_jax.checks import is_real
from lookm_jax.compression.compress import SelectionSpec
from lookm_jax.errors import InputError
from lookm_jax.compression.methods.base import ScorerMethod
from lookm_jax.compression.scoring import RECONSTRUCTION, SUMS, scores_from_stats, window_scores

ATTENTION = "attention"
SPLIT = "split"
SCORES = (ATTENTION, RECONSTRUCTION, SPLIT)  # eq. 4, KVzip's reconstruction statistic, or one per modality
VOTES_WINDOW = 32  # SPLIT: the last queries whose votes rank image tokens (SnapKV's default window)
RECONSTRUCTION_WEIGHT = 0.75  # SPLIT: the reconstruction share of an image token's score, by default


@dataclasses.dataclass(frozen=True)
class LookM(ScorerMethod):
    """Recent M + top N by A_s (eq. 4), text-prior (eq. 5), merging (eq. 9-12).

    Paper default: text_prior=True, merge="pivotal", alpha_recent = alpha_important = 0.1.
    Reproductions of the authors' code, off by default (see ``compress_kv``): ``n_sink`` (their
    non-text-prior merges keep 4 sinks), ``similarity_filter``, ``keep_all_text`` (the cache may
    then exceed M + N: its static capacity is floor(capacity_ratio * bucket_len), or the whole
    bucket when capacity_ratio is None). ``block`` is also the token block of the similarity scan.

    ``scores``: what ranks the tokens: "attention" (eq. 4, the paper's) or "reconstruction" (KVzip's
    context-reconstruction score: the most attention any query of a second copy of the prompt pays
    the token, max over the query group; `lookm_jax.compression.reconstruction`), which knows nothing
    of a question asked later and costs a prefill of the prompt twice over; or "split" (text-prior
    only, which never ranks a text token against an image token): text tokens by eq. 4, image tokens
    by ``reconstruction_weight`` x their share of the reconstruction maxima + the rest x their share
    of the votes of the last ``VOTES_WINDOW`` queries (SnapKV's window scores, max-pooled over 7), each
    share a fraction of its row and head's total over the prompt. The votes find the pictures a
    question in the prompt reads; when the question comes after compression they say little, and the
    reconstruction maxima keep what every picture holds (the same doubled prefill).
    """

    text_prior: bool = True
    merge: str | None = "pivotal"
    n_sink: int = 0
    similarity_filter: bool = False
    keep_all_text: bool = False
    capacity_ratio: float | None = None
    image_quota: float | str | None = None  # ranked slots reserved for image tokens (`SelectionSpec`); paper: None
    merge_scope: str = "any"  # "same_modality": merge image into image, text into text; paper: "any"
    size_aware: bool = False  # slots carry log(tokens merged in), added to their attention logits; paper: False
    picture_balance: bool = False  # the image quota's slots go round-robin across pictures; paper: False
    text_window: bool = False  # the recent window holds only the text after the last picture; paper: False
    scores: str = ATTENTION  # or RECONSTRUCTION or SPLIT; paper: attention (eq. 4)
    reconstruction_weight: float = RECONSTRUCTION_WEIGHT  # SPLIT only

    def __post_init__(self):
        super().__post_init__()
        if self.scores not in SCORES:
            raise InputError(f"scores must be one of {SCORES}, got {self.scores!r}")
        if not (is_real(self.reconstruction_weight) and 0 <= self.reconstruction_weight <= 1):
            raise InputError(f"reconstruction_weight must be a fraction in [0, 1], got {self.reconstruction_weight!r}")
        if self.reconstruction_weight != RECONSTRUCTION_WEIGHT and self.scores != SPLIT:
            raise InputError(f"reconstruction_weight only applies with scores='{SPLIT}', got scores={self.scores!r}")
        if self.scores == SPLIT and not self.text_prior:
            raise InputError(f"scores='{SPLIT}' ranks text and image tokens by different scores, which only "
                             "text_prior=True keeps apart")
        if self.keep_all_text and self.layer_split != "uniform":
            raise InputError("keep_all_text needs layer_split='uniform' (its capacity is not M + N)")
        if self.capacity_ratio is not None and not self.keep_all_text:
            raise InputError("capacity_ratio only applies with keep_all_text=True")
        if self.capacity_ratio is not None and not (is_real(self.capacity_ratio) and 0 < self.capacity_ratio <= 1):
            raise InputError(f"capacity_ratio must be None or a fraction in (0, 1], got {self.capacity_ratio!r}")

    def selection(self) -> SelectionSpec:
        return SelectionSpec(text_prior=self.text_prior, merge=self.merge, n_sink=self.n_sink,
                             similarity_filter=self.similarity_filter, keep_all_text=self.keep_all_text,
                             image_quota=self.image_quota, merge_scope=self.merge_scope,
                             size_aware=self.size_aware, picture_balance=self.picture_balance,
                             text_window=self.text_window)

    def capacity(self, bucket_len: int) -> int:
        if not self.keep_all_text:
            return super().capacity(bucket_len)
        if self.capacity_ratio is None:
            return bucket_len
        return min(bucket_len, max(super().capacity(bucket_len), math.floor(self.capacity_ratio * bucket_len)))

    @property
    def statistics(self) -> tuple[str, ...]:
        return {ATTENTION: (SUMS,), RECONSTRUCTION: (RECONSTRUCTION,), SPLIT: (SUMS, RECONSTRUCTION)}[self.scores]

    def queries_read(self, bucket_len: int) -> int:
        return VOTES_WINDOW if self.scores == SPLIT else 0

    def score(self, queries, keys, valid, is_image, stats, n_recent):
        if self.scores == ATTENTION:
            return scores_from_stats(stats)
        reconstruction = stats[RECONSTRUCTION].max(axis=2)  # [B, Hkv, G, L] -> [B, Hkv, L], max over the group as KVzip
        if self.scores == RECONSTRUCTION:
            return reconstruction
        window = jnp.full(valid.shape[:1], VOTES_WINDOW, jnp.int32)  # [B]
        votes = window_scores(queries, keys, valid, valid, window, max_window=VOTES_WINDOW)
        w = self.reconstruction_weight
        image = w * _share(reconstruction, valid) + (1 - w) * _share(votes, valid)
        return jnp.where(is_image[:, None, :], image, scores_from_stats(stats))


def _share(scores: jax.Array, valid: jax.Array) -> jax.Array:
    """[B, Hkv, L] non-negative scores, valid [B, L] -> each divided by its row and head's total over the
    valid tokens (0 at padding)."""
    scores = jnp.where(valid[:, None, :], scores, 0.0)
    return scores / jnp.maximum(scores.sum(axis=-1, keepdims=True), jnp.finfo(scores.dtype).tiny)
