"""LOOK-M (Wan et al. 2024): text-prior eviction by accumulated attention, then KV merging."""

from __future__ import annotations

import dataclasses
import math

from lookm_jax.compress import CompressedKV, compress_kv
from lookm_jax.merge import MERGES
from lookm_jax.methods.base import AttentionMethod
from lookm_jax.scoring import scores_from_stats


@dataclasses.dataclass(frozen=True)
class LookM(AttentionMethod):
    """Recent M + top N by A_s (eq. 4), text-prior (eq. 5), merging (eq. 9-12).

    Paper default: text_prior=True, merge="pivotal", alpha_recent = alpha_important = 0.1.
    Reproductions of the authors' code, off by default (see ``compress_kv``): ``n_sink`` (their
    non-text-prior merges keep 4 sinks), ``similarity_filter``, ``keep_all_text`` (the cache may
    then exceed M + N: its static capacity is floor(capacity_ratio * bucket_len), or the whole
    bucket when capacity_ratio is None). ``block`` is also the token block of the similarity scan.
    """

    text_prior: bool = True
    merge: str | None = "pivotal"
    n_sink: int = 0
    similarity_filter: bool = False
    keep_all_text: bool = False
    capacity_ratio: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.merge is not None and self.merge not in MERGES:
            raise ValueError(f"merge must be None or one of {MERGES}, got {self.merge!r}")
        if self.similarity_filter and self.merge is None:
            raise ValueError("similarity_filter needs a merge mode")
        if self.keep_all_text and not self.text_prior:
            raise ValueError("keep_all_text needs text_prior=True")
        if self.capacity_ratio is not None and not self.keep_all_text:
            raise ValueError("capacity_ratio only applies with keep_all_text=True")

    def capacity(self, bucket_len: int) -> int:
        if not self.keep_all_text:
            return super().capacity(bucket_len)
        if self.capacity_ratio is None:
            return bucket_len
        return min(bucket_len, max(super().capacity(bucket_len), math.floor(self.capacity_ratio * bucket_len)))

    def compress_from_stats(self, keys, values, is_image, valid, stats) -> CompressedKV:
        m, n = self.budgets(valid)
        return compress_kv(
            keys, values, scores_from_stats(stats), is_image=is_image, valid=valid, n_recent=m, n_important=n,
            text_prior=self.text_prior, merge=self.merge, n_sink=self.n_sink,
            similarity_filter=self.similarity_filter, keep_all_text=self.keep_all_text,
            capacity=self.capacity(keys.shape[2]), block=self.block,
        )
