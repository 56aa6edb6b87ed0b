"""The sweep harness shared by `lookm eval needle` and `lookm eval scenes`.

A benchmark turns its samples into `Prompt`s grouped in batches; `run_prompts` prefills each batch
once, answers it with every cache config (`lookm_jax.sweep.generate_methods`) and appends one JSONL
row per (sample, config), skipping the rows already there, so an interrupted run resumes. Rows are
identified by the benchmark's key fields plus the config's label and budget. `summarize` and
`write_csv` give the CSV that `lookm plot sweep` reads.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import time
from typing import Callable, Mapping, Sequence

import numpy as np

from lookm_jax.checks import check_input_file, check_output_file, is_int_at_least
from lookm_jax.errors import MAX_SEED, InputError
from lookm_jax.eval import jsonl
from lookm_jax.eval.jsonl import Field

CSV_COLUMNS = ("label", "method", "text_prior", "merge", "budget", "length", "samples", "accuracy", "fidelity")
DEFAULT_BUDGETS = (0.05, 0.1, 0.2, 0.5)
LOOKM_MERGES = ("none", "averaged", "pivotal", "weighted")
# What every row `run_prompts` writes holds (with the config's fields, the key fields both
# benchmarks share); each benchmark's schema adds its own fields.
ROW_SCHEMA = {
    "label": Field(str), "method": Field(str), "text_prior": Field(str, choices=("1", "0", "")),
    "merge": Field(str, choices=("", *LOOKM_MERGES)), "budget": Field(float, 0, 1, open_low=True),
    "correct": Field(bool), "fidelity": Field(float, 0, 1), "seed": Field(int, 0, MAX_SEED), "sample": Field(int, 0),
    "prompt_tokens": Field(int, 1)}
_LABELS = {"full": "full", "streamingllm": "StreamingLLM", "h2o": "H2O", "snapkv": "SnapKV", "pyramidkv": "PyramidKV",
           "adakv": "AdaKV", "roco": "RoCo", "lookm_quota": "LOOK-M + image quota"}


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """One cache configuration of the sweep; text_prior/merge are LOOK-M's options ("" otherwise);
    `spec` a method with options, as `--methods` takes it ("lookm:image_quota=0.5,merge=None")."""
    method: str
    budget: float  # kept fraction of the prompt; 1.0 for the full cache
    text_prior: str = ""  # "1" | "0" | ""
    merge: str = ""  # "none" | "averaged" | "pivotal" | "weighted" | ""
    spec: str = ""

    @property
    def label(self) -> str:
        if self.spec:
            return self.spec
        if self.method != "lookm":
            return _LABELS.get(self.method, self.method)
        prior = "text-prior" if self.text_prior == "1" else "no text-prior"
        return f"LOOK-M ({prior}, {'no merge' if self.merge == 'none' else self.merge})"

    def build(self):
        from lookm_jax.compression.methods import get_method

        if self.method == "full":
            return get_method("full")
        options = {}
        if self.spec:
            options = parse_spec(self.spec)[1]
        elif self.method == "lookm":
            options = {"text_prior": self.text_prior == "1", "merge": None if self.merge == "none" else self.merge}
        return get_method(self.method, budget=self.budget, **options)


def _option_value(text: str):
    """An option's value as written in a spec: None, True/False, an int, a float, a tuple of numbers
    ("1/2/3"), or else the text itself."""
    if text in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[text]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if "/" in text:
        return tuple(float(x) for x in text.split("/"))
    return text


def parse_spec(spec: str) -> tuple[str, dict]:
    """"name:key=value,key=value" -> (name, options); a bare name has none."""
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"method spec {spec!r}: options are key=value, separated by commas; got {item!r}")
        options[key] = _option_value(value)
    return name, options


def sweep_configs(methods, budgets) -> list[SweepConfig]:
    """The full cache once, then every other method at every budget; "lookm" expands to its 8
    variants (text-prior on/off x merge none/averaged/pivotal/weighted); a spec with options
    ("lookm:image_quota=0.5,merge_scope=same_modality") is one configuration, built once here so a
    wrong option is refused before the sweep starts."""
    from lookm_jax.compression.methods import METHODS

    specs = [m for m in methods if ":" in m]
    methods = [m for m in methods if ":" not in m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")
    if any(not 0 < b <= 1 for b in budgets):
        raise ValueError(f"budgets must be fractions in (0, 1], got {budgets}")
    configs = [SweepConfig("full", 1.0)]
    for budget in budgets:
        for name in (m for m in METHODS if m in methods and m != "full"):
            if name == "lookm":
                configs += [SweepConfig(name, budget, prior, merge) for prior in ("1", "0") for merge in LOOKM_MERGES]
            else:
                configs.append(SweepConfig(name, budget))
        for spec in specs:
            name = parse_spec(spec)[0]
            if name not in METHODS or name == "full":
                raise ValueError(f"unknown method in spec {spec!r}; known: {', '.join(m for m in METHODS if m != 'full')}")
            config = SweepConfig(name, budget, spec=spec)
            config.build()  # refuses an unknown or invalid option by name
            configs.append(config)
    return configs


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One sample as the harness asks it: a user turn with an "<image>" marker per picture."""
    key: dict  # the benchmark's key fields of the sample (e.g. seed, length, sample)
    text: str
    answer: str
    pixel_values: np.ndarray | None  # [num_images, 3, H, W], in marker order
    fields: dict = dataclasses.field(default_factory=dict)  # more columns of its rows (e.g. the depth)
    # The end of the user turn (e.g. the question) asked after the cache is compressed: prefilled
    # onto the compressed cache in one block, so the answer depends on it alone ("": none).
    after: str = ""


def row_key(row: dict, key_fields: Sequence[str], defaults: dict | None = None) -> tuple:
    """A row's identity; `defaults` give key fields that older rows lack (e.g. {"asked": "in prompt"})."""
    defaults = defaults or {}
    return tuple(row[f] if f in row else defaults[f] for f in key_fields) + (row["label"], row["budget"])


def read_rows(path: str, schema: Mapping[str, Field]) -> list[dict]:
    """Per-sample rows of a JSONL written by `run_prompts` ([] when the file does not exist yet),
    each checked against the benchmark's `schema` (InputError naming the line and field); a last
    line cut short by an interrupted write is ignored (and overwritten by the next run)."""
    return jsonl.read_records(path, schema, "benchmark row")


def encode_batch(model, texts: Sequence[str], num_images: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """User turns of `num_images` images each (`Model.encode_chat`: None, those the inline "<image>"
    markers place) -> right-padded chat-templated ids [B, L] int32 and their mask [B, L] bool."""
    from lookm_jax.generate import right_pad

    return right_pad([model.encode_chat(t, num_images=num_images)[0] for t in texts], 0)


def batch_inputs(model, batch: Sequence[Prompt]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A batch of prompts -> (ids [B, L], mask [B, L], pixel_values of all their pictures in order or None)."""
    ids, mask = encode_batch(model, [p.text for p in batch])
    return ids, mask, _pixels(batch)


def _pixels(batch: Sequence[Prompt]) -> np.ndarray | None:
    return None if batch[0].pixel_values is None else np.concatenate([p.pixel_values for p in batch])


def encode_asked_after(model, batch: Sequence[Prompt]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompts with an `after` part -> (ids [B, L] and mask [B, L] of each chat up to that part, the
    rest of the chat [B, A] int32 right-padded with -1: the part, the end of the turn, the
    assistant's header). The split is where the chat with and without `after` first differ in
    tokens, so it never cuts a token of the chat as a whole."""
    from lookm_jax.generate import right_pad

    heads, tails = [], []
    for p in batch:
        whole, without = model.encode_chat(p.text + p.after)[0], model.encode_chat(p.text)[0]
        n = next((i for i, (a, b) in enumerate(zip(whole, without)) if a != b), len(without))
        heads.append(whole[:n])
        tails.append(whole[n:])
    ids, mask = right_pad(heads, 0)
    return ids, mask, right_pad(tails, -1)[0]


def run_prompts(model, configs: list[SweepConfig], batches: Sequence[Sequence[Prompt]], jsonl_path: str,
                key_fields: Sequence[str], is_correct: Callable[[str, str], bool], *, schema: Mapping[str, Field],
                max_new_tokens: int | Sequence[int], max_decode_rows: int = 16, key_defaults: dict | None = None,
                log=print) -> None:
    """Answer every batch with every config, appending rows to `jsonl_path` batch by batch, each answer
    `max_new_tokens` greedy tokens at most (one int, or one per batch: each distinct one compiles once).

    Rows already in the file (same key fields, label and budget) are skipped, so a rerun resumes;
    they are read as `read_rows(jsonl_path, schema)` reads them, so a bad row refuses the run.
    A row holds the key fields, the prompt's fields, its real token count, the config, the output,
    `correct` (`is_correct(answer, output)`) and `fidelity` (share of greedy tokens equal to the
    full cache's, which always runs first). `key_fields` name a sample (one of them "sample").
    """
    from lookm_jax import sweep

    if configs[0] != SweepConfig("full", 1.0):
        raise ValueError("configs must start with the full cache (fidelity's reference)")
    methods = [c.build() for c in configs]
    token_limits = [max_new_tokens] * len(batches) if np.ndim(max_new_tokens) == 0 else list(max_new_tokens)
    if len(token_limits) != len(batches) or not all(is_int_at_least(n, 1) for n in token_limits):
        raise ValueError(f"max_new_tokens must be one int >= 1 or one per batch ({len(batches)} batches), "
                         f"got {max_new_tokens!r:.80}")
    done = {row_key(r, key_fields, key_defaults) for r in read_rows(jsonl_path, schema)}
    os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
    jsonl.drop_cut_line(jsonl_path)
    start, ran, unfinished = time.perf_counter(), 0, {}
    eos = model.text_config.eos_token_ids
    for b, (batch, limit) in enumerate(zip(batches, token_limits)):
        keys = [tuple(p.key[f] for f in key_fields) for p in batch]
        todo = {(c.label, c.budget, k) for c in configs for k in keys if k + (c.label, c.budget) not in done}
        if not todo:
            continue
        if any(p.after for p in batch):
            if not all(p.after for p in batch):
                raise ValueError("a batch's prompts must all ask after compression, or none")
            (ids, mask, after), pixels = encode_asked_after(model, batch), _pixels(batch)
        else:
            (ids, mask, pixels), after = batch_inputs(model, batch), None
        outputs = sweep.generate_methods(model, ids, pixels, mask, limit, methods=methods,
                                         max_decode_rows=max_decode_rows, after=after)
        reference = outputs[0]
        cut = sum(not np.isin(row, eos).any() for tokens in outputs for row in tokens)
        unfinished[limit] = unfinished.get(limit, 0) + cut
        lines = []
        for config, tokens in zip(configs, outputs):
            for r, (prompt, key) in enumerate(zip(batch, keys)):
                if (config.label, config.budget, key) not in todo:
                    continue
                text = model.decode_text(tokens[r])
                lines.append(json.dumps({
                    **prompt.key, "prompt_tokens": int(mask[r].sum()), **prompt.fields, "label": config.label,
                    "method": config.method, "text_prior": config.text_prior, "merge": config.merge,
                    "budget": config.budget, "answer": prompt.answer, "output": text,
                    "correct": bool(is_correct(prompt.answer, text)),
                    "fidelity": float(np.mean(tokens[r] == reference[r]))}))
        with open(jsonl_path, "a") as f:
            f.write("\n".join(lines) + "\n")
        ran += 1
        elapsed = time.perf_counter() - start
        setting = ", ".join(f"{f} {batch[0].key[f]}" for f in key_fields if f != "sample")
        log(f"[{b + 1}/{len(batches)}] {setting} samples {batch[0].key['sample']}-{batch[-1].key['sample']}: "
            f"{elapsed:.0f} s elapsed, ETA {elapsed / ran * (len(batches) - b - 1):.0f} s")
    if any(unfinished.values()) and eos:
        cuts = ", ".join(f"{n} answers were cut at max_new_tokens={limit}" for limit, n in sorted(unfinished.items())
                         if n)
        log(f"warning: {cuts} before their end-of-turn token (scored as cut); give a larger --max-new-tokens if the "
            "answers are meant to be longer")


def unique_rows(rows: list[dict], key_fields: Sequence[str], configs: list[SweepConfig],
                keep: Callable[[dict], bool], key_defaults: dict | None = None) -> list[dict]:
    """One row per key (the last written; JSONLs may have been merged) of these configs, where `keep`."""
    wanted = {(c.label, c.budget) for c in configs}
    unique = {row_key(r, key_fields, key_defaults): r for r in reversed(rows)}
    return [r for r in rows if unique[row_key(r, key_fields, key_defaults)] is r
            and (r["label"], r["budget"]) in wanted and keep(r)]


def summarize(rows: list[dict], length: Callable[[dict], int] = lambda r: r["length"]) -> list[dict]:
    """Per (config, length): samples, accuracy and fidelity (means over samples), CSV_COLUMNS keys.
    `length` gives a row's setting for the CSV's length column (the plot's panels)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["label"], r["method"], r["text_prior"], r["merge"], r["budget"], length(r))
        groups.setdefault(key, []).append(r)
    return [dict(zip(CSV_COLUMNS, key + (len(g), float(np.mean([r["correct"] for r in g])),
                                         float(np.mean([r["fidelity"] for r in g])))))
            for key, g in groups.items()]


def write_csv(path: str, table: list[dict]) -> None:
    """Write the summary table (CSV_COLUMNS) atomically."""
    write_table(path, list(CSV_COLUMNS), [[row[c] for c in CSV_COLUMNS] for row in table])


def write_table(path: str, header: list[str], lines: list[list]) -> None:
    """A CSV written atomically: a temporary file renamed into place, removed if the write fails.
    None is written as an empty cell."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows([["" if v is None else v for v in line] for line in lines])
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def check_multimodal(model, benchmark: str, hint: str = "") -> None:
    """Refuse (InputError) a text-only model for a benchmark that shows it pictures."""
    if not model.is_multimodal:
        raise InputError(f"{benchmark} needs a multimodal (LLaVA-style) model; this one is text-only{hint}")


def refuse_repeats(flag: str, values: Sequence) -> None:
    """Refuse (InputError) a list flag that names a value twice: its samples would run, and count, twice."""
    repeated = sorted({v for v in values if list(values).count(v) > 1})
    if repeated:
        raise InputError(f"{flag} repeats {', '.join(map(str, repeated))}: give each value once")


def check_run_arguments(args, jsonl: str, output: str) -> None:
    """Refuse (InputError; FileNotFoundError for a missing file or folder) what `lookm eval needle`
    and `lookm eval scenes` cannot run with, before anything runs. A given --output's folder must
    exist (the default's is made under its nearest existing folder); either must be writable."""
    if args.max_decode_rows < 1:
        raise InputError(f"--max-decode-rows must be >= 1, got {args.max_decode_rows}")
    if args.mode == "calibrate" and (args.methods or args.budgets is not None):
        raise InputError("calibrate runs the full cache only; --methods and --budgets are for sweep")
    for flag in ("lengths", "pictures", "tasks", "budgets"):
        refuse_repeats(f"--{flag}", getattr(args, flag, None) or ())
    if os.path.abspath(jsonl) == os.path.abspath(output):
        raise InputError(f"--jsonl and --output are the same file ({jsonl}): the summary would overwrite the rows")
    if args.report_only:
        check_input_file(jsonl, "--jsonl", "--report-only summarises the rows of an earlier run")
    else:
        check_output_file(jsonl, "--jsonl", create_folder=True)  # appended to, its folder made on the first row
    check_output_file(output, "--output", create_folder=args.output is None)


def format_table(table: list[dict], column: str = "accuracy") -> str:
    """A markdown table of `column`: one row per config label, one column per (budget, length)."""
    budgets = sorted({r["budget"] for r in table if r["method"] != "full"}) or [1.0]
    lengths = sorted({r["length"] for r in table})
    cells = {(r["label"], r["budget"], r["length"]): r[column] for r in table}
    labels = list(dict.fromkeys(r["label"] for r in table))
    head = ["config"] + [f"{b:g} @ {n}" for b in budgets for n in lengths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in labels:
        if label == "full":
            values = [cells.get(("full", 1.0, n)) for b in budgets for n in lengths]
        else:
            values = [cells.get((label, b, n)) for b in budgets for n in lengths]
        lines.append("| " + " | ".join([label] + ["" if v is None else f"{v:.2f}" for v in values]) + " |")
    return "\n".join(lines)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
