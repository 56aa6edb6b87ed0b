"""What the demo model knows, full cache, greedy: single pictures and text, beside the frozen decoder.

    python bench/demo_report.py                                   # the shipped demo (DEMO_DECODER)
    python bench/demo_report.py --adapters RUN/demo_adapters.safetensors --vision RUN/demo_vision.safetensors
    python bench/demo_report.py --single 600 --combination 200 --json report.json

Prints, for the candidate model (the shipped demo, or a stage-2 run's exported weights folded into it):
- held-out single-picture questions (`eval.scenes.single_picture_accuracy`, the four kinds in turn),
  also by the number of objects in the picture and on the questions that must tell one object of
  several from the others (colour, shape, side: "binding"), and the held-out colour-shape
  combination (green triangles, never in training), scored on the answer's first word; and as many
  held-out questions again over scenes without a green triangle (`pairs="trained"`): the trained
  skill apart from generalising to the unseen pair;
- text only: the share of the first 32 greedy tokens equal to the frozen SmolLM2's on the held-out
  replay prompts (`train.replay`, none of which training reads), and the Paris question's answer;
  beside it, what that share is made of: the same tokens read with the frozen continuation as the
  prefix (`replay.forced_divergence`: how often the candidate's next token is the frozen one's, and how
  near the frozen decoder was to choosing the candidate's token where they first differ), and the share
  the frozen decoder itself keeps when run in bfloat16 instead of float32 (the measure's own sensitivity
  to near-ties).
Multi-picture questions are `lookm eval scenes calibrate` (the full cache per task).
"""

from __future__ import annotations

import argparse
import json
import time

from bench_args import at_least, json_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", help="a stage-2 adapters file (default: the demo's own decoder)")
    parser.add_argument("--vision", help="a demo_vision.safetensors (default: the shipped one)")
    parser.add_argument("--single", type=at_least(1), default=600, help="held-out single-picture questions")
    parser.add_argument("--combination", type=at_least(1), default=200, help="held-out combination questions")
    parser.add_argument("--seed", type=at_least(0), default=0, help="seed of the held-out splits")
    parser.add_argument("--json", type=json_path, help="also write the figures here")
    args = parser.parse_args()

    import jax.numpy as jnp
    import numpy as np

    from lookm_jax import loading
    from lookm_jax.eval import scenes as bench
    from lookm_jax.train import replay

    start = time.perf_counter()
    candidate = loading.demo_model(vision=args.vision or "trained", decoder=args.adapters or loading.DEMO_DECODER)
    frozen = loading.demo_model(vision="trained", decoder="frozen")
    print(f"candidate: decoder {candidate.manifest['decoder']}; vision {candidate.manifest['vision'][:60]}", flush=True)
    single = bench.single_picture_accuracy(candidate, "heldout", args.single, args.seed)
    trained = bench.single_picture_accuracy(candidate, "heldout", args.single, args.seed, pairs="trained")
    combination = bench.single_picture_accuracy(candidate, "combination", args.combination, args.seed)
    prompts = replay.prompts("heldout", args.seed)
    ids = [candidate.encode_chat(p) for p in prompts]
    reference = replay.greedy_continuations(frozen, ids)
    generated = replay.greedy_continuations(candidate, ids)
    agreement = replay.agreement(reference, generated)
    exact = float(np.mean([replay.agreement([r], [g]) == 1.0 for r, g in zip(reference, generated)]))
    forced = replay.forced_divergence(frozen, candidate, ids, reference)
    rounded = replay.agreement(reference, replay.greedy_continuations(frozen.astype(jnp.bfloat16), ids))
    paris = candidate.decode_text(candidate.generate(candidate.encode_chat("What is the capital of France?"),
                                                     max_new_tokens=16)[0])
    report = {"single_accuracy": single["accuracy"], "single_by_kind": single["by_kind"], "single_n": args.single,
              "single_by_objects": single["by_objects"], "single_binding": single["binding"],
              "single_trained_accuracy": trained["accuracy"], "single_trained_by_kind": trained["by_kind"],
              "combination_accuracy": combination["accuracy"], "combination_n": args.combination,
              "text_agreement": agreement, "text_identical_share": exact, "text_prompts": len(prompts),
              "text_forced_agreement": forced["forced_agreement"], "text_gap_at_divergence": forced["gap_at_divergence"],
              "frozen_bfloat16_text_agreement": rounded,
              "paris_answer": paris, "seconds": round(time.perf_counter() - start, 1)}
    print(f"single picture ({args.single} held-out): {single['accuracy']:.3f}; "
          + ", ".join(f"{k} {v:.3f}" for k, v in single["by_kind"].items()))
    print("single picture by objects in it: " + ", ".join(f"{n} {v:.3f}" for n, v in single["by_objects"].items()))
    if single["binding"] is not None:
        print(f"colour, shape or side of one object of several: {single['binding']:.3f} (answering about a random "
              "one of them: 1/2 or 1/3 for colour and shape, 0.46 over the first 600 held-out questions)")
    print(f"single picture ({args.single} held-out, no green triangle in the scene): {trained['accuracy']:.3f}; "
          + ", ".join(f"{k} {v:.3f}" for k, v in trained["by_kind"].items()))
    print(f"held-out combination ({args.combination}): {combination['accuracy']:.3f}")
    print(f"text ({len(prompts)} held-out prompts): {agreement:.3f} of the first {replay.REPLAY_TOKENS} greedy tokens "
          f"equal to the frozen decoder's; {exact:.2f} of the prompts identical throughout")
    gap = forced["gap_at_divergence"]
    print(f"  with the frozen continuation as the prefix: {forced['forced_agreement']:.3f} of its tokens the candidate's "
          f"next token; where they first differ the frozen decoder preferred its own by a median "
          f"{'-' if gap is None else f'{gap:.3f}'} in probability; the frozen decoder in bfloat16 keeps {rounded:.3f}")
    print(f"'What is the capital of France?' -> {paris!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
