"""Questions whose answers are in the pictures (`lookm eval scenes`), and the tower's held-out accuracy.

The benchmark asks MileBench-style multi-picture prompts ("Picture k: <image>" before each of the
pictures, the question last) drawn from the "bench" split of `lookm_jax.scenes`, one task at a
time: the colour, the shape or the side of the object in picture k, picture k described in words,
which picture shows a colour-shape pair, how many pictures show a shape, and the magic-number needle
of `lookm eval needle` hidden in text between real scene pictures. Image tokens are >= 75% of every
prompt. It runs on the sweep harness (`lookm_jax.eval.harness`): one prefill per batch, resumable
JSONL, `--report-only`, the CSV of `lookm plot sweep`.

`single_picture_accuracy` is the trained tower's check: held-out single-picture questions, greedy,
full cache, scored on the first word of the answer.
"""

from __future__ import annotations

import os
import re

import numpy as np

from lookm_jax import scenes
from lookm_jax.cli_args import path_arg, seed_arg
from lookm_jax.eval import harness, needle
from lookm_jax.eval.jsonl import Field

TASKS = scenes.PICTURE_KINDS + ("needle",)
KEY_FIELDS = ("seed", "pictures", "task", "asked", "sample")
# Where a sample's question is: in the prompt (its first answer token then comes from the prefill's
# logits, computed before compression) or after compression (fed through the compressed cache).
ASKED = ("in prompt", "after compression")
# Which bench samples a picture task asks: all of them, or only those whose pictures show no
# colour-shape pair the training split never showed (`scenes.HELD_OUT`, the green triangle, in about
# half the samples of 8 pictures): the model's own skill apart from generalising to an unseen pair,
# which the "combination" split reports. "trained" takes the first n such samples of the same stream.
PAIRS = ("all", "trained")
KEY_DEFAULTS = {"asked": ASKED[0]}  # rows written before the field asked in the prompt
ROW_SCHEMA = {**harness.ROW_SCHEMA, "pictures": Field(int, 0), "task": Field(str),
              "asked": Field(str, choices=ASKED, optional=True)}  # absent: KEY_DEFAULTS
NEEDLE_IMAGE_FRACTION = 0.75
_NEEDLE_STREAM = 2 * 10**6  # the needle task's pictures: apart from the multi-picture samples' streams


def first_word(text: str) -> str:
    """'Red.' -> 'red'; 'Picture 3.' -> 'picture 3' (the answer forms of `scenes.answer_text`)."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    if words[:1] == ["picture"]:
        return " ".join(words[:2])
    return words[0] if words else ""


def described(answer: str, output: str) -> bool:
    """A "describe" answer ("a red circle at the top left") is right when the output's first colour
    word and first shape word are the picture's (where it is, is not scored)."""
    words = re.findall(r"[a-z]+", output.lower())
    first = lambda options: next((w for w in words if w in options), None)  # noqa: E731
    _, colour, shape = answer.split()[:3]
    return first(scenes.COLOURS) == colour and first(scenes.SHAPES) == shape


def counted(answer: str, output: str) -> bool:
    """A count ("three") is right when it is the last number word of the output's first sentence outside
    parentheses, so that an answer may list what it counts first ("2,5,7: three.", `scenes.listed_count`)
    or go through the pictures with a running tally ("1 circle (zero), 2 square (one): one.",
    `scenes.tallied_count`); a tally cut before its count is no answer."""
    sentence = re.sub(r"\([^)]*\)?", "", output.lower().split(".")[0])
    numbers = [w for w in re.findall(r"[a-z]+", sentence) if w in scenes.NUMBERS]
    return bool(numbers) and numbers[-1] == answer


def is_correct(answer: str, output: str) -> bool:
    """A needle's 4 digits as a whole number (`needle.is_correct`); a description by its colour and
    shape (`described`); a count by its last number word (`counted`); any other scene answer as the
    first word."""
    if answer.isdigit():
        return needle.is_correct(answer, output)
    if answer.startswith("a "):
        return described(answer, output)
    if answer in scenes.NUMBERS:
        return counted(answer, output)
    return first_word(output) == answer


def task_sample(task: str, pictures: int, seed: int, index: int) -> scenes.MultiSample:
    """Sample `index` of a picture task (not the needle) as the benchmark draws it: `pictures` pictures
    from the bench split and one question of `task`."""
    return scenes.multi_picture_sample("bench", seed, index, pictures, turns=1, kinds=(task,))


def sample_indices(task: str, pictures: int, n: int, seed: int, pairs: str = PAIRS[0]) -> list[int]:
    """The bench indices of n samples of `task` (`PAIRS`): 0 .. n-1, or the first n whose pictures show
    only trained pairs. The needle's pictures are never asked about: its samples are 0 .. n-1 either way."""
    if pairs not in PAIRS:
        raise ValueError(f"pairs must be one of {PAIRS}, got {pairs!r}")
    if pairs == PAIRS[0] or task == "needle":
        return list(range(n))
    out, index = [], 0
    while len(out) < n:  # a sample of 16 pictures holds no held-out pair about a quarter of the time
        if not task_sample(task, pictures, seed, index).shows(scenes.HELD_OUT):
            out.append(index)
        index += 1
    return out


def task_prompts(model, task: str, pictures: int, n: int, seed: int, asked: str = ASKED[0],
                 pairs: str = PAIRS[0]) -> list[harness.Prompt]:
    """n samples of `task` with `pictures` pictures each, from the bench split (`sample_indices`), the
    question `asked` in the prompt or after compression (prefilled onto the compressed cache)."""
    if asked not in ASKED:
        raise ValueError(f"asked must be one of {ASKED}, got {asked!r}")
    size = model.config.pixel_shape[-1]
    out = []
    if task == "needle":
        samples = _needle_samples(model, pictures, n, seed)
        if samples is None:
            least = next((p for p in range(pictures + 1, len(scenes.NUMBERS)) if _needle_samples(model, p, 1, seed)),
                         None)
            raise ValueError(f"the needle task needs --pictures >= {least}, got {pictures} (its text is the "
                             f"other {1 - NEEDLE_IMAGE_FRACTION:.0%} of the prompt)")
        for i, s in enumerate(samples):
            assert s.num_images == pictures, (s.num_images, pictures)
            drawn = [scenes.random_scene(scenes.split_rng("bench", seed, _NEEDLE_STREAM + i * pictures + k), "bench")
                     for k in range(s.num_images)]
            pixels, _ = model.preprocess_images([scenes.render(d, size) for d in drawn])
            text, after = (s.prompt, "") if asked == ASKED[0] else (s.prompt.removesuffix(s.question), s.question)
            out.append(harness.Prompt(_key(seed, pictures, task, asked, i), text, s.answer, pixels,
                                      {"depth": s.depth}, after=after))
        return out
    for i in sample_indices(task, pictures, n, seed, pairs):
        sample = task_sample(task, pictures, seed, i)
        question = sample.questions[0]
        pixels, _ = model.preprocess_images([scenes.render(s, size) for s in sample.scenes])
        text = sample.prompt(question)
        if asked == ASKED[1]:  # the pictures (and markers) prefilled and compressed; the question after
            out.append(harness.Prompt(_key(seed, pictures, task, asked, i), text.removesuffix(question.text),
                                      question.answer, pixels, after=question.text))
        else:
            out.append(harness.Prompt(_key(seed, pictures, task, asked, i), text, question.answer, pixels))
    return out


def _needle_samples(model, pictures: int, n: int, seed: int) -> list | None:
    """n needle samples with `pictures` pictures at NEEDLE_IMAGE_FRACTION, or None if too few fit the text."""
    per_image = model.config.image_seq_length
    length = round(pictures * per_image / NEEDLE_IMAGE_FRACTION)
    try:
        return needle.make_samples(model.tokenizer, length, n, seed, image_seq_length=per_image,
                                   image_fraction=NEEDLE_IMAGE_FRACTION)
    except ValueError:  # the haystack's text does not fit beside the pictures
        return None


def _key(seed: int, pictures: int, task: str, asked: str, sample: int) -> dict:
    return {"seed": seed, "pictures": pictures, "task": task, "asked": asked, "sample": sample}


def answer_tokens(task: str, pictures: int) -> int:
    """Greedy tokens a run (sweep or calibration) gives an answer of `task` by default: 24 (a word, a
    description, the needle's sentence of ~12), and for a count 8 per picture + 8, room for one answered
    picture by picture (the longest `scenes.tallied_count` is 49 tokens at 8 pictures, 107 at 16, with
    the demo's tokenizer)."""
    return 8 * pictures + 8 if task == "count_pictures" else 24


def run_benchmark(model, configs: list[harness.SweepConfig], tasks, pictures, n: int, seed: int, jsonl_path: str,
                  *, batch_size: int = 4, max_new_tokens: int | None = None, max_decode_rows: int = 16,
                  asked: str = ASKED[0], pairs: str = PAIRS[0], log=print) -> list[dict]:
    """Every task at every picture count, n samples each, answered by every config; rows appended
    to `jsonl_path` and resumed (`harness.run_prompts`). Each answer gets `max_new_tokens` greedy
    tokens, or by default its task's `answer_tokens`; rows do not record it, so resume a JSONL only with
    the token limits it was written with. Returns the rows of these settings."""
    batches, token_limits = [], []
    for count in pictures:
        for task in tasks:
            prompts = task_prompts(model, task, count, n, seed, asked, pairs)
            chunks = [prompts[i:i + batch_size] for i in range(0, n, batch_size)]
            limit = answer_tokens(task, count) if max_new_tokens is None else max_new_tokens
            batches += chunks
            token_limits += [limit] * len(chunks)
    harness.run_prompts(model, configs, batches, jsonl_path, KEY_FIELDS, is_correct, schema=ROW_SCHEMA,
                        max_new_tokens=token_limits, max_decode_rows=max_decode_rows, key_defaults=KEY_DEFAULTS,
                        log=log)
    return select_rows(harness.read_rows(jsonl_path, ROW_SCHEMA), configs, tasks, pictures, n, seed, asked, pairs)


def select_rows(rows: list[dict], configs, tasks, pictures, n: int, seed: int, asked: str = ASKED[0],
                pairs: str = PAIRS[0]) -> list[dict]:
    """The rows of these settings: the samples `sample_indices` names for each task and picture count."""
    indices = {(task, count): set(sample_indices(task, count, n, seed, pairs)) for task in tasks for count in pictures}
    return harness.unique_rows(rows, KEY_FIELDS, configs, lambda r: (
        r["seed"] == seed and r["sample"] in indices.get((r["task"], r["pictures"]), ())
        and r.get("asked", KEY_DEFAULTS["asked"]) == asked), KEY_DEFAULTS)


def summarize(rows: list[dict]) -> list[dict]:
    """The sweep CSV's rows over all tasks; its length column is the longest prompt of each
    picture count (one plot panel per picture count)."""
    longest: dict[int, int] = {}
    for r in rows:
        longest[r["pictures"]] = max(longest.get(r["pictures"], 0), r["prompt_tokens"])
    return harness.summarize(rows, length=lambda r: longest[r["pictures"]])


def format_tasks(rows: list[dict]) -> str:
    """Accuracy per config (rows) and task (columns), over every budget and picture count."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    configs = list(dict.fromkeys((r["label"], r["budget"]) for r in rows))
    cells: dict[tuple, list[bool]] = {}
    for r in rows:
        cells.setdefault((r["label"], r["budget"], r["task"]), []).append(r["correct"])
    lines = ["| config | budget | " + " | ".join(tasks) + " | all |", "|" + "---|" * (len(tasks) + 3)]
    for label, budget in configs:
        values = [cells.get((label, budget, t), []) for t in tasks]
        every = [c for v in values for c in v]
        lines.append(f"| {label} | {budget:g} | " + " | ".join(f"{np.mean(v):.2f}" if v else "" for v in values)
                     + f" | {np.mean(every):.2f} |")
    return "\n".join(lines)


def paired_differences(rows: list[dict], label: str) -> list[dict]:
    """`label`'s accuracy minus every other config's at the same budget (the full cache's at every
    budget), over the samples both answered (the same prompts: a paired difference), per task and over
    all tasks: [{"label", "budget", "task" ("all" for every task), "samples", "difference",
    "standard_error"}]."""
    by_config: dict[tuple, dict[tuple, bool]] = {}
    full = set()
    for r in rows:
        by_config.setdefault((r["label"], r["budget"]), {})[
            (r["seed"], r["pictures"], r["task"], r["sample"])] = r["correct"]
        if r["method"] == "full":
            full.add(r["label"])
    out = []
    for budget in dict.fromkeys(b for lab, b in by_config if lab == label):
        mine = by_config[(label, budget)]
        for (other, other_budget), answers in by_config.items():
            if other == label or (other_budget != budget and other not in full):
                continue
            keys = sorted(mine.keys() & answers.keys())
            for task in ["all", *dict.fromkeys(k[2] for k in keys)]:
                diff = np.array([float(mine[k]) - float(answers[k]) for k in keys if task in ("all", k[2])])
                out.append({"label": other, "budget": budget, "task": task, "samples": len(diff),
                            "difference": float(diff.mean()), "standard_error":
                                float(diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else float("nan")})
    return out


def format_differences(differences: list[dict], label: str) -> str:
    """A markdown table per budget: `label` minus each config, difference +- its standard error, per
    task and over all; a cell below zero by more than its standard error is marked with *."""
    tasks = list(dict.fromkeys(d["task"] for d in differences if d["task"] != "all")) + ["all"]
    lines = [f"| {label} minus | budget | " + " | ".join(tasks) + " |", "|" + "---|" * (len(tasks) + 2)]
    cells = {(d["label"], d["budget"], d["task"]): d for d in differences}
    for other, budget in dict.fromkeys((d["label"], d["budget"]) for d in differences):
        values = []
        for task in tasks:
            d = cells.get((other, budget, task))
            below = d is not None and d["difference"] < -d["standard_error"]
            values.append("" if d is None else f"{d['difference']:+.2f} ± {d['standard_error']:.2f}{' *' if below else ''}")
        lines.append(f"| {other} | {budget:g} | " + " | ".join(values) + " |")
    return "\n".join(lines)


# ---- the tower's held-out check -------------------------------------------------------------------

def held_out_questions(split: str, n: int, seed: int = 0, pairs: str = PAIRS[0]) -> list[tuple[scenes.Scene, scenes.Question]]:
    """n questions of a split; the held-out split cycles through the four kinds evenly, over every
    scene or (`pairs` "trained") only over scenes without the held-out pair (`PAIRS`)."""
    if pairs not in PAIRS:
        raise ValueError(f"pairs must be one of {PAIRS}, got {pairs!r}")
    if split == "combination":
        if pairs != PAIRS[0]:
            raise ValueError("the combination split shows the held-out pair in every scene: ask it with pairs 'all'")
        return [(s.scene, s.questions[0]) for s in scenes.single_picture_samples(split, seed, n)]
    out, index = [], 0
    while len(out) < n:
        sample = scenes.single_picture_sample(split, seed, index, kind=scenes.KINDS[len(out) % len(scenes.KINDS)])
        index += 1
        if pairs == PAIRS[0] or not sample.scene.shows(scenes.HELD_OUT):
            out.append((sample.scene, sample.questions[0]))
    return out


def ask(model, pictures: list | None, prompts: list[str], batch_size: int = 12, max_new_tokens: int = 6) -> list[str]:
    """Greedy answers, full cache, to prompts with one scene picture each, or text only when
    `pictures` is None (prompts padded into batches)."""
    answers = []
    for start in range(0, len(prompts), batch_size):
        chunk = range(start, min(start + batch_size, len(prompts)))
        ids, mask = harness.encode_batch(model, [prompts[i] for i in chunk], num_images=int(pictures is not None))
        pixels = None
        if pictures is not None:
            size = model.config.pixel_shape[-1]
            pixels, _ = model.preprocess_images([scenes.render(pictures[i], size) for i in chunk])
        tokens = model.generate(ids, pixels, mask, max_new_tokens=max_new_tokens)
        answers += [model.decode_text(t) for t in tokens]
    return answers


def single_picture_accuracy(model, split: str = "heldout", n: int = 60, seed: int = 0, pairs: str = PAIRS[0]) -> dict:
    """{"accuracy", "by_kind": {kind: accuracy}, "by_objects": {objects in the picture: accuracy},
    "binding": accuracy of the colour, shape and position questions about one object of several (None
    without one), "rows": [(question, answer, output)]}. A model that reads a picture's objects but
    not which is which answers single objects right and "binding" near what answering about a random
    object of the picture gives (1/2 or 1/3 for colour and shape; 0.46 over the first 600 held-out)."""
    items = held_out_questions(split, n, seed, pairs)
    outputs = ask(model, [s for s, _ in items], [q.text for _, q in items])
    correct = [first_word(o) == q.answer for (_, q), o in zip(items, outputs)]

    def mean_by(key) -> dict:
        groups: dict = {}
        for (scene, q), c in zip(items, correct):
            groups.setdefault(key(scene, q), []).append(c)
        return {k: float(np.mean(v)) for k, v in sorted(groups.items())}

    several = [c for (scene, q), c in zip(items, correct) if q.kind != "count" and len(scene.objects) > 1]
    return {"accuracy": float(np.mean(correct)), "by_kind": mean_by(lambda _, q: q.kind),
            "by_objects": mean_by(lambda scene, _: len(scene.objects)),
            "binding": float(np.mean(several)) if several else None,
            "rows": [(q.text, q.answer, o) for (_, q), o in zip(items, outputs)]}


# ---- the command ----------------------------------------------------------------------------------

def add_parser(subparsers) -> None:
    p = subparsers.add_parser("scenes", help="multi-picture questions whose answers are in the pictures (demo model)")
    p.add_argument("mode", choices=("calibrate", "sweep"),
                   help="calibrate: the full cache only, accuracy per task; sweep: every config")
    p.add_argument("--model", type=path_arg, help="model folder or .gguf (default: the embedded SmolLM2 demo model)")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS), help="tasks to ask")
    p.add_argument("--pictures", type=int, nargs="+", default=[8],
                   help=f"pictures per prompt, each in [2, {len(scenes.NUMBERS) - 1}]")
    p.add_argument("--samples", type=int, default=52,
                   help="samples per task and picture count (a multiple of --batch-size compiles once)")
    p.add_argument("--budgets", type=float, nargs="+",
                   help=f"kept fractions of the prompt to sweep, each in (0, 1] (default: {' '.join(map(str, harness.DEFAULT_BUDGETS))})")
    p.add_argument("--methods", nargs="+", help="methods to sweep (default: all; lookm = its 8 variants; with options: "
                   "\"lookm:image_quota=proportional,merge_scope=same_modality\", weights as 1/2/3)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the bench split's pictures and questions")
    p.add_argument("--pairs", choices=PAIRS, default=PAIRS[0],
                   help="all: bench samples 0 .. N-1; trained: the first N whose pictures show no colour-shape pair "
                        "the training never showed (the green triangle, in about half the samples of 8 pictures; "
                        "the needle's samples are the same either way)")
    p.add_argument("--batch-size", type=int, default=4, help="samples prefilled together")
    p.add_argument("--max-new-tokens", type=int,
                   help="greedy tokens per answer; fidelity compares all of them, the filler after an answer's end "
                        "included (default: 24, the needle's sentence takes ~12; a count 8 per picture + 8, room for "
                        "one answered picture by picture, `scenes.tallied_count`)")
    p.add_argument("--max-decode-rows", type=int, default=16, help="rows per shared decode call")
    p.add_argument("--jsonl", type=path_arg, help="per-sample rows, appended and resumed (default: results/scenes/MODE.jsonl)")
    p.add_argument("--output", type=path_arg, help="summary CSV in the `lookm plot sweep` format (default: docs/scenes_MODE.csv, "
                                    "docs/scenes_MODE_after.csv with --ask-after-compression)")
    p.add_argument("--ask-after-compression", action="store_true",
                   help="prefill and compress the pictures (and the needle's haystack), then prefill the question "
                        "onto the compressed cache (default: the question is in the prompt, so the first answer "
                        "token comes from the prefill, before compression)")
    p.add_argument("--report-only", action="store_true",
                   help="summarise the rows already in the JSONL (e.g. of an interrupted run); run nothing")
    p.add_argument("--compare", metavar="LABEL",
                   help="also print LABEL's accuracy minus every other config's at each budget, per task, with the "
                        "paired standard error (e.g. \"LOOK-M + image quota\", a label of the tables)")
    p.set_defaults(func=cmd_scenes)


def cmd_scenes(args) -> int:
    import lookm_jax
    from lookm_jax.compression.methods import METHODS

    asked = ASKED[1] if args.ask_after_compression else ASKED[0]
    jsonl = args.jsonl or os.path.join("results", "scenes", f"{args.mode}.jsonl")
    suffix = ("_after" if asked == ASKED[1] else "") + ("_trained" if args.pairs == "trained" else "")
    output = args.output or os.path.join("docs", f"scenes_{args.mode}{suffix}.csv")
    if args.samples < 1 or args.batch_size < 1 or (args.max_new_tokens is not None and args.max_new_tokens < 1):
        raise ValueError(f"need --samples, --batch-size and --max-new-tokens >= 1, got {args.samples}, "
                         f"{args.batch_size}, {args.max_new_tokens}")
    harness.check_run_arguments(args, jsonl, output)
    bad = [p for p in args.pictures if not 2 <= p < len(scenes.NUMBERS)]
    if bad:
        raise ValueError(f"--pictures must each be in [2, {len(scenes.NUMBERS) - 1}], got {bad}")
    configs = harness.sweep_configs(["full"] if args.mode == "calibrate" else (args.methods or METHODS),
                                    args.budgets or harness.DEFAULT_BUDGETS)
    labels = sorted({c.label for c in configs})
    if args.compare is not None and args.compare not in labels:
        raise ValueError(f"--compare {args.compare!r} is none of the configs' labels: {labels}")
    print(f"scenes {args.mode}: {len(configs)} configs x tasks {' '.join(args.tasks)} x pictures {args.pictures} x "
          f"{args.samples} samples ({args.pairs} pairs), seed {args.seed}, load average {harness.load_average()}",
          flush=True)
    if args.report_only:
        rows = select_rows(harness.read_rows(jsonl, ROW_SCHEMA), configs, args.tasks, args.pictures, args.samples,
                           args.seed, asked, args.pairs)
        if not rows:
            raise ValueError(f"{jsonl} holds no rows for these settings")
        asked_for = len(configs) * len(args.pictures) * len(args.tasks) * args.samples
        if len(rows) < asked_for:
            print(f"{jsonl} holds {len(rows)} of the {asked_for} rows these settings ask for: summarising those",
                  flush=True)
    else:
        model = lookm_jax.load(args.model) if args.model else lookm_jax.load_default()
        harness.check_multimodal(model, "the scenes benchmark")
        rows = run_benchmark(model, configs, args.tasks, args.pictures, args.samples, args.seed, jsonl,
                             batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                             max_decode_rows=args.max_decode_rows, asked=asked, pairs=args.pairs,
                             log=lambda s: print(s, flush=True))
    table, tasks = summarize(rows), format_tasks(rows)  # both before the CSV: a bad row writes nothing
    harness.write_csv(output, table)
    print("accuracy per task\n" + tasks)
    if args.mode == "sweep":
        print("\naccuracy, all tasks\n" + harness.format_table(table) + "\n\nfidelity (greedy tokens equal to the "
              "full cache's)\n" + harness.format_table(table, "fidelity"))
    if args.compare is not None:
        print(f"\n{args.compare} minus each config (paired over the same questions; * below by more than one "
              f"standard error)\n" + format_differences(paired_differences(rows, args.compare), args.compare))
    print(f"rows: {jsonl}; table: {output}; load average {harness.load_average()}")
    return 0
