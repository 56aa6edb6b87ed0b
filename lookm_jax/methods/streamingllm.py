"""StreamingLLM (Xiao et al. 2023) applied once after prefill: attention sinks + recent window."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from lookm_jax.compress import CompressedKV, compress_kv
from lookm_jax.methods.base import BudgetMethod


@dataclasses.dataclass(frozen=True)
class StreamingLLM(BudgetMethod):
    """Keeps the first ``n_sink`` valid tokens and the most recent ones.

    The budget M + N (alpha_recent, alpha_important) is the same as every other method's, so
    methods compare at equal cache size: the sinks take min(n_sink, M + N) of it and the recent
    window the rest. Scores play no part.
    """

    n_sink: int = 4

    def queries_read(self, bucket_len: int) -> int:
        return 0

    def __call__(self, queries, keys, values, is_image, valid, stats=None) -> CompressedKV:
        m, n = self.budgets(valid)
        sinks = jnp.minimum(self.n_sink, m + n)
        return compress_kv(
            keys, values, jnp.zeros(keys.shape[:3], jnp.float32), is_image=is_image, valid=valid,
            n_recent=m + n - sinks, n_important=sinks, text_prior=False, n_sink=self.n_sink,
            capacity=self.capacity(keys.shape[2]),
        )
