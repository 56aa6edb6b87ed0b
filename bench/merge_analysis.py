"""Where LOOK-M's merges go on the scenes benchmark's prompts (demo model, trained tower).

    python bench/merge_analysis.py [--pictures 8] [--samples 8] [--budgets 0.05 0.1 0.2 0.5] [--json PATH]

For each budget, with and without text-prior, on `--samples` prompts of every `lookm eval scenes`
task: the share of evicted pairs that are image tokens, the share of kept slots that hold text, how
many evicted pairs a kept text / image slot absorbs (mean; the most any slot absorbs), the share of
evicted image pairs folded into text slots (and into the recent window's text slots), and the mean
cosine of those merges (`lookm_jax.analysis.merge_traffic`). Counts are over rows, layers and KV
heads. The assignment (eq. 9) is the same for the three merge rules; only the weights differ.
"""

from __future__ import annotations

import argparse
import json

from bench_args import at_least, json_path, kept_fraction

COLUMNS = ("evicted_image", "text_slots", "absorbed_text", "absorbed_image", "absorbed_max", "image_into_text",
           "image_into_recent_text", "cosine_image_text", "cosine_image_image")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pictures", type=int, default=8, help="pictures per prompt, in [2, 10]")
    parser.add_argument("--samples", type=at_least(1), default=8, help="prompts per task")
    parser.add_argument("--budgets", type=kept_fraction, nargs="+", default=[0.05, 0.1, 0.2, 0.5], help="kept fractions")
    parser.add_argument("--json", metavar="PATH", type=json_path, help="also write every figure to PATH")
    args = parser.parse_args()
    from lookm_jax import scenes

    if not 2 <= args.pictures < len(scenes.NUMBERS):
        parser.error(f"--pictures must be in [2, {len(scenes.NUMBERS) - 1}], got {args.pictures}")

    import lookm_jax
    from lookm_jax import analysis, get_method
    from lookm_jax.eval import harness, scenes as bench

    model = lookm_jax.load_default()
    prompts = [p for task in bench.TASKS for p in bench.task_prompts(model, task, args.pictures, args.samples, 0)]
    results = []
    print(f"{len(prompts)} prompts ({', '.join(bench.TASKS)}), {args.pictures} pictures each")
    print("| budget | text-prior | " + " | ".join(COLUMNS) + " |\n|" + "---|" * (len(COLUMNS) + 2))
    for budget in args.budgets:
        for text_prior in (True, False):
            method = get_method("lookm", budget=budget, text_prior=text_prior, merge="pivotal")
            counts: dict = {}
            for start in range(0, len(prompts), 4):
                ids, mask, pixels = harness.batch_inputs(model, prompts[start:start + 4])
                for key, value in analysis.merge_traffic(model, ids, pixels, mask, method).items():
                    counts[key] = max(counts.get(key, 0), value) if key == "absorbed_max" else counts.get(key, 0) + value
            row = {"budget": budget, "text_prior": text_prior, "evicted": counts["evicted"],
                   **analysis.traffic_shares(counts)}
            results.append(row)
            print(f"| {budget:g} | {'on' if text_prior else 'off'} | "
                  + " | ".join(f"{row[c]:.3g}" for c in COLUMNS) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pictures": args.pictures, "samples_per_task": args.samples, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
