"""StreamingLLM (Xiao et al. 2023) applied once after prefill: attention sinks + recent window."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from lookm_jax.compression.compress import SelectionSpec
from lookm_jax.errors import InputError
from lookm_jax.compression.methods.base import ScorerMethod


@dataclasses.dataclass(frozen=True)
class StreamingLLM(ScorerMethod):
    """Keeps the first ``n_sink`` valid tokens and the most recent ones.

    The budget M + N (alpha_recent, alpha_important) is the same as every other method's, so
    methods compare at equal cache size: the sinks take min(n_sink, M + N) of it and the recent
    window the rest. Scores play no part.

    Deviation from the original: StreamingLLM re-assigns RoPE positions within its rolling cache
    (sinks at 0.., the window right after them); here every kept key keeps the rotation of its
    original prompt position and decoding continues at the prompt's length, as for every other
    method, so the methods differ only in which slots they keep.
    """

    n_sink: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.layer_split != "uniform":
            raise InputError("streamingllm ranks nothing, so it has no ranked slots to split over layers "
                             "(layer_split must be 'uniform')")
        if self.head_split != "uniform":
            raise InputError("streamingllm ranks nothing, so it has no ranked slots to split over heads "
                             "(head_split must be 'uniform')")

    def selection(self) -> SelectionSpec:
        return SelectionSpec(n_sink=self.n_sink)

    def slots(self, valid):
        m, n = self.budgets(valid)
        sinks = jnp.minimum(self.n_sink, m + n)
        return m + n - sinks, sinks

    def score(self, queries, keys, valid, is_image, stats, n_recent):
        return jnp.zeros(keys.shape[:3], jnp.float32)
