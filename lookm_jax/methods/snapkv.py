"""SnapKV (Li et al. 2024): scores from an observation window of the last queries, pooled."""

from __future__ import annotations

import dataclasses
import math

from lookm_jax.compress import CompressedKV, compress_kv
from lookm_jax.methods.base import BudgetMethod
from lookm_jax.scoring import window_scores
from lookm_jax.select import recent_mask


@dataclasses.dataclass(frozen=True)
class SnapKV(BudgetMethod):
    """Recent M + top N by pooled observation-window attention.

    window: W, the last W valid queries of each row vote (SnapKV default 32); None uses W = M per
      row, as LOOK-M's own SnapKV runs did (with kernel_size=5, pooling="avg").
    kernel_size, pooling: odd pooling width and "max" | "avg" (SnapKV default: max, 7).
    The votes go to the tokens outside the recent window only, as SnapKV scores its prefix.
    """

    window: int | None = 32
    kernel_size: int = 7
    pooling: str = "max"

    def __post_init__(self):
        super().__post_init__()
        if self.kernel_size % 2 != 1 or self.pooling not in ("max", "avg"):
            raise ValueError(f"need an odd kernel_size and pooling 'max' | 'avg', got {self.kernel_size}, {self.pooling!r}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1 or None, got {self.window}")

    def queries_read(self, bucket_len: int) -> int:
        """W, or with window=None the largest per-row M = floor(alpha_recent * L) for this bucket."""
        return self.window if self.window is not None else max(1, math.floor(self.alpha_recent * bucket_len))

    def __call__(self, queries, keys, values, is_image, valid, stats=None) -> CompressedKV:
        m, n = self.budgets(valid)
        length = keys.shape[2]
        window = m if self.window is None else self.window
        max_window = self.queries_read(length)
        scores = window_scores(
            queries, keys, valid, valid & ~recent_mask(valid, m), window,
            max_window=max_window, kernel_size=self.kernel_size, pooling=self.pooling,
        )
        return compress_kv(
            keys, values, scores, is_image=is_image, valid=valid, n_recent=m, n_important=n,
            text_prior=False, capacity=self.capacity(length),
        )
