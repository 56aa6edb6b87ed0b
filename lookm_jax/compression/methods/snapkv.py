"""SnapKV (Li et al. 2024): scores from an observation window of the last queries, pooled."""

from __future__ import annotations

import dataclasses
import math

from lookm_jax.checks import is_int_at_least
from lookm_jax.errors import InputError
from lookm_jax.compression.methods.base import ScorerMethod, smallest_fraction
from lookm_jax.compression.scoring import window_scores
from lookm_jax.compression.select import recent_mask


@dataclasses.dataclass(frozen=True)
class SnapKV(ScorerMethod):
    """Recent M + top N by pooled observation-window attention.

    window: W, the last W valid queries of each row vote (SnapKV default 32); None uses W = M per
      row, as LOOK-M's own SnapKV runs did (with kernel_size=5, pooling="avg").
    kernel_size, pooling: odd pooling width and "max" | "avg" (SnapKV default: max, 7).
    The votes go to the tokens outside the recent window only, as SnapKV scores its prefix.

    Deviation from the original: SnapKV's kept window is its observation window (M = W), and only
    the prefix before it is scored. Here M (alpha_recent) and W are independent; when M < W the
    candidates at [L - W, L - M) are inside the observation window and vote for themselves
    (causal attention includes the diagonal). window=None (W = M) is the original arrangement.
    """

    window: int | None = 32
    kernel_size: int = 7
    pooling: str = "max"

    def __post_init__(self):
        super().__post_init__()
        if not is_int_at_least(self.kernel_size, 1) or self.kernel_size % 2 != 1 or self.pooling not in ("max", "avg"):
            raise InputError(f"need an odd kernel_size >= 1 and pooling 'max' | 'avg', got {self.kernel_size!r}, "
                             f"{self.pooling!r}")
        if self.window is not None and not is_int_at_least(self.window, 1):
            raise InputError(f"window must be an int >= 1 or None, got {self.window!r}")
        if self.window is None and self.alpha_recent == 0:
            raise InputError("window=None votes with the recent window (W = M), so it needs alpha_recent > 0, "
                             f"got {self.alpha_recent!r}")

    def check_prompt_lengths(self, lengths) -> None:
        """As every scorer, and with window=None each row's recent window (its voters) must hold a token."""
        super().check_prompt_lengths(lengths)
        shortest = int(min(lengths))
        if self.window is None and math.floor(self.alpha_recent * shortest) < 1:
            raise InputError(f"window=None votes with the recent window, and alpha_recent={self.alpha_recent:g} keeps "
                             f"no recent slot of a {shortest}-token prompt (needs alpha_recent >= "
                             f"{smallest_fraction(1, shortest):g})")

    def queries_read(self, bucket_len: int) -> int:
        """W, or with window=None the largest per-row M = floor(alpha_recent * L) for this bucket."""
        return self.window if self.window is not None else max(1, math.floor(self.alpha_recent * bucket_len))

    def score(self, queries, keys, valid, is_image, stats, n_recent):
        window = n_recent if self.window is None else self.window
        return window_scores(queries, keys, valid, valid & ~recent_mask(valid, n_recent), window,
                             max_window=self.queries_read(keys.shape[2]), kernel_size=self.kernel_size,
                             pooling=self.pooling)


@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al. 2024): SnapKV's scores, with the budget split over the layers in a pyramid
    (``layer_split="pyramid"``: many slots in the first layers, few in the last; the same total as
    SnapKV's uniform budget). Its own defaults otherwise: window 32, max pooling of width 7, beta 20."""

    layer_split: str | tuple[float, ...] = "pyramid"


@dataclasses.dataclass(frozen=True)
class AdaKV(SnapKV):
    """AdaKV (Feng et al. 2024) over SnapKV: SnapKV's scores, each layer's ranked slots split over its KV
    heads by one top-k over all their scores with a per-head floor of 0.2 N (``head_split="adaptive"``;
    AdaKV's alpha_safeguard 0.2); the same total, in one pool of exactly the allocated slots."""

    head_split: str = "adaptive"
