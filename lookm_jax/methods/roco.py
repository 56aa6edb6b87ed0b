"""RoCo (Ren & Zhu 2024) applied once after prefill: mean attention with a robustness term."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from lookm_jax.compress import CompressedKV, compress_kv
from lookm_jax.methods.base import AttentionMethod
from lookm_jax.scoring import STATISTICS, mean_std_from_stats


@dataclasses.dataclass(frozen=True)
class RoCo(AttentionMethod):
    """Recent M + top N by mean attention A_s[j] / n_j (n_j = queries that can see j) + std_weight * std.

    RoCo only evicts among low-variance tokens; ``std_weight`` > 0 expresses that as a bonus for
    high-variance tokens. Default 0: rank by the mean alone. Reads column sums and sums of squares.
    """

    statistics: ClassVar[tuple[str, ...]] = STATISTICS
    std_weight: float = 0.0

    def compress_from_stats(self, keys, values, is_image, valid, stats) -> CompressedKV:
        m, n = self.budgets(valid)
        mean, std = mean_std_from_stats(stats, valid)
        return compress_kv(
            keys, values, mean + self.std_weight * std, is_image=is_image, valid=valid,
            n_recent=m, n_important=n, text_prior=False, capacity=self.capacity(keys.shape[2]),
            block=self.block,
        )
