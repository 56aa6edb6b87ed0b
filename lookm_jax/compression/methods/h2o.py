"""H2O (Zhang et al. 2023) as LOOK-M ran it: one-shot prefill eviction by accumulated attention."""

from __future__ import annotations

import dataclasses

from lookm_jax.compression.methods.base import ScorerMethod
from lookm_jax.compression.scoring import SUMS, scores_from_stats


@dataclasses.dataclass(frozen=True)
class H2O(ScorerMethod):
    """Recent M + top N by A_s (eq. 4), no text-prior, no merging."""

    statistics = (SUMS,)

    def score(self, queries, keys, valid, is_image, stats, n_recent):
        return scores_from_stats(stats)
