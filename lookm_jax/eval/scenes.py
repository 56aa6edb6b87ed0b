"""Questions whose answers are in the pictures: held-out accuracy of the demo's trained vision side.

`single_picture_accuracy` asks held-out scene questions (`lookm_jax.scenes`), one picture per prompt,
greedy, full cache, and scores the first word of each answer.
"""

from __future__ import annotations

import re

import numpy as np

from lookm_jax import scenes


def first_word(text: str) -> str:
    """'Red.' -> 'red'; 'Picture 3.' -> 'picture 3' (the answer forms of `scenes.answer_text`)."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    if words[:1] == ["picture"]:
        return " ".join(words[:2])
    return words[0] if words else ""


def held_out_questions(split: str, n: int, seed: int = 0) -> list[tuple[scenes.Scene, scenes.Question]]:
    """n questions of a split; the held-out split cycles through the four kinds evenly."""
    if split == "combination":
        return [(s.scene, s.questions[0]) for s in scenes.single_picture_samples(split, seed, n)]
    out = []
    for i in range(n):
        sample = scenes.single_picture_sample(split, seed, i, kind=scenes.KINDS[i % len(scenes.KINDS)])
        out.append((sample.scene, sample.questions[0]))
    return out


def ask(model, pictures: list, prompts: list[str], batch_size: int = 12, max_new_tokens: int = 6) -> list[str]:
    """Greedy answers, full cache, to prompts with one picture each (prompts padded into batches)."""
    size = model.config.pixel_shape[-1]
    answers = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(range(start, min(start + batch_size, len(prompts))))
        encoded = [model.encode_chat(prompts[i], num_images=1)[0] for i in chunk]
        ids = np.zeros((len(chunk), max(len(e) for e in encoded)), np.int32)
        mask = np.zeros(ids.shape, bool)
        for r, e in enumerate(encoded):
            ids[r, :len(e)], mask[r, :len(e)] = e, True
        pixels, _ = model.preprocess_images([scenes.render(pictures[i], size) for i in chunk])
        tokens = model.generate(ids, pixels, mask, max_new_tokens=max_new_tokens)
        answers += [model.decode_text(t) for t in tokens]
    return answers


def single_picture_accuracy(model, split: str = "heldout", n: int = 60, seed: int = 0) -> dict:
    """{"accuracy", "by_kind": {kind: accuracy}, "rows": [(question, answer, output)]}."""
    items = held_out_questions(split, n, seed)
    outputs = ask(model, [s for s, _ in items], [q.text for _, q in items])
    correct = [first_word(o) == q.answer for (_, q), o in zip(items, outputs)]
    by_kind: dict[str, list[bool]] = {}
    for (_, q), c in zip(items, correct):
        by_kind.setdefault(q.kind, []).append(c)
    return {"accuracy": float(np.mean(correct)), "by_kind": {k: float(np.mean(v)) for k, v in by_kind.items()},
            "rows": [(q.text, q.answer, o) for (_, q), o in zip(items, outputs)]}
