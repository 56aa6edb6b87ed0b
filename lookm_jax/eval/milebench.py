"""MileBench (Song et al., 2024) harness: `lookm eval milebench ROOT`.

Reads MileBench's released layout: `ROOT/<Dataset>/<Dataset>.json` (`<Dataset>-adv.json` for the
adversarial variant) with images under `ROOT/<Dataset>/images/`. Prompts are built as MileBench's
`MileBenchDataset` builds them (`utils.py` of MileBench/MileBench): the task instruction, a newline,
the context with every `{image#k}` / `{table#k}` (k = 1..#images) replaced by the image marker,
and for multi-choice "\\nChoice list: \\n", the options "A. ..." one per line (GPR1200: no
letters) and "\\nYour answer is: "; two adjacent markers get newlines after them (the CLEVR-Change
fix of MileBench's LLaVA worker). The i-th marker in reading order shows the i-th image.

Over-long prompts are cut from the left with the instruction and the question (the text after the
last image) always kept, each image counted as `image_seq_length` tokens: the kept context is the
longest suffix, in tokens, that fits; an image that does not fit whole is dropped with everything
before it. (MileBench drops the whole text fragment that crosses the limit; here its tail is kept.)

Predictions go to `OUTPUT/predictions.jsonl`, one line per sample as it finishes; a rerun skips
the samples already there for the same config (model, method, dtype, max_new_tokens,
max_prompt_tokens, adv). Scores (see `milebench_scoring`) are reported x100 per dataset and per
the LOOK-M paper's task groups (a group is the mean of its datasets present, "overall" the mean of
the groups present) in `OUTPUT/milebench_datasets.csv` and `OUTPUT/milebench_groups.csv`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time

import numpy as np

from lookm_jax.checks import check_output_folder
from lookm_jax.cli_args import add_method_arguments, method_from_args, path_arg
from lookm_jax.errors import PARAM_DTYPES, InputError
from lookm_jax.eval import harness, jsonl
from lookm_jax.eval.jsonl import Field
from lookm_jax.eval.milebench_scoring import QUESTION_TYPES, choice_letters, normalize, score
from lookm_jax.inputs import open_image

GROUPS: dict[str, tuple[str, ...]] = {
    "T-1": ("ActionLocalization", "ActionPrediction", "ActionSequence"),
    "T-2": ("ObjectExistence", "ObjectInteraction", "MovingAttribute", "ObjectShuffle"),
    "T-3": ("EgocentricNavigation", "MovingDirection"),
    "T-4": ("CounterfactualInference", "StateChange", "CharacterOrder", "SceneTransition"),
    "S-1": ("WebQA", "TQA", "MultiModalQA", "WikiVQA"),
    "S-2": ("SlideVQA", "OCR-VQA", "DocVQA"),
    "S-3": ("CLEVR-Change", "Spot-the-Diff", "IEdit"),
    "S-4": ("MMCoQA", "ALFRED"),
    "S-5": ("nuscenes",),
    "NH": ("TextNeedleInAHaystack", "ImageNeedleInAHaystack"),
    "IR": ("GPR1200",),
}
DATASETS: tuple[str, ...] = tuple(d for names in GROUPS.values() for d in names)
IMAGE_MARKER = "<image>"  # what `Model.encode_chat` expands into the image placeholder tokens
NO_LETTERS = "GPR1200"  # its options are listed without letters (more than 26 of them)
PREDICTIONS = "predictions.jsonl"
DATASETS_CSV = "milebench_datasets.csv"
GROUPS_CSV = "milebench_groups.csv"
CONFIG_FIELDS = ("model", "method", "dtype", "max_new_tokens", "max_prompt_tokens", "adv", "asked")
# Where the question (the text after the last image) is: in the prompt, as MileBench asks, or prefilled
# onto the cache after the rest of the prompt is compressed (`--ask-after-compression`).
ASKED = ("in prompt", "after compression")
RECORD_SCHEMA = {  # what a predictions.jsonl record holds, as `read_predictions` checks it
    "model": Field(str), "method": Field(str), "dtype": Field(str, choices=PARAM_DTYPES),
    "max_new_tokens": Field(int, 1), "max_prompt_tokens": Field(int, 1), "adv": Field(bool),
    "asked": Field(str, choices=ASKED, optional=True), "dataset": Field(str),
    "sample_id": Field(int), "score": Field(float, 0, 1)}
_PLACEHOLDER = re.compile(r"\{(?:image|table)#\d+\}")


@dataclasses.dataclass(frozen=True)
class Sample:
    dataset: str
    sample_id: int
    question_type: str  # "multi-choice" | "open-ended"
    instruction: str
    texts: tuple[str, ...]  # the context split at the image markers (choices appended): len(images) + 1
    images: tuple[str, ...]  # image file paths, in marker order
    answer: str
    choices: tuple[str, ...] | None
    image_quantity_level: str | None


# ---- reading the data -----------------------------------------------------------------------------
def dataset_file(root: str, name: str, adv: bool = False) -> str:
    return os.path.join(root, name, f"{name}-adv.json" if adv else f"{name}.json")


def find_datasets(root: str, adv: bool = False) -> list[str]:
    """Datasets present under root: the paper's order first, then any other folder of the same layout."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"MileBench root {root!r} is not a folder")
    present = [d for d in sorted(os.listdir(root)) if os.path.isfile(dataset_file(root, d, adv))]
    if not present:
        expected = dataset_file(root, "<Dataset>", adv)
        raise FileNotFoundError(f"no MileBench datasets under {root!r} (expected {expected})")
    return sorted(present, key=lambda d: (DATASETS.index(d) if d in DATASETS else len(DATASETS), d))


def _context(task: dict, dataset: str, n_images: int) -> str:
    """The context with choices appended and placeholders replaced, as MileBench's `__getitem__`."""
    context = task["context"]
    if "choice_list" in task:
        letters = ["" if dataset == NO_LETTERS else f"{k}. " for k in choice_letters(len(task["choice_list"]))]
        context += "\nChoice list: \n" + "\n".join(f"{k}{choice}" for k, choice in zip(letters, task["choice_list"]))
        context += "\nYour answer is: "
    for k in range(1, n_images + 1):
        context = context.replace(f"{{image#{k}}}", IMAGE_MARKER).replace(f"{{table#{k}}}", IMAGE_MARKER)
    return context


def _sample(item, meta: dict, dataset: str, image_dir: str, where: str) -> Sample:
    if not isinstance(item, dict):
        raise ValueError(f"{where}: a data entry must be an object, got {type(item).__name__}")
    missing = {"sample_id", "task_instruction_id", "task_instance", "response"} - item.keys()
    if missing:
        raise ValueError(f"{where}: data entry lacks {sorted(missing)}")
    sample_id, task = item["sample_id"], item["task_instance"]
    where = f"{where} sample {sample_id}"
    if not isinstance(sample_id, int) or isinstance(sample_id, bool):
        raise ValueError(f"{where}: sample_id must be an int")
    if not isinstance(task, dict) or not isinstance(task.get("context"), str) or not isinstance(
            task.get("images_path"), list) or not all(isinstance(p, str) for p in task["images_path"]):
        raise ValueError(f"{where}: task_instance needs a str 'context' and a list of str 'images_path'")
    instructions = meta["task_instruction"]
    if not isinstance(item["task_instruction_id"], int) or not 0 <= item["task_instruction_id"] < len(instructions):
        raise ValueError(f"{where}: task_instruction_id {item['task_instruction_id']!r} is not an index into "
                         f"the {len(instructions)} task instructions")
    images = task["images_path"]
    context = _context(task, dataset, len(images))
    unmatched = _PLACEHOLDER.search(context)
    if unmatched:
        raise InputError(f"{where}: the context's {unmatched[0]} has no image (images_path lists {len(images)})")
    texts = context.split(IMAGE_MARKER)
    if len(texts) != len(images) + 1:
        raise ValueError(f"{where}: {len(texts) - 1} image placeholders in the context for {len(images)} images")
    choices = None
    if not isinstance(item["response"], (str, int, float)) or isinstance(item["response"], bool):
        raise InputError(f"{where}: response {json.dumps(item['response'])} is not a string or a number")
    answer = str(item["response"])
    if meta["question_type"] == "multi-choice":
        if not isinstance(task.get("choice_list"), list) or not task["choice_list"]:
            raise ValueError(f"{where}: a multi-choice sample needs a non-empty 'choice_list'")
        choices = tuple(str(c) for c in task["choice_list"])
        if normalize(answer) not in [normalize(c) for c in choices]:
            raise ValueError(f"{where}: the response {answer!r} is not one of its choices")
    return Sample(dataset=dataset, sample_id=sample_id, question_type=meta["question_type"],
                  instruction=instructions[item["task_instruction_id"]], texts=tuple(texts),
                  images=tuple(os.path.join(image_dir, p) for p in images), answer=answer, choices=choices,
                  image_quantity_level=item.get("image_quantity_level"))


def load_dataset(root: str, name: str, adv: bool = False, limit: int | None = None) -> list[Sample]:
    """The first `limit` (default all) samples of one dataset, validated (image files included)."""
    path = dataset_file(root, name, adv)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"MileBench dataset {name!r}: no file {path}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    meta = raw.get("meta_data") if isinstance(raw, dict) else None
    if not isinstance(meta, dict) or not isinstance(raw.get("data"), list) or not raw["data"]:
        raise ValueError(f"{path}: expected {{'meta_data': {{...}}, 'data': [...]}} with at least one sample")
    if meta.get("question_type") not in QUESTION_TYPES:
        raise ValueError(f"{path}: meta_data.question_type must be one of {QUESTION_TYPES}, "
                         f"got {meta.get('question_type')!r}")
    instructions = meta.get("task_instruction")
    if not isinstance(instructions, list) or not all(isinstance(t, str) for t in instructions):
        raise ValueError(f"{path}: meta_data.task_instruction must be a list of strings")
    image_dir = os.path.join(root, name, "images")
    samples = [_sample(item, meta, name, image_dir, path) for item in raw["data"]]
    ids = [s.sample_id for s in samples]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate sample_id values")
    samples = samples[:limit]
    checked = set()
    for s in samples:
        for image in set(s.images) - checked:
            try:
                open_image(image).close()
            except InputError as err:
                raise InputError(f"{path} sample {s.sample_id}: {err}") from None
            checked.add(image)
    return samples


# ---- prompts --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Prompt:
    input_ids: np.ndarray  # [1, L] int32, image markers expanded
    images: tuple[str, ...]  # the images kept, in order
    truncated: bool
    question_start: int  # where the text after the last image (the question) starts in input_ids
    image_tiles: tuple | None = None  # the kept images' tiles or grids (tiling and grid processors), else None


def render(instruction: str, texts: list[str] | tuple[str, ...]) -> str:
    """The user turn: instruction, newline, texts joined by image markers (adjacent markers get newlines)."""
    prompt = instruction + "\n" + IMAGE_MARKER.join(texts)
    return prompt.replace(IMAGE_MARKER * 2, (IMAGE_MARKER + "\n") * 2)


def image_tiles(model, images) -> list | None:
    """Each image's tiles or grid as the model's processor sees it (tiling and grid processors:
    InternVL's tile counts, Qwen2-VL's grids), None for a fixed number of tokens per image."""
    if not model.processor.tiling:
        return None
    if not images:
        return []
    return list(model.preprocess_images([open_image(p).convert("RGB") for p in images])[1])


def build_prompt(model, sample: Sample, max_tokens: int) -> Prompt:
    """Chat-templated ids of the sample's prompt, cut from the left to at most max_tokens: the most
    pictures whose prompt (no text before the first of them) fits, then as much of the text before them
    as fits. Each picture costs its own tokens (a tiling or grid processor's depend on the picture and,
    for LLaVA-OneVision, on how many are kept), so a larger limit never keeps fewer pictures."""
    from lookm_jax.generate import PromptTooLongError

    n = len(sample.images)
    tiles = image_tiles(model, sample.images)

    def encode(texts):  # k + 1 texts around the last k pictures -> (ids, those pictures' tiles)
        k = len(texts) - 1
        kept = tiles
        if tiles is not None:
            kept = tiles[n - k:] if model.processor.tiles_unchanged(n, k) else image_tiles(model, sample.images[n - k:])
        return model.encode_chat(render(sample.instruction, texts), image_tiles=kept), kept

    def prompt(texts, ids, kept_tiles, truncated):
        return Prompt(ids, sample.images[n - (len(texts) - 1):], truncated,
                      _question_start(model, sample.instruction, texts, ids, kept_tiles),
                      None if kept_tiles is None else tuple(kept_tiles))

    ids, kept_tiles = encode(sample.texts)
    if ids.shape[1] <= max_tokens:
        return prompt(sample.texts, ids, kept_tiles, False)
    for k in range(n, -1, -1):  # text j is followed by picture j; the question is the last text
        after = list(sample.texts[n - k + 1:]) if k else [sample.texts[-1]]
        texts = [""] + after if k else after
        ids, kept_tiles = encode(texts)
        if ids.shape[1] <= max_tokens:
            break
    else:
        raise PromptTooLongError(f"{sample.dataset} sample {sample.sample_id}: the instruction and question alone "
                                 f"take {ids.shape[1]} tokens, over the limit of {max_tokens}")
    if k:  # the room left: the tail of the text before the first kept picture
        before = model.tokenizer.encode(sample.texts[n - k], add_special_tokens=False).ids
        room = min(len(before), max_tokens - ids.shape[1])
        while room > 0:  # separately tokenized fragments may merge differently: shrink until the whole fits
            longer = [model.tokenizer.decode(before[len(before) - room:])] + after
            longer_ids, longer_tiles = encode(longer)
            if longer_ids.shape[1] <= max_tokens:
                texts, ids, kept_tiles = longer, longer_ids, longer_tiles
                break
            room -= longer_ids.shape[1] - max_tokens
    return prompt(texts, ids, kept_tiles, True)


def _question_start(model, instruction: str, texts, ids: np.ndarray, tiles=None) -> int:
    """Where the chat with and without the last text first differ in tokens (`harness.encode_asked_after`)."""
    without = model.encode_chat(render(instruction, [*texts[:-1], ""]), image_tiles=tiles)[0]
    return next((i for i, (a, b) in enumerate(zip(ids[0], without)) if a != b), len(without))


# ---- running --------------------------------------------------------------------------------------
def method_label(method) -> str:
    """Class name with the fields that differ from their defaults (the budget fractions always)."""
    shown = [f"{f.name}={getattr(method, f.name)!r}" for f in dataclasses.fields(method)
             if f.name in ("alpha_recent", "alpha_important") or getattr(method, f.name) != f.default]
    return f"{type(method).__name__}({', '.join(shown)})"


def read_predictions(path: str) -> list[dict]:
    """The records of a predictions file (none if it does not exist), checked against RECORD_SCHEMA."""
    return jsonl.read_records(path, RECORD_SCHEMA, "MileBench prediction record")


def evaluate(model, samples: list[Sample], method, config: dict, output: str) -> list[dict]:
    """Generate and score every sample not yet in OUTPUT/predictions.jsonl for this config, appending
    one record per sample as it finishes. Returns all records of the file (every config)."""
    from tqdm import tqdm

    from lookm_jax.inputs import open_image

    path = os.path.join(output, PREDICTIONS)
    done = {(r["dataset"], r["sample_id"]) for r in read_predictions(path)
            if record_config(r) == tuple(config[k] for k in CONFIG_FIELDS)}
    if jsonl.drop_cut_line(path):
        print(f"note: removed an incomplete last line from {path} (an interrupted run)")
    todo = [s for s in samples if (s.dataset, s.sample_id) not in done]
    if len(todo) < len(samples):
        print(f"resuming: {len(samples) - len(todo)} of {len(samples)} samples already in {path}")
    with tqdm(total=len(todo), unit="sample", desc="milebench") as bar:
        for sample in todo:
            bar.set_postfix_str(sample.dataset, refresh=False)
            prompt = build_prompt(model, sample, config["max_prompt_tokens"])
            # MileBench's LLaVA worker opens images with .convert("RGB") (no compositing onto white).
            pixels = (model.preprocess_images([open_image(p).convert("RGB") for p in prompt.images])[0]
                      if prompt.images else None)
            start = time.perf_counter()
            result = (_ask_after(model, prompt, pixels, method, config["max_new_tokens"])
                      if config["asked"] == ASKED[1] else
                      model.run(prompt.input_ids, pixels, max_new_tokens=config["max_new_tokens"], method=method))
            prediction = model.decode_text(result.tokens[0][: int(result.lengths[0])]).strip()
            record = {
                **config, "dataset": sample.dataset, "sample_id": sample.sample_id,
                "question_type": sample.question_type, "image_quantity_level": sample.image_quantity_level,
                "answer": sample.answer, "choices": sample.choices, "prediction": prediction,
                "score": score(sample.dataset, sample.question_type, prediction, sample.answer, sample.choices),
                "prompt_tokens": int(result.prompt_lengths[0]), "image_tokens": int(result.image_tokens[0]),
                "images_kept": len(prompt.images), "images_total": len(sample.images), "truncated": prompt.truncated,
                "kept_image_tokens": float(result.kept_image_tokens[0]),
                "kept_text_tokens": float(result.kept_text_tokens[0]), "cache_bytes": result.cache_bytes,
                "full_cache_bytes": result.full_cache_bytes, "seconds": time.perf_counter() - start,
            }
            os.makedirs(output, exist_ok=True)  # on the first record: a run refused before it writes nothing
            with open(path, "a", encoding="utf-8") as out:
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            bar.update()
    return read_predictions(path)


# ---- tables ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Row:
    config: dict  # CONFIG_FIELDS
    datasets: dict[str, float]  # dataset -> mean score x100
    groups: dict[str, float]  # task group -> mean of its datasets present
    overall: float | None  # mean of the groups present
    samples: int


def _ask_after(model, prompt: Prompt, pixels, method, max_new_tokens: int):
    """The prompt up to its question prefilled and compressed, the question prefilled onto it
    (`Model.ask`) -> a `GenerationResult` (its prompt counts the whole prompt; the full cache's bytes:
    the uncompressed context's slots + the question's and answer's)."""
    from lookm_jax.model import GenerationResult

    context = model.prefill_context(prompt.input_ids[:, :prompt.question_start], pixels, method=method)
    answer = model.ask(context, prompt.input_ids[:, prompt.question_start:], max_new_tokens=max_new_tokens)
    image, text = context.kept_by_modality()
    slot_bytes = context.cache.slot_bytes
    new_slots = (answer.cache_bytes - context.cache.nbytes) // slot_bytes
    return GenerationResult(
        tokens=answer.tokens, lengths=answer.lengths, prompt_lengths=np.asarray([prompt.input_ids.shape[1]]),
        image_tokens=(prompt.input_ids == model.config.image_token_id).sum(1), kept_image_tokens=image,
        kept_text_tokens=text, bucket=context.bucket, prompt_slots=context.prompt_slots, new_slots=new_slots,
        cache_bytes=answer.cache_bytes, full_cache_bytes=slot_bytes * (context.bucket + new_slots),
        compile_seconds=answer.compile_seconds, prefill_seconds=answer.prefill_seconds,
        decode_seconds=answer.decode_seconds)


def record_config(record: dict) -> tuple:
    """A record's config (CONFIG_FIELDS); records written before "asked" existed asked in the prompt."""
    return tuple(record.get(k, ASKED[0]) if k == "asked" else record[k] for k in CONFIG_FIELDS)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def summarize(records: list[dict]) -> list[Row]:
    """One row per config, in first-seen order."""
    scores: dict[tuple, dict[str, list[float]]] = {}
    for r in records:
        scores.setdefault(record_config(r), {}).setdefault(r["dataset"], []).append(r["score"])
    rows = []
    for key, per_dataset in scores.items():
        datasets = {d: 100 * _mean(v) for d, v in per_dataset.items()}
        groups = {g: _mean(datasets[d] for d in names if d in datasets)
                  for g, names in GROUPS.items() if any(d in datasets for d in names)}
        rows.append(Row(config=dict(zip(CONFIG_FIELDS, key)), datasets=datasets, groups=groups,
                        overall=_mean(groups.values()) if groups else None,
                        samples=sum(len(v) for v in per_dataset.values())))
    return rows


def _dataset_columns(rows: list[Row]) -> list[str]:
    present = {d for row in rows for d in row.datasets}
    return [d for d in DATASETS if d in present] + sorted(present - set(DATASETS))


def table(rows: list[Row], by: str) -> tuple[list[str], list[list]]:
    """(header, lines) of the group table (by="groups": task groups, overall) or the dataset table."""
    columns = list(GROUPS) + ["overall"] if by == "groups" else _dataset_columns(rows)
    header = list(CONFIG_FIELDS) + columns + ["samples"]
    lines = []
    for row in rows:
        values = {**row.groups, "overall": row.overall} if by == "groups" else row.datasets
        scores = [None if values.get(c) is None else round(values[c], 2) for c in columns]
        lines.append([row.config[k] for k in CONFIG_FIELDS] + scores + [row.samples])
    return header, lines


def format_table(header: list[str], lines: list[list]) -> str:
    """Plain-text table; the method (and adv) stand for the config, the other config fields are in the CSV."""
    skip = {i for i, h in enumerate(header) if h in CONFIG_FIELDS and h not in ("method", "adv")}
    cells = [[h for i, h in enumerate(header) if i not in skip]]
    cells += [["-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)
               for i, v in enumerate(line) if i not in skip] for line in lines]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


# ---- command --------------------------------------------------------------------------------------
def cmd_milebench(args) -> int:
    import lookm_jax

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    harness.refuse_repeats("--datasets", args.datasets or ())
    check_output_folder(args.output, "--output")
    names = args.datasets or find_datasets(args.root, args.adv)
    samples = [s for name in names for s in load_dataset(args.root, name, args.adv, args.limit)]
    read_predictions(os.path.join(args.output, PREDICTIONS))  # a bad record refuses before the model loads
    method = method_from_args(args)
    model = lookm_jax.load(args.model, args.dtype) if args.model else lookm_jax.load_default(args.dtype)
    harness.check_multimodal(model, "MileBench")
    # A prompt must fit the largest bucket and, with its answer, the model's context.
    context = model.text_config.max_position_embeddings
    if args.max_new_tokens >= context:
        raise ValueError(f"--max-new-tokens must be below the model's context length ({context}), "
                         f"got {args.max_new_tokens}")
    longest = min(max(model.buckets), context - args.max_new_tokens)
    max_prompt = longest if args.max_prompt_tokens is None else args.max_prompt_tokens
    if not 0 < max_prompt <= longest:
        raise ValueError(f"--max-prompt-tokens must be in 1..{longest} (the largest bucket, and the context "
                         f"length less --max-new-tokens), got {max_prompt}")
    config = {"model": os.path.abspath(args.model) if args.model else "default", "method": method_label(method),
              "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": max_prompt,
              "adv": args.adv, "asked": ASKED[1] if args.ask_after_compression else ASKED[0]}
    rows = summarize(evaluate(model, samples, method, config, args.output))
    for by, name in (("datasets", DATASETS_CSV), ("groups", GROUPS_CSV)):
        header, lines = table(rows, by)
        harness.write_table(os.path.join(args.output, name), header, lines)
        print(f"\nMileBench by {by[:-1]} (score x100; {os.path.join(args.output, name)}):")
        print(format_table(header, lines))
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("milebench", help="evaluate a method on MileBench (downloaded separately)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="MileBench folder: ROOT/<Dataset>/<Dataset>.json and ROOT/<Dataset>/images/")
    p.add_argument("--datasets", nargs="+", help="dataset names (default: every one present under ROOT)")
    p.add_argument("--adv", action="store_true", help="the adversarial variant (<Dataset>-adv.json)")
    p.add_argument("--model", type=path_arg, help="HF llava checkpoint folder or converted folder (default: the embedded demo model)")
    p.add_argument("--dtype", choices=PARAM_DTYPES, default="float32", help="parameter and activation dtype")
    add_method_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=512, help="MileBench's setting: 512")
    p.add_argument("--max-prompt-tokens", type=int,
                   help="cut longer prompts from the left (default: the most that fits the largest bucket and the "
                        "context with --max-new-tokens)")
    p.add_argument("--limit", type=int, help="only the first N samples of each dataset")
    p.add_argument("--ask-after-compression", action="store_true",
                   help="compress the context without the question (the text after the last image), then prefill "
                        "the question onto the compressed cache (`Model.ask`); default: the question in the prompt")
    p.add_argument("--output", type=path_arg, default="milebench_results", help="folder for predictions.jsonl and the CSV tables")
    p.set_defaults(func=cmd_milebench)
