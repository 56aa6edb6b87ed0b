"""LOOK-M with an image quota: the composite method of issue 30, its defaults tuned on held-out scenes."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from lookm_jax.compression.methods.lookm import LookM


@dataclasses.dataclass(frozen=True)
class LookMQuota(LookM):
    """Text-prior LOOK-M whose ranked slots reserve the image tokens' share for the best image tokens
    (``image_quota="proportional"``), without merging, and whose recent window takes a quarter of a
    ``budget`` (``RECENT_SHARE``; the other methods split it evenly).

    Chosen on held-out scenes (seed 1, 8 pictures, every picture task, the question asked after
    compression, 120 questions a cell; `docs/RESULTS.md`): first among seven candidates at 1/5/10% (H2O;
    text-prior with the quota, merged or not; no text-prior with same-modality merging, with and without
    size-aware slots, sinks and a pyramid split: the best mean, 0.28 against H2O's 0.25), then its recent
    window's share among 0.5 / 0.25 / 0.1 / 0 at 1/5/10/20% (0.25: the best mean, 0.30 against 0.28 for
    0.5; a picture prompt's last tokens are its last picture, of no more use than the others to a question
    asked later; on the reported seed the two are within a standard error). Every option of ``LookM`` stays available (e.g. ``merge="averaged",
    merge_scope="same_modality", size_aware=True``).
    """

    image_quota: float | str | None = "proportional"
    merge: str | None = None
    RECENT_SHARE: ClassVar[float] = 0.25
