"""Which picture a compressed cache forgets: scenes-sweep accuracy split by the picture a question names.

    python bench/accuracy_by_picture.py --jsonl ROWS.jsonl [--budgets 0.05 0.2] [--labels ...] [--json PATH]

Reads the rows of `lookm eval scenes sweep` (any seed, any number of pictures; no model is loaded) and,
for the tasks that ask about picture k (colour, shape, position, describe), prints each config's accuracy
on the questions about picture 1, 2, ..., with their counts. The picture a row asked about is redrawn
from the row's seed and sample (`lookm_jax.eval.scenes.task_sample`, as the sweep drew it). Accumulated
attention favours early tokens, so a method that ranks by it can keep the first pictures and lose the
middle ones (`bench/picture_coverage.py` counts the slots).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os

from bench_args import json_path, kept_fraction

TASKS = ("picture_colour", "picture_shape", "picture_position", "describe")


@functools.cache
def subject(seed: int, sample: int, pictures: int, task: str) -> int:
    """The 0-based picture the sweep's question `sample` of `task` names."""
    from lookm_jax.eval import scenes as bench

    return bench.task_sample(task, pictures, seed, sample).questions[0].subject


def by_picture(rows: list[dict]) -> dict[tuple[str, float, int], list[bool]]:
    """(label, budget, pictures) -> [picture] lists of correct flags, for the picture-k tasks' rows."""
    out: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in rows:
        if r["task"] in TASKS:
            out[r["label"], r["budget"], r["pictures"]][subject(r["seed"], r["sample"], r["pictures"], r["task"])].append(
                r["correct"])
    return {key: [flags[k] for k in range(key[2])] for key, flags in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jsonl", required=True, help="rows of `lookm eval scenes sweep` (its --jsonl)")
    parser.add_argument("--budgets", type=kept_fraction, nargs="+", help="only these budgets (default: all)")
    parser.add_argument("--labels", nargs="+", help="only these configs' labels (default: all)")
    parser.add_argument("--json", metavar="PATH", type=json_path, help="also write every figure to PATH")
    args = parser.parse_args()
    from lookm_jax.eval import scenes as bench

    if not os.path.isfile(args.jsonl):
        parser.error(f"--jsonl: no such file {args.jsonl!r}")
    try:
        rows = bench.harness.read_rows(args.jsonl, bench.ROW_SCHEMA)
    except (OSError, ValueError) as error:
        parser.error(f"--jsonl: {error}")
    rows = [r for r in rows if r["label"] == "full" or ((args.budgets is None or r["budget"] in args.budgets)
                                                       and (args.labels is None or r["label"] in args.labels))]
    table = by_picture(rows)
    if not table:
        parser.error(f"{args.jsonl} holds no rows of {', '.join(TASKS)} for these budgets and labels")
    widest = max(k[2] for k in table)
    print("| config | budget | pictures | " + " | ".join(f"picture {k + 1}" for k in range(widest)) + " |")
    print("|---|---|---|" + "---|" * widest)
    for (label, budget, pictures), flags in sorted(table.items(), key=lambda kv: (kv[0][2], kv[0][0] != "full",
                                                                                    kv[0][1], kv[0][0])):
        cells = [f"{sum(f) / len(f):.2f} ({len(f)})" if f else "-" for f in flags]
        print(f"| {label} | {budget:g} | {pictures} | " + " | ".join(cells + [""] * (widest - pictures)) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"label": label, "budget": budget, "pictures": pictures,
                        "accuracy": [sum(x) / len(x) if x else None for x in flags], "questions": [len(x) for x in flags]}
                       for (label, budget, pictures), flags in table.items()], f, indent=1)


if __name__ == "__main__":
    main()
