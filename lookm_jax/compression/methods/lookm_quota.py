"""LOOK-M with an image quota: the composite method of issue 30, its defaults tuned on held-out scenes."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from lookm_jax.compression.methods.lookm import LookM


@dataclasses.dataclass(frozen=True)
class LookMQuota(LookM):
    """Text-prior LOOK-M whose ranked slots reserve 60% for the best image tokens (``image_quota=0.6``;
    the other 40% go to text first), without merging and without a recent window (``RECENT_SHARE`` 0: a
    ``budget`` is all ranked slots; the other methods split it evenly).

    Chosen on held-out scenes (DEMO_BUILD 9, seed 1, 8 pictures, every picture task, the question asked after
    compression, 120 questions a cell; `docs/RESULTS.md`, "Choosing the composite"): first the method
    among seven candidates at 1/5/10% (text-prior with a proportional quota, no merge: the best mean, 0.28
    against H2O's 0.25), then the recent window's share (0.25 of 0.5 / 0.25 / 0.1 / 0), then (session 26)
    the quota and the window together at 1/5/10/20%: a quota of 0.6 without a window had the best mean
    (0.36; 0.27 / 0.31 / 0.35 / 0.53 against 0.23 / 0.32 / 0.32 / 0.32 for the proportional quota with a
    quarter window). A picture prompt's last tokens are its last picture, of no more use than the others
    to a question asked later, and the text after each picture (its "Picture k:" marker, the prompt's
    words) carries much of what a later question reads, so a quota that leaves room for it keeps more.
    Only there: with the question inside the compressed prompt, the missing window evicts the turn's end
    (question, assistant header) and answers degenerate ("describe picture k", DEMO_BUILD 10: 0.11 / 0.13 /
    0.45 at 5 / 10 / 20% against H2O's 0.86 / 0.91 / 0.92; `docs/RESULTS.md`, "The question in the prompt").
    Every option of ``LookM`` stays available (e.g. ``merge="averaged", merge_scope="same_modality",
    size_aware=True``).
    """

    image_quota: float | str | None = 0.6
    merge: str | None = None
    RECENT_SHARE: ClassVar[float] = 0.0
