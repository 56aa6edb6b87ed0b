"""H2O (Zhang et al. 2023) as LOOK-M ran it: one-shot prefill eviction by accumulated attention."""

from __future__ import annotations

import dataclasses

from lookm_jax.compress import CompressedKV, compress_kv
from lookm_jax.methods.base import AttentionMethod
from lookm_jax.scoring import scores_from_stats


@dataclasses.dataclass(frozen=True)
class H2O(AttentionMethod):
    """Recent M + top N by A_s (eq. 4), no text-prior, no merging."""

    def compress_from_stats(self, keys, values, is_image, valid, stats) -> CompressedKV:
        m, n = self.budgets(valid)
        return compress_kv(
            keys, values, scores_from_stats(stats), is_image=is_image, valid=valid, n_recent=m,
            n_important=n, text_prior=False, capacity=self.capacity(keys.shape[2]), block=self.block,
        )
