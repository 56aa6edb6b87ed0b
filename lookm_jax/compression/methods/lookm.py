"""LOOK-M (Wan et al. 2024): text-prior eviction by accumulated attention, then KV merging."""

from __future__ import annotations

import dataclasses
import math

from lookm_jax.checks import is_real
from lookm_jax.compression.compress import SelectionSpec
from lookm_jax.errors import InputError
from lookm_jax.compression.methods.base import ScorerMethod
from lookm_jax.compression.scoring import RECONSTRUCTION, SUMS, scores_from_stats

ATTENTION = "attention"
SCORES = (ATTENTION, RECONSTRUCTION)  # eq. 4, or KVzip's reconstruction statistic


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
    of a question asked later and costs a prefill of the prompt twice over.
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
    scores: str = ATTENTION  # or RECONSTRUCTION; paper: attention (eq. 4)

    def __post_init__(self):
        super().__post_init__()
        if self.scores not in SCORES:
            raise InputError(f"scores must be one of {SCORES}, got {self.scores!r}")
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
        return (RECONSTRUCTION,) if self.scores == RECONSTRUCTION else (SUMS,)

    def score(self, queries, keys, valid, stats, n_recent):
        if self.scores == RECONSTRUCTION:
            return stats[RECONSTRUCTION].max(axis=2)  # [B, Hkv, G, L] -> [B, Hkv, L], max over the group as KVzip
        return scores_from_stats(stats)
