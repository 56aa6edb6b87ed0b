"""RoCo (Ren & Zhu 2024) applied once after prefill: mean attention with a robustness term."""

from __future__ import annotations

import dataclasses

from lookm_jax.checks import is_real
from lookm_jax.errors import InputError
from lookm_jax.compression.methods.base import ScorerMethod
from lookm_jax.compression.scoring import STATISTICS, mean_std_from_stats


@dataclasses.dataclass(frozen=True)
class RoCo(ScorerMethod):
    """Recent M + top N by mean attention A_s[j] / n_j (n_j = queries that can see j) + std_weight * std.

    Deviation from the original (EasyKV's RoCo): it evicts by mean attention only among the tokens
    whose attention standard deviation is low (a std-gated eviction scope). That gate is not
    implemented; ``std_weight`` > 0 expresses the idea as a bonus for high-variance tokens instead.
    Default 0: rank by the mean alone. Reads column sums and sums of squares.
    """

    statistics = STATISTICS
    std_weight: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if not is_real(self.std_weight):
            raise InputError(f"std_weight must be a finite number, got {self.std_weight!r}")

    def score(self, queries, keys, valid, is_image, stats, n_recent):
        mean, std = mean_std_from_stats(stats, valid)
        return mean + self.std_weight * std
