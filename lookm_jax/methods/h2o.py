"""H2O (Zhang et al. 2023) as LOOK-M ran it: one-shot prefill eviction by accumulated attention."""

from __future__ import annotations

import dataclasses

from lookm_jax.compress import CompressedKV, compress_kv
from lookm_jax.methods.base import BudgetMethod
from lookm_jax.scoring import attention_scores


@dataclasses.dataclass(frozen=True)
class H2O(BudgetMethod):
    """Recent M + top N by A_s (eq. 4), no text-prior, no merging. ``block``: scoring block size."""

    block: int = 128

    def __call__(self, queries, keys, values, is_image, valid) -> CompressedKV:
        m, n = self.budgets(valid)
        scores = attention_scores(queries, keys, valid, block=self.block)
        return compress_kv(
            keys, values, scores, is_image=is_image, valid=valid, n_recent=m, n_important=n,
            text_prior=False, capacity=self.capacity(keys.shape[2]), block=self.block,
        )
