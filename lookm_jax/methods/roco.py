"""RoCo (Ren & Zhu 2024) applied once after prefill: mean attention with a robustness term."""

from __future__ import annotations

import dataclasses

from lookm_jax.compress import CompressedKV, compress_kv
from lookm_jax.methods.base import BudgetMethod
from lookm_jax.scoring import attention_mean_std


@dataclasses.dataclass(frozen=True)
class RoCo(BudgetMethod):
    """Recent M + top N by mean attention A_s[j] / n_j (n_j = queries that can see j) + std_weight * std.

    RoCo only evicts among low-variance tokens; ``std_weight`` > 0 expresses that as a bonus for
    high-variance tokens. Default 0: rank by the mean alone. ``block``: scoring block size.
    """

    std_weight: float = 0.0
    block: int = 128

    def __call__(self, queries, keys, values, is_image, valid) -> CompressedKV:
        m, n = self.budgets(valid)
        mean, std = attention_mean_std(queries, keys, valid, block=self.block)
        return compress_kv(
            keys, values, mean + self.std_weight * std, is_image=is_image, valid=valid,
            n_recent=m, n_important=n, text_prior=False, capacity=self.capacity(keys.shape[2]),
            block=self.block,
        )
