"""Offline multimodal needle-in-a-haystack benchmark (`lookm eval needle`).

A haystack of generated text passages with images between them (MileBench-style interleaving, image
tokens >= 70% of the prompt) hides one RULER-style text needle, "The special magic number for
<word> is <4 digits>.", at a chosen depth; the question comes last. A generated answer counts as
correct when the needle's 4 digits appear in it as a whole number (not inside a longer digit run).
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np

from lookm_jax.cli_args import DEFAULT_IMAGES, path_arg, seed_arg
from lookm_jax.errors import InputError
from lookm_jax.eval import harness
from lookm_jax.eval.harness import (DEFAULT_BUDGETS, SweepConfig, format_table, read_rows, summarize,
                                    sweep_configs, write_csv)
from lookm_jax.eval.jsonl import Field
from lookm_jax.generate import LONG_BUCKETS
from lookm_jax.models.processors import IMAGE_MARKER

# SmolLM2's chat template with its default system prompt adds 30 tokens around the user turn.
CHAT_TEMPLATE_TOKENS = 30
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_IMAGE_FRACTION = 0.75  # share of the prompt's tokens in images
LONGEST_LENGTH = max(LONG_BUCKETS)  # the largest prompt bucket there is
QUESTION = "What is the special magic number for {word}? Answer with the number only."
NEEDLE = "The special magic number for {word} is {number}."

# Needle keys and haystack vocabulary. The haystack's sentences are drawn from these lists, so
# they never mention numbers or the needle's phrasing.
NEEDLE_WORDS = (
    "apple", "anchor", "badger", "banjo", "beacon", "blossom", "bridge", "cactus", "canyon", "castle",
    "cedar", "comet", "compass", "coral", "cricket", "dolphin", "dragon", "ember", "falcon", "fern",
    "garnet", "glacier", "harbor", "hazel", "helmet", "island", "jasmine", "kettle", "lantern", "lemon",
    "lotus", "magnet", "maple", "meadow", "meteor", "nectar", "oasis", "orchid", "otter", "panther",
    "pebble", "pepper", "pilgrim", "quartz", "raven", "saddle", "sapphire", "thistle", "tulip", "walnut",
)
_SUBJECTS = ("the farmer", "an old sailor", "the village baker", "a young painter", "the librarian",
             "my neighbor", "the river guide", "a tired traveler", "the school teacher", "the night guard",
             "a quiet student", "the market seller", "the gardener", "a curious child", "the ferry captain")
_VERBS = ("carried", "painted", "repaired", "found", "described", "cleaned", "remembered", "followed",
          "watched", "sketched", "collected", "admired", "measured", "ignored", "discovered")
_OBJECTS = ("a wooden boat", "the broken fence", "a basket of pears", "the stone wall", "an empty jar",
            "the narrow path", "a faded map", "the copper bell", "a pile of leaves", "the long table",
            "a silver spoon", "the hanging lamp", "a woolen scarf", "the garden gate", "a clay pot")
_PLACES = ("near the harbor", "behind the mill", "at the edge of town", "under the bridge", "in the valley",
           "beside the well", "on the hill", "in the old square", "along the coast", "inside the barn",
           "past the orchard", "by the lake", "in the quiet street", "at the station", "near the forest")
_TIMES = ("early in the morning", "before the rain", "after dinner", "during the festival", "at noon",
          "late at night", "in the spring", "on a windy day", "after the storm", "before sunrise")


@dataclasses.dataclass(frozen=True)
class NeedleSample:
    context: str  # haystack passages with the needle sentence inside; "<image>" markers between passages
    question: str  # "What is the special magic number for <word>? ..."
    answer: str  # the 4 digits
    depth: float  # nominal needle position as a fraction of the context (tokens, images included)
    num_images: int

    @property
    def prompt(self) -> str:
        """The user turn: context, then the question last."""
        return f"{self.context}\n\n{self.question}"


def _sentence(rng: np.random.Generator) -> str:
    parts = [rng.choice(lst) for lst in (_SUBJECTS, _VERBS, _OBJECTS, _PLACES, _TIMES)]
    return f"{parts[0][0].upper()}{parts[0][1:]} {parts[1]} {parts[2]} {parts[3]} {parts[4]}."


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def _layout(length: int, fixed_tokens: int, image_seq_length: int, image_fraction: float) -> tuple[int, int, bool]:
    """(images, haystack token budget, whether the budget gives every passage 8 tokens) of a
    `length`-token prompt whose template, question and needle take `fixed_tokens`."""
    num_images = max(1, round(image_fraction * length / image_seq_length)) if image_seq_length else 0
    image_cost = image_seq_length + 2  # the placeholders and the newlines around the marker
    text_budget = length - fixed_tokens - num_images * image_cost
    return num_images, text_budget, text_budget >= 8 * (num_images + 1)


def _fixed_tokens(tokenizer, word: str, number: str) -> int:
    """Tokens of a needle prompt besides its haystack and pictures: template, question, needle."""
    return (CHAT_TEMPLATE_TOKENS + _n_tokens(tokenizer, "\n\n" + QUESTION.format(word=word))
            + _n_tokens(tokenizer, " " + NEEDLE.format(word=word, number=number)))


def _next_length(tokenizer, start: int, image_seq_length: int, image_fraction: float) -> int | None:
    """The shortest prompt length in [start, LONGEST_LENGTH] that every needle word fits (`_layout`;
    not monotonic: one more picture can take what a longer prompt adds), or None."""
    fixed = max(_fixed_tokens(tokenizer, w, "9999") for w in NEEDLE_WORDS)  # digits are a token each
    return next((n for n in range(start, LONGEST_LENGTH + 1)
                 if _layout(n, fixed, image_seq_length, image_fraction)[2]), None)


def _build(tokenizer, rng, length, image_seq_length, image_fraction, depth) -> NeedleSample:
    word = str(rng.choice(NEEDLE_WORDS))
    number = str(rng.integers(1000, 10000))
    question = QUESTION.format(word=word)
    needle = NEEDLE.format(word=word, number=number)
    num_images, text_budget, fits = _layout(length, _fixed_tokens(tokenizer, word, number), image_seq_length,
                                            image_fraction)
    if not fits:
        fitting = _next_length(tokenizer, length, image_seq_length, image_fraction)
        raise ValueError(f"length {length} leaves {text_budget} text tokens beside {num_images} image(s) of "
                         f"{image_seq_length} tokens (image_fraction {image_fraction}), too few for a needle prompt: "
                         + (f"the next length that fits is {fitting}" if fitting else
                            f"no length up to {LONGEST_LENGTH} fits; use a smaller image_fraction"))
    sentences, costs = [], []  # haystack sentences and their token counts (with the leading space)
    while True:  # stop before the budget is exceeded, so the prompt stays inside its bucket
        sentence = _sentence(rng)
        cost = _n_tokens(tokenizer, " " + sentence)
        if sum(costs) + cost > text_budget:
            break
        sentences.append(sentence)
        costs.append(cost)
    # Passages: num_images + 1 runs of sentences of about equal token count, images between them.
    bounds = np.searchsorted(np.cumsum(costs), np.arange(1, num_images + 1) * sum(costs) / (num_images + 1))
    passages = [list(p) for p in np.split(np.asarray(sentences, dtype=object), bounds)]
    # Token offset of every sentence boundary (images included), then the one nearest the depth.
    slots, offset = [], 0  # (passage index, sentence index, token offset before it)
    cost_iter = iter(costs)
    for p, passage in enumerate(passages):
        for s in range(len(passage) + 1):
            slots.append((p, s, offset))
            if s < len(passage):
                offset += next(cost_iter)
        offset += image_seq_length if p < num_images else 0
    p, s, _ = min(slots, key=lambda slot: abs(slot[2] - depth * offset))
    passages[p].insert(s, needle)
    texts = [" ".join(passage) for passage in passages]
    context = f"\n{IMAGE_MARKER}\n".join(texts)
    return NeedleSample(context=context, question=question, answer=number, depth=depth, num_images=num_images)


def make_samples(tokenizer, length: int, n: int, seed: int, *, image_seq_length: int = 0,
                 image_fraction: float = DEFAULT_IMAGE_FRACTION, depths=DEFAULT_DEPTHS) -> list[NeedleSample]:
    """n samples whose chat-templated prompt is about `length` tokens.

    Each image counts image_seq_length tokens (0: text only, no images); images take about
    `image_fraction` of the prompt (at least one image). Sample i hides its needle at
    depths[i % len(depths)]. `tokenizer` is a tokenizers.Tokenizer (model.tokenizer).
    Deterministic in (seed, length).
    """
    if n < 1 or length < 1:
        raise ValueError(f"need n >= 1 and length >= 1, got n={n}, length={length}")
    if not 0 <= image_fraction < 1:
        raise ValueError(f"image_fraction must be in [0, 1), got {image_fraction}")
    if not depths or any(not 0 <= d <= 1 for d in depths):
        raise ValueError(f"depths must be a non-empty sequence of fractions in [0, 1], got {depths}")
    if image_seq_length < 0:
        raise ValueError(f"image_seq_length must be >= 0, got {image_seq_length}")
    rng = np.random.default_rng([seed, length])
    return [_build(tokenizer, rng, length, image_seq_length, image_fraction, float(depths[i % len(depths)]))
            for i in range(n)]


def is_correct(answer: str, generated: str) -> bool:
    """Exact match: `answer` (the needle's digits) appears in `generated` as a whole number."""
    return re.search(rf"(?<!\d){re.escape(answer)}(?!\d)", generated) is not None


# ---- the sweep ------------------------------------------------------------------------------------

KEY_FIELDS = ("seed", "images", "length", "sample")
ROW_SCHEMA = {**harness.ROW_SCHEMA, "images": Field(int, 0), "length": Field(int, 1), "depth": Field(float, 0, 1)}


def _pixel_values(model, num_images: int) -> np.ndarray | None:
    """The bundled pictures, cycled, as [num_images, 3, H, W] (the demo's bundled scenes)."""
    if num_images == 0:
        return None
    pictures, _ = model.preprocess_images(DEFAULT_IMAGES)
    return pictures[np.arange(num_images) % len(pictures)]


def run_sweep(model, configs: list[SweepConfig], lengths, n: int, seed: int, jsonl_path: str, *,
              text_only: bool = False, image_fraction: float = DEFAULT_IMAGE_FRACTION, batch_size: int = 4, max_new_tokens: int = 32,
              max_decode_rows: int = 16, first_sample: int = 0, log=print) -> list[dict]:
    """Answer n needle samples per length with every config (`harness.run_prompts`: one prefill per
    batch of `batch_size`, greedy, resumable JSONL rows). `first_sample` > 0 skips the samples before
    it (to split a sweep over processes, each with its own JSONL). Returns every row of the file for
    these settings."""
    image_seq_length = 0 if text_only else model.config.image_seq_length
    longest, context = max(model.buckets), model.text_config.max_position_embeddings
    for length in lengths:  # before any haystack is built
        if length > longest or length + max_new_tokens > context:
            raise InputError(f"--lengths {length}: the prompt must fit the largest bucket ({longest}) and, with "
                             f"--max-new-tokens {max_new_tokens}, the model's context ({context})")
    batches = []
    for length in lengths:
        samples = make_samples(model.tokenizer, length, n, seed, image_seq_length=image_seq_length,
                               image_fraction=image_fraction)
        pixels = _pixel_values(model, samples[0].num_images) if image_seq_length else None
        prompts = [harness.Prompt({"seed": seed, "images": s.num_images, "length": length, "sample": i},
                                  s.prompt, s.answer, pixels, {"depth": s.depth})
                   for i, s in enumerate(samples)]
        batches += [prompts[first:first + batch_size] for first in range(first_sample, n, batch_size)]
    harness.run_prompts(model, configs, batches, jsonl_path, KEY_FIELDS, is_correct, schema=ROW_SCHEMA,
                        max_new_tokens=max_new_tokens, max_decode_rows=max_decode_rows, log=log)
    return select_rows(read_rows(jsonl_path, ROW_SCHEMA), configs, lengths, n, seed, text_only)


def select_rows(rows: list[dict], configs: list[SweepConfig], lengths, n: int, seed: int,
                text_only: bool) -> list[dict]:
    """The rows of these settings: configs, lengths, samples 0..n-1, seed, with or without images.
    Refuses a length whose rows have different picture counts (runs with different --image-fraction
    in one JSONL), which one table would silently average."""
    selected = harness.unique_rows(rows, KEY_FIELDS, configs, lambda r: (
        r["seed"] == seed and r["length"] in lengths and (r["images"] == 0) == text_only and r["sample"] < n))
    for length in lengths:
        counts = sorted({r["images"] for r in selected if r["length"] == length})
        if len(counts) > 1:
            raise ValueError(f"rows at length {length} have {counts} pictures per prompt (runs with different "
                             f"--image-fraction share one JSONL); give each its own --jsonl")
    return selected


def format_depths(rows: list[dict]) -> str:
    """Accuracy of the full cache per (length, depth): the calibration table."""
    full = [r for r in rows if r["method"] == "full"]
    lengths = sorted({r["length"] for r in full})
    depths = sorted({r["depth"] for r in full})
    lines = ["| length | prompt tokens | " + " | ".join(f"depth {d:g}" for d in depths) + " | all |",
             "|" + "---|" * (len(depths) + 3)]
    for n in lengths:
        at = [r for r in full if r["length"] == n]
        per_depth = [[r["correct"] for r in at if r["depth"] == d] for d in depths]
        tokens = [r["prompt_tokens"] for r in at]
        lines.append(f"| {n} | {min(tokens)}-{max(tokens)} | "
                     + " | ".join(f"{sum(c)}/{len(c)}" for c in per_depth)
                     + f" | {sum(r['correct'] for r in at)}/{len(at)} ({np.mean([r['correct'] for r in at]):.0%}) |")
    return "\n".join(lines)


# ---- the command ----------------------------------------------------------------------------------

def add_parser(subparsers) -> None:
    p = subparsers.add_parser("needle", help="offline multimodal needle-in-a-haystack benchmark on the demo model")
    p.add_argument("mode", choices=("calibrate", "sweep"),
                   help="calibrate: the full cache only, accuracy per length and depth; sweep: every config")
    p.add_argument("--model", type=path_arg, help="model folder or .gguf (default: the embedded SmolLM2 demo model)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 1280],
                   help="prompt lengths in tokens (an early demo's full cache, 256 tokens a picture, answered "
                        ">= 80%% with up to 4 pictures: 1024 and 1280 at the default image fraction)")
    p.add_argument("--samples", type=int, default=52,
                   help="samples per length, each config answers all (a multiple of --batch-size compiles once)")
    p.add_argument("--budgets", type=float, nargs="+",
                   help=f"kept fractions of the prompt to sweep, each in (0, 1] (default: {' '.join(map(str, DEFAULT_BUDGETS))})")
    p.add_argument("--methods", nargs="+", help="methods to sweep (default: all; lookm = its 8 variants)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the haystacks and needles")
    p.add_argument("--batch-size", type=int, default=4, help="samples prefilled together")
    p.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens per answer")
    p.add_argument("--max-decode-rows", type=int, default=16, help="rows per shared decode call")
    p.add_argument("--text-only", action="store_true", help="no images (plain-text haystacks)")
    p.add_argument("--image-fraction", type=float,
                   help=f"share of the prompt's tokens in images, in [0, 1) (default: {DEFAULT_IMAGE_FRACTION}; not with --text-only)")
    p.add_argument("--jsonl", type=path_arg, help="per-sample rows, appended and resumed (default: results/needle/MODE.jsonl)")
    p.add_argument("--output", type=path_arg, help="summary CSV (default: docs/needle_MODE.csv)")
    p.add_argument("--first-sample", type=int, default=0,
                   help="skip the samples before this index (split a sweep over processes, one JSONL each)")
    p.add_argument("--report-only", action="store_true",
                   help="summarise the rows already in the JSONL (e.g. of an interrupted run); run nothing")
    p.set_defaults(func=cmd_needle)


def cmd_needle(args) -> int:
    import lookm_jax
    from lookm_jax.compression.methods import METHODS

    suffix = "-text" if args.text_only else ""
    jsonl = args.jsonl or os.path.join("results", "needle", f"{args.mode}{suffix}.jsonl")
    output = args.output or os.path.join("docs", f"needle_{args.mode}{suffix}.csv")
    if args.samples < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
        raise ValueError(f"need --samples, --batch-size and --max-new-tokens >= 1, got {args.samples}, "
                         f"{args.batch_size}, {args.max_new_tokens}")
    if not 0 <= args.first_sample < args.samples:
        raise ValueError(f"--first-sample must be in [0, --samples - 1] = [0, {args.samples - 1}], got {args.first_sample}")
    harness.check_run_arguments(args, jsonl, output)
    if args.text_only and args.image_fraction is not None:
        raise ValueError("--image-fraction sets the images' share of the prompt; --text-only has no images")
    image_fraction = DEFAULT_IMAGE_FRACTION if args.image_fraction is None else args.image_fraction
    configs = sweep_configs(["full"] if args.mode == "calibrate" else (args.methods or METHODS),
                            args.budgets or DEFAULT_BUDGETS)
    print(f"needle {args.mode}: {len(configs)} configs x lengths {args.lengths} x {args.samples} samples, "
          f"seed {args.seed}, load average {harness.load_average()}", flush=True)
    if args.report_only:
        rows = select_rows(read_rows(jsonl, ROW_SCHEMA), configs, args.lengths, args.samples, args.seed, args.text_only)
        if not rows:
            raise ValueError(f"{jsonl} holds no rows for these settings")
    else:
        model = lookm_jax.load(args.model) if args.model else lookm_jax.load_default()
        if not args.text_only:
            harness.check_multimodal(model, "the needle among pictures", "; pass --text-only for the text needle")
        rows = run_sweep(model, configs, args.lengths, args.samples, args.seed, jsonl, text_only=args.text_only,
                         image_fraction=image_fraction, batch_size=args.batch_size,
                         max_new_tokens=args.max_new_tokens, max_decode_rows=args.max_decode_rows,
                         first_sample=args.first_sample, log=lambda s: print(s, flush=True))
    table, depths = summarize(rows), format_depths(rows)  # both before the CSV: a bad row writes nothing
    write_csv(output, table)
    print(depths)
    if args.mode == "sweep":
        print("\naccuracy\n" + format_table(table) + "\n\nfidelity (first 32 greedy tokens equal to the full cache's)\n"
              + format_table(table, "fidelity"))
    print(f"rows: {jsonl}; table: {output}; load average {harness.load_average()}")
    return 0
