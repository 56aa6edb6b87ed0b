"""`lookm plot sweep` (accuracy vs budget, the paper's Figure 5), `lookm plot attention`
(attention received per layer by text and image tokens, the paper's Figure 2) and `lookm plot
training` (a `lookm train vision` log: loss and accuracy vs step).

matplotlib and jax are imported inside the functions that use them (the commands select the Agg
backend: no display needed).
Figures have a fixed size in pixels and are written atomically: a failed command leaves no file.
"""

from __future__ import annotations

import csv
import io
import os

from lookm_jax.checks import check_output_file
from lookm_jax.cli_args import add_prompt_arguments, default_images, check_image_markers, path_arg, read_prompt
from lookm_jax.errors import InputError
from lookm_jax.eval.harness import CSV_COLUMNS as SWEEP_COLUMNS  # what `lookm eval needle/scenes` write
from lookm_jax.eval.jsonl import Field

METRICS = ("accuracy", "fidelity")
DPI = 100
SWEEP_PANEL_INCHES = (4.0, 3.6)  # one panel per prompt length
SWEEP_LEGEND_INCHES = 3.4  # legend column to the right of the panels
MAX_SWEEP_LENGTHS = 16  # panels of one sweep figure (6740 pixels wide); more would take minutes to draw
ATTENTION_INCHES = (11.0, 9.0)
TRAINING_INCHES = (11.0, 4.0)
TRAINING_SMOOTHING = 15  # steps in the running mean of the per-step curves


def sweep_figsize(num_panels: int) -> tuple[float, float]:
    """Inches of the sweep figure; pixels are these times ``DPI``."""
    width, height = SWEEP_PANEL_INCHES
    return num_panels * width + SWEEP_LEGEND_INCHES, height


def read_sweep(path: str) -> list[dict]:
    """The sweep CSV -> rows with budget/accuracy/fidelity as floats, length/samples as ints.

    Raises InputError naming the problem (missing columns, no rows, a short row, a value that is
    not a number, a metric outside [0, 1], a budget outside (0, 1], a repeated (label, budget,
    length), more than ``MAX_SWEEP_LENGTHS`` lengths) and FileNotFoundError when there is no file.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no sweep results at {path}")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: Excel starts its CSVs with a BOM
            reader = csv.DictReader(f)
            fieldnames, table = reader.fieldnames or (), list(reader)
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a UTF-8 text file (a sweep CSV)") from None
    missing = [c for c in SWEEP_COLUMNS if c not in fieldnames]
    if missing:
        raise InputError(f"{path}: missing column(s) {', '.join(missing)}; "
                         f"a sweep CSV has the columns {','.join(SWEEP_COLUMNS)}")
    rows, seen = [], {}
    for line, raw in enumerate(table, start=2):
        if None in raw.values():  # DictReader fills the columns a short row lacks with None
            raise InputError(f"{path}, line {line}: too few columns ({sum(v is not None for v in raw.values())} "
                             f"of the header's {len(fieldnames)})")
        try:
            row = {**raw, "budget": float(raw["budget"]), "length": int(raw["length"]),
                   "samples": int(raw["samples"]), "accuracy": float(raw["accuracy"]),
                   "fidelity": float(raw["fidelity"])}
        except ValueError as err:
            raise InputError(f"{path}, line {line}: {err}") from None
        if not 0.0 < row["budget"] <= 1.0:  # the full cache's is 1
            raise InputError(f"{path}, line {line}: budget {row['budget']} is outside (0, 1]")
        if row["length"] < 1 or row["samples"] < 1:
            raise InputError(f"{path}, line {line}: length and samples must be >= 1, got {row['length']}, "
                             f"{row['samples']}")
        for metric in METRICS:
            if not 0.0 <= row[metric] <= 1.0:
                raise InputError(f"{path}, line {line}: {metric} {row[metric]} is outside [0, 1]")
        key = (row["label"], row["budget"], row["length"])
        if key in seen:
            raise InputError(f"{path}, lines {seen[key]} and {line}: both are label {key[0]!r}, budget {key[1]}, "
                             f"length {key[2]}; a sweep has one row per (label, budget, length)")
        seen[key] = line
        rows.append(row)
    if not rows:
        raise InputError(f"{path}: no result rows")
    lengths = len({r["length"] for r in rows})
    if lengths > MAX_SWEEP_LENGTHS:
        raise InputError(f"{path}: {lengths} prompt lengths; a sweep figure has one panel per length and at most "
                         f"{MAX_SWEEP_LENGTHS}")
    return rows


def _check_output(path: str) -> None:
    if not path.lower().endswith(".png"):
        raise InputError(f"--output must be a .png file, got {path}")
    check_output_file(path, "--output")


def _save_png(fig, path: str) -> None:
    """Render the figure in memory, then write it to a temporary file beside `path` (mode from the
    umask, as for any new file) and rename that into place: the temporary file exists only for the
    write, so a kill while drawing leaves nothing behind."""
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=DPI)
    tmp = f"{path}.{os.getpid()}.tmp"
    f = open(tmp, "xb")
    try:
        with f:
            f.write(png.getbuffer())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def draw_sweep(rows: list[dict], metric: str):
    """One panel per prompt length, one line per label (metric vs budget); the full cache
    (method "full") is a dashed horizontal reference. Returns the matplotlib Figure."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    lengths = sorted({r["length"] for r in rows})
    labels = list(dict.fromkeys(r["label"] for r in rows if r["method"] != "full"))
    budgets = sorted({r["budget"] for r in rows if r["method"] != "full"})
    fig = Figure(figsize=sweep_figsize(len(lengths)), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, len(lengths), sharey=True, squeeze=False)[0]
    palette = [f"C{i}" for i in range(10)] if len(labels) <= 10 else list(colormaps["tab20"].colors)
    colors = {label: palette[i % len(palette)] for i, label in enumerate(labels)}
    markers = "osD^v<>p*hXP8"  # 13 markers x 20 colours: distinct for up to 260 labels
    for ax, length in zip(axes, lengths):
        here = [r for r in rows if r["length"] == length]
        for full in (r for r in here if r["method"] == "full"):
            ax.axhline(full[metric], color="black", linestyle="--", linewidth=1.2, label=full["label"])
        for i, label in enumerate(labels):
            points = sorted((r["budget"], r[metric]) for r in here if r["label"] == label)
            if points:
                x, y = zip(*points)
                ax.plot(x, y, marker=markers[i % len(markers)], color=colors[label], label=label)
        samples = sorted({r["samples"] for r in here})
        ax.set_title(f"{length} tokens (n={'/'.join(map(str, samples))})")
        ax.set_xscale("log")
        ax.set_xticks(budgets, [f"{b:.0%}" for b in budgets])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("KV budget (share of the prompt)")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(metric)
    handles = {}
    for ax in axes:  # one legend entry per label, across panels
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="outside right upper", fontsize="small")
    return fig


def cmd_sweep(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    output = args.output or os.path.splitext(args.results)[0] + ("" if args.metric == "accuracy" else
                                                                 f"_{args.metric}") + ".png"
    rows = read_sweep(args.results)  # first: a missing CSV is named as such, not by its default output
    _check_output(output)
    _save_png(draw_sweep(rows, args.metric), output)
    print(f"wrote {output}: {args.metric} vs budget, {len({r['label'] for r in rows})} configurations, "
          f"lengths {', '.join(str(n) for n in sorted({r['length'] for r in rows}))}")
    return 0


# The numbers of a stage-1 record: type and range.
TRAINING_FIELDS = {"step": Field(int, 1), "loss": Field(float, 0), "accuracy": Field(float, 0, 1),
                   "pictures": Field(int, 1), "heldout_accuracy": Field(float, 0, 1, optional=True),
                   "combination_accuracy": Field(float, 0, 1, optional=True)}


def read_training_log(path: str) -> list[dict]:
    """The stage-1 records of a `lookm train vision` log.jsonl (the records before them, keyed by one
    of `vision.PRELUDE_KEYS`, and a cut last line of a run still writing are skipped). Raises
    InputError naming the line that is not a record, the field outside `TRAINING_FIELDS`' range or
    a step that does not follow the one before; FileNotFoundError when there is no file."""
    import json

    from lookm_jax.train.vision import PRELUDE_KEYS

    if not os.path.isfile(path):
        raise FileNotFoundError(f"no training log at {path}")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")  # the last item is "" unless the last line was cut
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a text file (a training log is JSON lines)") from None
    rows = []
    for line, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            if line == len(lines):  # cut while being written
                continue
            raise InputError(f"{path}, line {line}: not JSON ({err})") from None
        if not isinstance(record, dict):
            raise InputError(f"{path}, line {line}: a record is a JSON object, got {text.strip()[:40]!r}")
        if any(key in record for key in PRELUDE_KEYS):
            continue
        for key, field in TRAINING_FIELDS.items():
            if (not field.optional or key in record) and not field.accepts(record.get(key)):
                got = f"is {json.dumps(record[key])[:40]}, not {field.describe()}" if key in record else "is missing"
                raise InputError(f"{path}, line {line}: a stage-1 record has the numbers step, loss, accuracy and "
                                 f"pictures; {key} {got}")
        if rows and record["step"] <= rows[-1]["step"]:
            raise InputError(f"{path}, line {line}: step {record['step']} after step {rows[-1]['step']}; "
                             f"steps increase down the log")
        rows.append(record)
    if not rows:
        raise InputError(f"{path}: no stage-1 records")
    return rows


def draw_training(rows: list[dict], title: str):
    """Loss (left) and first-answer-token accuracy (right) vs step: running means of the training
    batches, single- and multi-picture apart, and the periodic held-out evaluations as markers."""
    import numpy as np
    from matplotlib.figure import Figure

    fig = Figure(figsize=TRAINING_INCHES, dpi=DPI, layout="constrained")
    loss_ax, acc_ax = fig.subplots(1, 2)
    for pictures in sorted({r["pictures"] for r in rows}):
        batch = [r for r in rows if r["pictures"] == pictures]
        steps = np.asarray([r["step"] for r in batch])
        width = min(TRAINING_SMOOTHING, len(batch))
        label = "single picture" if pictures == 1 else f"up to {pictures} pictures"
        for ax, key in ((loss_ax, "loss"), (acc_ax, "accuracy")):
            smooth = np.convolve([r[key] for r in batch], np.ones(width) / width, mode="valid")
            ax.plot(steps[width - 1:], smooth, label=f"train, {label} ({width}-batch mean)")
    for key, label, marker in (("heldout_accuracy", "held-out", "o"), ("combination_accuracy", "held-out pair", "s")):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            acc_ax.plot(*zip(*points), marker=marker, linestyle="--", label=f"{label} (teacher-forced)")
    loss_ax.set_ylabel("answer-token cross-entropy")
    acc_ax.set_ylabel("first answer token correct")
    acc_ax.set_ylim(-0.03, 1.03)
    for ax in (loss_ax, acc_ax):
        ax.set_xlabel("stage-1 step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.suptitle(title)
    return fig


def cmd_training(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    output = args.output or os.path.splitext(args.log)[0] + ".png"
    rows = read_training_log(args.log)  # first: a missing log is named as such, not by its default output
    _check_output(output)
    evaluated = [r for r in rows if "heldout_accuracy" in r]
    last = f"; last held-out {evaluated[-1]['heldout_accuracy']:.2f} at step {evaluated[-1]['step']}" if evaluated else ""
    _save_png(draw_training(rows, args.title or os.path.basename(args.log)), output)
    print(f"wrote {output}: steps {rows[0]['step']}-{rows[-1]['step']}{last}")
    return 0


def _spans(mask) -> list[tuple[int, int]]:
    """bool [L] -> [(start, end)] of its runs of True (end exclusive)."""
    spans, start = [], None
    for i, flag in enumerate(list(mask) + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            spans.append((start, i))
            start = None
    return spans


def draw_attention(received, is_image, summary: dict, title: str):
    """received [N, L] (A_s per layer), is_image [L] bool, summary from
    ``analysis.modality_summary``. Returns the matplotlib Figure: the modality of each position,
    a layers x positions heatmap of A_s (log colour scale), each modality's share of the
    attention mass per layer, and the attention per token and per query by modality."""
    import numpy as np
    from matplotlib.colors import ListedColormap, LogNorm
    from matplotlib.figure import Figure

    num_layers, length = received.shape
    fig = Figure(figsize=ATTENTION_INCHES, dpi=DPI, layout="constrained")
    fig.suptitle(title, fontsize="medium")
    grid = fig.add_gridspec(3, 2, height_ratios=[0.25, 4, 3])
    strip = fig.add_subplot(grid[0, :])
    heat = fig.add_subplot(grid[1, :], sharex=strip)
    share, per_token = fig.add_subplot(grid[2, 0]), fig.add_subplot(grid[2, 1])
    image_color, text_color = "tab:orange", "tab:blue"

    strip.imshow(np.asarray(is_image, float)[None], aspect="auto", cmap=ListedColormap([text_color, image_color]),
                 vmin=0, vmax=1,
                 interpolation="nearest", extent=(-0.5, length - 0.5, 0, 1))
    for start, end in _spans(is_image):
        strip.text((start + end - 1) / 2, 0.5, f"image ({end - start} tokens)", ha="center", va="center",
                   fontsize="small")
    strip.set_yticks([])
    strip.set_title("prompt tokens: image (orange) and text (blue)", fontsize="small", loc="left")
    strip.tick_params(labelbottom=False)

    positive = received[received > 0]
    norm = LogNorm(vmin=max(float(np.percentile(positive, 1)), 1e-6), vmax=float(positive.max()))
    mesh = heat.imshow(np.maximum(received, norm.vmin), aspect="auto", norm=norm, cmap="viridis",
                       interpolation="nearest", origin="lower", extent=(-0.5, length - 0.5, -0.5, num_layers - 0.5))
    for start, end in _spans(is_image):
        for x in (start - 0.5, end - 0.5):
            heat.axvline(x, color="white", linestyle=":", linewidth=1)
    heat.set_xlabel("prompt position")
    heat.set_ylabel("layer")
    heat.set_title("attention received A_s (eq. 4: column sums of the softmax, mean over heads), log scale",
                   fontsize="small", loc="left")
    fig.colorbar(mesh, ax=heat, label="A_s", pad=0.01)

    layers = np.arange(num_layers)
    share.plot(layers, summary["image_share"], color=image_color, marker=".", label="image tokens")
    share.plot(layers, summary["text_share"], color=text_color, marker=".", label="text tokens (without the first)")
    share.plot(layers, summary["first_share"], color="gray", marker=".", label="first token (attention sink)")
    share.axhline(summary["image_token_share"], color=image_color, linestyle="--", linewidth=1,
                  label=f"image share of the tokens ({summary['image_token_share']:.0%})")
    share.set_ylim(0, 1)
    share.set_xlabel("layer")
    share.set_ylabel("share of all attention received")
    share.grid(alpha=0.3)
    share.legend(fontsize="x-small")

    per_token.semilogy(layers, summary["image_per_query"], color=image_color, marker=".", label="image token")
    per_token.semilogy(layers, summary["text_per_query"], color=text_color, marker=".",
                       label="text token (without the first)")
    per_token.set_xlabel("layer")
    per_token.set_ylabel("mean A_s[j] / queries that see j")
    per_token.grid(alpha=0.3, which="both")
    per_token.legend(fontsize="x-small")
    return fig


def cmd_attention(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import numpy as np

    import lookm_jax
    from lookm_jax.analysis import attention_received, modality_summary

    _check_output(args.output)
    prompt = read_prompt(args)
    images = default_images(args)
    check_image_markers(prompt, len(images))
    model = lookm_jax.load(args.model) if args.model else lookm_jax.load_default()
    pixel_values, tiles = model.preprocess_images(images) if images else (None, None)
    input_ids = model.encode_chat(prompt, num_images=len(images), image_tiles=tiles)
    received = attention_received(model, input_ids, pixel_values)  # [N, L]
    is_image = (input_ids[0] == model.config.image_token_id) if model.is_multimodal else np.zeros(input_ids.shape[1], bool)
    summary = modality_summary(received, is_image)
    title = (f"{os.path.basename(args.model) if args.model else 'demo model (SmolLM2-135M + scene-trained CLIP)'}: "
             f"{len(images)} image(s), prompt {prompt[:60]!r}")
    _save_png(draw_attention(received, is_image, summary, title), args.output)
    n_image = int(is_image.sum())
    print(f"wrote {args.output}: {received.shape[0]} layers x {received.shape[1]} prompt tokens "
          f"({n_image} image, {received.shape[1] - n_image} text)")
    print("layer | image share of A_s | text share (w/o first token) | first token | per query: text / image")
    for i in range(received.shape[0]):
        ratio = (f"{summary['text_per_query'][i] / summary['image_per_query'][i]:8.2f}x" if n_image
                 else "n/a (no image tokens)")
        print(f"{i:5d} | {summary['image_share'][i]:18.3f} | {summary['text_share'][i]:28.3f} | "
              f"{summary['first_share'][i]:11.3f} | {ratio}")
    print(f"mean  | {summary['image_share'].mean():18.3f} | {summary['text_share'].mean():28.3f} | "
          f"{summary['first_share'].mean():11.3f} | image tokens are {summary['image_token_share']:.1%} of the prompt")
    return 0


def add_parser(subparsers) -> None:
    """Adds `sweep`, `attention` and `training` to the `lookm plot` command group."""
    s = subparsers.add_parser("sweep", help="accuracy (or fidelity) vs KV budget per method, one panel per length")
    s.add_argument("results", help=f"sweep CSV with the columns {','.join(SWEEP_COLUMNS)}")
    s.add_argument("--metric", choices=METRICS, default="accuracy", help="what the y axis shows")
    s.add_argument("--output", type=path_arg, help="PNG file (default: RESULTS with .png, or _fidelity.png for --metric fidelity)")
    s.set_defaults(func=cmd_sweep)
    a = subparsers.add_parser("attention", help="attention each prompt token receives per layer, by modality")
    add_prompt_arguments(a)
    a.add_argument("--output", type=path_arg, default="attention_by_modality.png", help="PNG file")
    a.set_defaults(func=cmd_attention)
    t = subparsers.add_parser("training", help="loss and accuracy vs step of a `lookm train vision` log")
    t.add_argument("log", help="the run's log.jsonl")
    t.add_argument("--output", type=path_arg, help="PNG file (default: LOG with .png)")
    t.add_argument("--title", help="figure title (default: the log's file name)")
    t.set_defaults(func=cmd_training)
