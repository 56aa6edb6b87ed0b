"""How evenly compression keeps the pictures of a multi-picture prompt (demo model, scenes prompts).

    python bench/picture_coverage.py [--pictures 8] [--samples 4] [--budgets 0.05 0.2] [--methods ...] [--json PATH]

For each method and budget, on `--samples` prompts of every `lookm eval scenes` task: the mean number
of slots each picture keeps (picture 1 first; counted per layer, row and KV head,
`lookm_jax.analysis.kept_per_picture`), the share of (layer, row, head) in which some picture keeps
no slot, and the mean fewest and most slots a picture keeps. Accumulated attention (LOOK-M's A_s, H2O)
sums over the queries that see a token, so early pictures outscore late ones.
"""

from __future__ import annotations

import argparse
import json

from bench_args import at_least, json_path, kept_fraction


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pictures", type=int, default=8, help="pictures per prompt, in [2, 16]")
    parser.add_argument("--samples", type=at_least(1), default=4, help="prompts per task")
    parser.add_argument("--budgets", type=kept_fraction, nargs="+", default=[0.05, 0.2], help="kept fractions")
    parser.add_argument("--methods", nargs="+", default=["lookm_quota", "lookm_quota:picture_balance=True", "h2o",
                                                          "snapkv"], help="method specs, as `lookm eval` takes them")
    parser.add_argument("--json", metavar="PATH", type=json_path, help="also write every figure to PATH")
    args = parser.parse_args()
    from lookm_jax import scenes

    if not 2 <= args.pictures < len(scenes.NUMBERS):
        parser.error(f"--pictures must be in [2, {len(scenes.NUMBERS) - 1}], got {args.pictures}")

    import numpy as np

    import lookm_jax
    from lookm_jax import analysis, get_method
    from lookm_jax.eval import harness, scenes as bench

    try:  # a bad spec is refused here, before the model loads
        specs = [harness.parse_spec(spec) for spec in args.methods]
        for name, options in specs:
            get_method(name, budget=args.budgets[0], **options)
    except ValueError as err:
        parser.error(f"--methods: {err}")
    model = lookm_jax.load_default()
    prompts = [p for task in bench.TASKS for p in bench.task_prompts(model, task, args.pictures, args.samples, 0)]
    print(f"{len(prompts)} prompts ({', '.join(bench.TASKS)}), {args.pictures} pictures each")
    print("| method | budget | mean slots per picture (1 ... last) | some picture at 0 | fewest | most |\n|---|---|---|---|---|---|")
    results = []
    for spec, (name, options) in zip(args.methods, specs):
        for budget in args.budgets:
            method = get_method(name, budget=budget, **options)
            counts = []
            for start in range(0, len(prompts), 4):
                ids, mask, pixels = harness.batch_inputs(model, prompts[start:start + 4])
                counts.append(analysis.kept_per_picture(model, ids, pixels, mask, method)[..., :args.pictures])
            kept = np.concatenate(counts, axis=1)  # [N, rows, Hkv, P]
            row = {"method": spec, "budget": budget, "per_picture": kept.mean((0, 1, 2)).round(2).tolist(),
                   "some_picture_at_zero": float((kept.min(-1) == 0).mean()), "fewest": float(kept.min(-1).mean()),
                   "most": float(kept.max(-1).mean())}
            results.append(row)
            print(f"| {spec} | {budget:g} | {' / '.join(f'{x:.1f}' for x in row['per_picture'])} | "
                  f"{row['some_picture_at_zero']:.2f} | {row['fewest']:.1f} | {row['most']:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pictures": args.pictures, "samples_per_task": args.samples, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
