"""LOOK-M with an image quota: the composite method of issue 30, its defaults tuned on held-out scenes."""

from __future__ import annotations

import dataclasses

from lookm_jax.compression.methods.lookm import SPLIT, LookM


@dataclasses.dataclass(frozen=True)
class LookMQuota(LookM):
    """Text-prior LOOK-M whose ranked slots reserve half for image tokens, handed out round-robin over the
    pictures (``image_quota=0.5, picture_balance=True``; the other half go to text first), a recent
    window over the text after the last picture only (``text_window=True``; half the budget, its unused
    slots ranked), no merging, and its text ranked by eq. 4, its image tokens by KVzip's reconstruction
    maxima (3/4) and the last 32 queries' votes (1/4) (``scores="split"``: the prompt is encoded twice over).

    Chosen on held-out scenes (8 pictures, every picture task, seed 1; `docs/RESULTS.md`, "Choosing the
    composite"): on DEMO_BUILD 9 the method (text-prior with a quota, no merge, 0.28 at 1/5/10% against
    H2O's 0.25) and then no window over the last picture (a quota of 0.6 without a window, 0.36 over
    1-20%, against 0.30 with a quarter window); on DEMO_BUILD 10 (session 30, 240 questions a cell) the
    text window, which keeps the question and the assistant's header when they are in the prompt
    (question in the prompt: 0.55 / 0.68 / 0.73 / 0.72 at 1 / 5 / 10 / 20% against 0.19 / 0.24 / 0.30 /
    0.38 without a window; full 0.72) and holds only the prompt's last line break when the question comes
    after compression, and with it a quota of 0.5 and picture balance (question after compression: 0.23 /
    0.45 / 0.62 / 0.66 against 0.23 / 0.36 / 0.46 / 0.65 for quota 0.6 unbalanced; full 0.72). A picture
    prompt's last tokens are its last picture, of no more use than the others to a question asked later,
    and the text after each picture (its "Picture k:" marker, the prompt's words) carries much of what a
    later question reads, so a quota that leaves room for it keeps more. On DEMO_BUILD 11 (session 37,
    seed 1, 120 questions a cell) the split scores, which serve a question asked in the prompt (0.57 /
    0.70 / 0.75 / 0.75 at 1 / 5 / 10 / 20% against eq. 4's 0.58 / 0.71 / 0.74 / 0.75) and one asked after
    compression (0.22 / 0.58 / 0.71 / 0.76 against eq. 4's 0.25 / 0.53 / 0.61 / 0.70 and the
    reconstruction maxima's 0.21 / 0.53 / 0.70 / 0.75; full 0.75 in both). Every option of ``LookM``
    stays available (e.g. ``scores="attention"``, the cheaper prefill; ``merge="averaged",
    merge_scope="same_modality", size_aware=True``).
    """

    image_quota: float | str | None = 0.5
    picture_balance: bool = True
    text_window: bool = True
    merge: str | None = None
    scores: str = SPLIT
