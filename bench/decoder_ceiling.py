"""How well the frozen SmolLM2 decoder answers the held-out scene questions when it is *told* the scene.

    python bench/decoder_ceiling.py [--samples 60] [--json PATH]

The held-out single-picture questions of `lookm eval scenes` (`lookm_jax.eval.scenes.held_out_questions`, 4 kinds
in turn), but the picture is replaced by an exact description in words ("The picture shows two
shapes: a red circle at the top left, a blue square at the bottom right."), text only, greedy. Each
question is asked plainly and with " Answer with one word." appended, and scored two ways: by the
benchmark's first-word rule (`lookm_jax.eval.scenes.first_word`), and by content: the first word of the question's
answer vocabulary (the colours, the shapes, the numbers, left/right or top/bottom) in the output.
This bounds what the vision side can hope for if all it did was describe: the projector has to teach
the answer format too, and the decoder's reading of a perfect description is itself imperfect.
"""

from __future__ import annotations

import argparse
import json
import re

from lookm_jax import scenes
from bench_args import at_least, json_path

INSTRUCTION = " Answer with one word."


def describe(scene: scenes.Scene) -> str:
    parts = [f"a {o.colour} {o.shape} at the {'top' if o.y < 0.5 else 'bottom'} {'left' if o.x < 0.5 else 'right'}"
             for o in scene.objects]
    n = len(scene.objects)
    return f"The picture shows {scenes.NUMBERS[n]} shape{'s' if n > 1 else ''}: " + ", ".join(parts) + "."


def answer_vocabulary(question: scenes.Question) -> set[str]:
    if question.kind == "position":
        return {"left", "right"} if question.answer in ("left", "right") else {"top", "bottom"}
    return {"colour": set(scenes.COLOURS), "shape": set(scenes.SHAPES), "count": set(scenes.NUMBERS)}[question.kind]


def content_answer(output: str, question: scenes.Question) -> str:
    """The first word of the question's answer vocabulary in `output` ('' if none)."""
    vocabulary = answer_vocabulary(question)
    return next((w for w in re.findall(r"[a-z]+", output.lower()) if w in vocabulary), "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=at_least(1), default=60, help="held-out questions (the 4 kinds in turn)")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=14, help="greedy tokens per answer")
    parser.add_argument("--json", metavar="PATH", type=json_path, help="also write the figures to PATH")
    args = parser.parse_args()

    import numpy as np

    from lookm_jax import loading
    from lookm_jax.eval import scenes as scene_eval

    model = loading.demo_model()
    items = scene_eval.held_out_questions("heldout", args.samples)
    kinds = list(dict.fromkeys(q.kind for _, q in items))
    results = {}
    for name, suffix in (("plain", ""), ("one-word instruction", INSTRUCTION)):
        prompts = [describe(scene) + "\n" + q.text + suffix for scene, q in items]
        outputs = scene_eval.ask(model, None, prompts, max_new_tokens=args.max_new_tokens)
        scores = {"first word": [scene_eval.first_word(o) == q.answer for (_, q), o in zip(items, outputs)],
                  "content": [content_answer(o, q) == q.answer for (_, q), o in zip(items, outputs)]}
        results[name] = {
            rule: {"all": float(np.mean(s)),
                   **{k: float(np.mean([c for (_, q), c in zip(items, s) if q.kind == k])) for k in kinds}}
            for rule, s in scores.items()}
        results[name]["examples"] = [(q.text, q.answer, o) for (_, q), o in list(zip(items, outputs))[:4]]

    print(f"frozen SmolLM2-135M told each of {len(items)} held-out scenes in words, greedy, {args.max_new_tokens} tokens")
    print(f"{'prompt':22s} | {'scored by':10s} | {'all':>5s} | " + " | ".join(f"{k:>8s}" for k in kinds))
    for name, by_rule in results.items():
        for rule in ("first word", "content"):
            row = by_rule[rule]
            print(f"{name:22s} | {rule:10s} | {row['all']:5.2f} | " + " | ".join(f"{row[k]:8.2f}" for k in kinds))
    for name, by_rule in results.items():
        print(f"{name}: e.g. " + "; ".join(f"{q!r} -> {o!r} ({a})" for q, a, o in by_rule["examples"][:2]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples": len(items), "max_new_tokens": args.max_new_tokens, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
