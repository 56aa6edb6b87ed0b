"""Which image tokens a small cache needs: the methods against two selections made by hand (issue 30).

    python bench/kept_selection.py [--budget 0.2] [--pictures 8] [--samples 30] [--seed 1] [--json PATH]

On `lookm eval scenes` prompts (demo model, the question asked after compression, greedy), each
prompt is answered from:
  * the full cache, and each of --methods at --budget (their own selection, per layer and KV head);
  * "text + random image": every text token and image tokens drawn uniformly (one draw per prompt,
    the same in every layer and head) up to --budget of the prompt, the full cache's other slots emptied;
  * "text + object patches": every text token and the image tokens of patches an object covers by
    `data.READ_COVERAGE` or more (from the scenes' geometry), whatever fraction of the prompt that is.
Prints accuracy per task and over all, the kept share of the prompt, and each config minus the first
method, paired over the same prompts (+- the standard error of the differences). The default seed is
the held-out one: diagnostics, not the reported cells.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

from bench_args import at_least, json_path, kept_fraction
from lookm_jax.cli_args import seed_arg

TASKS = ("picture_colour", "picture_shape", "picture_position", "describe")
RANDOM, OBJECTS = "text + random image", "text + object patches"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=kept_fraction, default=0.2, help="kept fraction of the prompt")
    parser.add_argument("--pictures", type=int, default=8, help="pictures per prompt, in [2, 16]")
    parser.add_argument("--samples", type=at_least(2), default=30, help="prompts per task")
    parser.add_argument("--seed", type=seed_arg, default=1, help="bench seed (1: the held-out one)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--methods", nargs="+", default=["lookm_quota", "h2o", "adakv"],
                        help="method specs, as `lookm eval` takes them")
    parser.add_argument("--json", metavar="PATH", type=json_path, help="also write every row and figure to PATH")
    args = parser.parse_args()
    from lookm_jax import scenes

    if not 2 <= args.pictures < len(scenes.NUMBERS):
        parser.error(f"--pictures must be in [2, {len(scenes.NUMBERS) - 1}], got {args.pictures}")

    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    import lookm_jax
    from lookm_jax import get_method
    from lookm_jax.eval import harness, scenes as bench
    from lookm_jax.train.data import READ_COVERAGE

    try:  # a bad spec is refused here, before the model loads
        methods = {"full": get_method("full"), **{spec: get_method(name, budget=args.budget, **options)
                                                  for spec in args.methods for name, options in [harness.parse_spec(spec)]}}
    except ValueError as err:
        parser.error(f"--methods: {err}")
    model = lookm_jax.load_default()
    size, per_picture = model.config.pixel_shape[-1], model.config.image_seq_length
    grid = math.isqrt(per_picture)
    rng = np.random.default_rng(args.seed)
    rows = []
    for task in args.tasks:
        prompts = bench.task_prompts(model, task, args.pictures, args.samples, args.seed, bench.ASKED[1])
        for i, prompt in enumerate(tqdm(prompts, desc=task, unit="prompt")):
            ids, mask, after = harness.encode_asked_after(model, [prompt])
            question = after[:, after[0] >= 0]
            length = int(mask.sum())
            image = np.flatnonzero(ids[0] == model.config.image_token_id)  # [pictures x per_picture]
            drawn = bench.task_sample(task, args.pictures, args.seed, i).scenes  # the pictures of `prompt`
            covered = np.concatenate([scenes.patch_coverage(s, size, size // grid)[1:].max(0) for s in drawn])
            keep_random = max(0, round(args.budget * length) - (length - len(image)))
            hand_picked = {RANDOM: rng.choice(len(image), keep_random, replace=False),
                           OBJECTS: np.flatnonzero(covered >= READ_COVERAGE)}

            def correct(ctx) -> bool:
                answer = model.ask(ctx, question, max_new_tokens=16)
                return bench.is_correct(prompt.answer, model.decode_text(answer.tokens[0][:answer.lengths[0]]))

            row = {"task": task, "sample": i, "prompt_tokens": length}
            for name, method in methods.items():
                ctx = model.prefill_context(ids, prompt.pixel_values, mask, method=method)
                row[name] = correct(ctx)
                if name == "full":
                    full = ctx
            for name, kept in hand_picked.items():
                emptied = jnp.asarray(np.delete(image, kept))
                positions = tuple(jnp.where(jnp.isin(p, emptied), -1, p) for p in full.cache.layer_positions)
                row[name] = correct(dataclasses.replace(full, cache=full.cache.replace(layer_positions=positions)))
                row[name + " kept"] = (length - len(image) + len(kept)) / length
            rows.append(row)

    configs = [*methods, RANDOM, OBJECTS]
    kept = {c: args.budget for c in args.methods} | {"full": 1.0} | {
        c: float(np.mean([r[c + " kept"] for r in rows])) for c in (RANDOM, OBJECTS)}
    accuracy = {c: {t: float(np.mean([r[c] for r in rows if r["task"] == t])) for t in args.tasks} |
                {"all": float(np.mean([r[c] for r in rows]))} for c in configs}
    base = args.methods[0]
    paired = {}
    for c in configs:
        d = np.asarray([r[c] - r[base] for r in rows], float)
        paired[c] = (float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d))))
    print(f"\n{args.pictures} pictures, seed {args.seed}, {args.samples} prompts a task, budget {args.budget:g}")
    print(f"| config | kept | {' | '.join(args.tasks)} | all | minus {base} |")
    print("|---|---|" + "---|" * (len(args.tasks) + 2))
    for c in configs:
        cells = " | ".join(f"{accuracy[c][t]:.2f}" for t in args.tasks)
        print(f"| {c} | {kept[c]:.2f} | {cells} | {accuracy[c]['all']:.2f} | {paired[c][0]:+.3f} +- {paired[c][1]:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "kept": kept, "accuracy": accuracy, "paired": paired, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
