"""`lookm plot sweep` / `lookm plot attention` / `lookm plot training` and the per-layer attention they draw from."""

from __future__ import annotations

import csv
import os
import re
import struct

import chex
import numpy as np
import pytest
import torch

import lookm_jax
from lookm_jax.errors import InputError
from conftest import image_ids, tiny_llava
from lookm_jax import cli, cli_args, plots
from lookm_jax.analysis import attention_received, modality_summary

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; fails on anything that is not a PNG."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def hf_attention_received(hf, ids, pixels) -> np.ndarray:
    """Independent reference: HF eager attention probabilities [B, H, L, L] of every layer,
    summed over queries and averaged over heads in float64 -> [N, L]."""
    hf.set_attn_implementation("eager")
    with torch.no_grad():
        out = hf(input_ids=torch.as_tensor(ids, dtype=torch.long), pixel_values=torch.as_tensor(pixels),
                 output_attentions=True)
    return np.stack([a[0].double().numpy().sum(axis=1).mean(axis=0) for a in out.attentions])


def test_attention_received_matches_hf_eager_attention(tmp_path, rng):
    hf = tiny_llava(tmp_path, heads=4, kv_heads=2, layers=3)  # GQA, 2 query heads per KV head
    model = lookm_jax.load(str(tmp_path))
    per_image = model.config.image_seq_length  # 25
    segments = [3, 17]
    for i in range(11):  # 11 images: 300 tokens, two query blocks of the prefill attention, bucket 384
        segments += ["img", 20 + i]
    ids = image_ids(per_image, segments + [40, 41, 42])[None]
    pixels = rng.standard_normal((11, 3, 30, 30)).astype(np.float32)
    ours = attention_received(model, ids, pixels)
    chex.assert_shape(ours, (3, ids.shape[1]))
    chex.assert_type(ours, np.float32)
    np.testing.assert_allclose(ours, hf_attention_received(hf, ids, pixels), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(ours.sum(axis=1), ids.shape[1], rtol=1e-5)  # every softmax row sums to 1


def test_attention_received_takes_one_prompt(tmp_path):
    tiny_llava(tmp_path)
    model = lookm_jax.load(str(tmp_path))
    with pytest.raises(ValueError, match="one prompt"):
        attention_received(model, np.ones((2, 8), np.int32))
    limit = model.text_config.max_position_embeddings
    model.buckets = (*model.buckets, limit + 64)  # a bucket beyond the context: the context is the limit
    with pytest.raises(InputError, match=f"exceed the model's context length \\({limit}"):
        attention_received(model, np.ones((1, limit + 1), np.int32))
    with pytest.raises(InputError, match="input_ids must be integer token ids"):
        attention_received(model, np.ones((1, 8), np.float32))


def test_modality_summary_against_direct_sums():
    received = np.array([[4.0, 1.0, 2.0, 1.0], [1.0, 2.0, 0.5, 0.5]])  # [N=2, L=4]
    is_image = np.array([False, True, True, False])
    s = modality_summary(received, is_image)
    np.testing.assert_allclose(s["image_share"], [3 / 8, 2.5 / 4])
    np.testing.assert_allclose(s["text_share"], [1 / 8, 0.5 / 4])
    np.testing.assert_allclose(s["first_share"], [4 / 8, 1 / 4])
    np.testing.assert_allclose(s["image_per_query"], [(1 / 3 + 2 / 2) / 2, (2 / 3 + 0.5 / 2) / 2])
    np.testing.assert_allclose(s["text_per_query"], [1.0, 0.5])
    assert s["image_token_share"] == 0.5


def write_sweep(path, rng, lengths=(1024, 2048), columns=plots.SWEEP_COLUMNS):
    """A sweep CSV of random metrics: full cache + three configurations x four budgets per length."""
    configs = [("H2O", "h2o", "", ""), ("LOOK-M (text-prior, pivotal)", "lookm", "True", "pivotal"),
               ("StreamingLLM", "streamingllm", "", "")]
    rows = []
    for length in lengths:
        rows.append(dict(label="full cache", method="full", text_prior="", merge="", budget=1.0, length=length))
        for label, method, text_prior, merge in configs:
            for budget in (0.05, 0.1, 0.2, 0.5):
                rows.append(dict(label=label, method=method, text_prior=text_prior, merge=merge, budget=budget,
                                 length=length))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "samples": 50, "accuracy": rng.uniform(), "fidelity": rng.uniform()})


@pytest.mark.parametrize("metric", plots.METRICS)
def test_plot_sweep_writes_a_png_of_the_expected_size(tmp_path, rng, metric, capsys):
    results = tmp_path / "sweep.csv"
    write_sweep(results, rng, lengths=(1024, 2048, 4096))
    assert cli.main(["plot", "sweep", str(results), "--metric", metric]) == 0
    out = tmp_path / ("sweep.png" if metric == "accuracy" else "sweep_fidelity.png")
    width, height = plots.sweep_figsize(3)
    assert png_size(out) == (round(width * plots.DPI), round(height * plots.DPI))
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # an ordinary new file, not a private temp file
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["sweep.csv", out.name])
    assert "4 configurations, lengths 1024, 2048, 4096" in capsys.readouterr().out


def test_plot_sweep_refuses_missing_columns_and_writes_nothing(tmp_path, rng, capsys):
    results = tmp_path / "sweep.csv"
    write_sweep(results, rng, columns=[c for c in plots.SWEEP_COLUMNS if c not in ("fidelity", "budget")])
    out = tmp_path / "out.png"
    assert cli.main(["plot", "sweep", str(results), "--output", str(out)]) == 2
    assert "missing column(s) budget, fidelity" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [results]


@pytest.mark.parametrize("bad, message", [({"accuracy": "1.5"}, "accuracy 1.5 is outside [0, 1]"),
                                          ({"budget": "n/a"}, "line 3: could not convert"),
                                          ({"budget": "0"}, "budget 0.0 is outside (0, 1]"),
                                          ({"samples": "-4"}, "line 3: length and samples must be >= 1, got")])
def test_plot_sweep_refuses_bad_values(tmp_path, rng, bad, message, capsys):
    results = tmp_path / "sweep.csv"
    write_sweep(results, rng)
    lines = results.read_text().splitlines()
    row = dict(zip(plots.SWEEP_COLUMNS, lines[2].split(",")), **bad)  # line 3: the first non-full row
    lines[2] = ",".join(row[c] for c in plots.SWEEP_COLUMNS)
    results.write_text("\n".join(lines) + "\n")
    assert cli.main(["plot", "sweep", str(results), "--output", str(tmp_path / "out.png")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out.png").exists()


def test_plot_sweep_reports_a_missing_or_binary_file(tmp_path, capsys):
    assert cli.main(["plot", "sweep", str(tmp_path / "none.csv")]) == 2
    assert "no sweep results at" in capsys.readouterr().err
    (tmp_path / "binary.csv").write_bytes(b"label,\xff\xfe\n")
    assert cli.main(["plot", "sweep", str(tmp_path / "binary.csv")]) == 2
    assert "binary.csv: not a UTF-8 text file" in capsys.readouterr().err


def test_plot_sweep_reads_a_csv_with_a_byte_order_mark(tmp_path, rng, capsys):
    results = tmp_path / "sweep.csv"
    write_sweep(results, rng)
    results.write_bytes(b"\xef\xbb\xbf" + results.read_bytes())  # as Excel saves a CSV
    assert cli.main(["plot", "sweep", str(results)]) == 0
    assert "4 configurations, lengths 1024, 2048" in capsys.readouterr().out
    png_size(tmp_path / "sweep.png")


@pytest.mark.parametrize("case, message", [
    ("short row", r"line 3: too few columns \(5 of the header's 9\)"),
    ("duplicate", r"lines 3 and 28: .*label 'H2O', budget 0\.05, length 1024; .*one row per \(label, budget, length\)"),
    ("too many lengths", rf"{plots.MAX_SWEEP_LENGTHS + 1} prompt lengths; .*at most {plots.MAX_SWEEP_LENGTHS}\b"),
])
def test_plot_sweep_refuses_short_rows_repeated_keys_and_too_many_panels(tmp_path, rng, case, message, capsys):
    results = tmp_path / "sweep.csv"
    lengths = range(100, 100 * (plots.MAX_SWEEP_LENGTHS + 2), 100) if case == "too many lengths" else (1024, 2048)
    write_sweep(results, rng, lengths=lengths)
    lines = results.read_text().splitlines()
    if case == "short row":
        lines[2] = ",".join(lines[2].split(",")[:5])
    elif case == "duplicate":
        lines.append(lines[2])  # line 28: the same (label, budget, length) with other metrics
    results.write_text("\n".join(lines) + "\n")
    assert cli.main(["plot", "sweep", str(results), "--output", str(tmp_path / "out.png")]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1, err
    assert os.listdir(tmp_path) == ["sweep.csv"]


def test_plot_refuses_a_directory_as_output(tmp_path, rng, capsys):
    results = tmp_path / "sweep.csv"
    write_sweep(results, rng)
    (tmp_path / "adir.png").mkdir()
    assert cli.main(["plot", "sweep", str(results), "--output", str(tmp_path / "adir.png")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"adir\.png is a folder; give a file path", err) and ".tmp" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["adir.png", "sweep.csv"] and not os.listdir(tmp_path / "adir.png")


def test_save_png_renders_before_it_creates_a_file(tmp_path):
    """A kill while drawing (SIGTERM runs no Python cleanup) finds no temporary file on disk."""
    on_disk = []

    class Figure:
        def savefig(self, f, **kwargs):
            on_disk.append(os.listdir(tmp_path))
            f.write(PNG_SIGNATURE)

    plots._save_png(Figure(), str(tmp_path / "out.png"))
    assert on_disk == [[]]
    assert os.listdir(tmp_path) == ["out.png"] and (tmp_path / "out.png").read_bytes() == PNG_SIGNATURE


def test_plot_attention_on_the_demo_model(tmp_path, capsys):
    out = tmp_path / "attention.png"
    assert cli.main(["plot", "attention", "--image", cli_args.DEFAULT_IMAGES[1], "--prompt", "Describe it.",
                     "--output", str(out)]) == 0
    assert png_size(out) == tuple(round(x * plots.DPI) for x in plots.ATTENTION_INCHES)
    printed = capsys.readouterr().out
    assert "30 layers x" in printed and "(64 image," in printed
    shares = [line.split("|") for line in printed.splitlines() if line.strip()[:1].isdigit()]
    assert len(shares) == 30
    for image, text, first in ((float(c) for c in row[1:4]) for row in shares):
        assert image + text + first == pytest.approx(1.0, abs=2e-3)  # 3 decimals each


def test_plot_attention_without_image_tokens_prints_no_ratio(tmp_path, capsys):
    from convert.gguf import smollm2_gguf_path

    out = tmp_path / "attention.png"
    assert cli.main(["plot", "attention", "--model", smollm2_gguf_path(), "--prompt", "hi", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.strip()[:1].isdigit()]
    assert "(0 image," in printed and len(rows) == 30 and "nan" not in printed.lower()
    assert all(row.endswith("| n/a (no image tokens)") for row in rows)
    png_size(out)


def _training_log(path, rng, steps: int = 40) -> None:
    """A `lookm train vision` log: two stage-0 records, then stage-1 steps (every 4th multi-picture),
    held-out evaluations every 10 steps."""
    import json

    records = [{"pretrain_step": s, "loss": 1.0, "shape_accuracy": 0.5} for s in (1, 2)]
    for step in range(1, steps + 1):
        record = {"step": step, "loss": float(rng.uniform(0.2, 2)), "accuracy": float(rng.uniform()),
                  "image_norm": 0.5, "pictures": 8 if step % 4 == 0 else 1, "seconds": step * 10.0}
        if step % 10 == 0:
            record.update(heldout_accuracy=step / 100, combination_accuracy=0.1)
        records.append(record)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_plot_training_writes_a_png_and_reports_the_last_evaluation(tmp_path, rng, capsys):
    log = tmp_path / "log.jsonl"
    _training_log(log, rng)
    rows = plots.read_training_log(str(log))
    assert [r["step"] for r in rows] == list(range(1, 41))  # stage-0 records skipped
    log.write_text(log.read_text() + '{"step": 41, "lo')  # a run still writing its last line
    assert len(plots.read_training_log(str(log))) == 40
    assert cli.main(["plot", "training", str(log)]) == 0
    width, height = plots.TRAINING_INCHES
    assert png_size(tmp_path / "log.png") == (round(width * plots.DPI), round(height * plots.DPI))
    assert "steps 1-40; last held-out 0.40 at step 40" in capsys.readouterr().out


def test_plot_training_refuses_a_bad_log_and_writes_nothing(tmp_path, rng, capsys):
    log = tmp_path / "log.jsonl"
    _training_log(log, rng)
    text = log.read_text()
    for bad in ('{"step": 41, "loss": 0.3}', '{"step": 41, "loss": "low", "accuracy": 0.5, "pictures": 1}'):
        log.write_text(text + bad + "\n")
        assert cli.main(["plot", "training", str(log), "--output", str(tmp_path / "out.png")]) == 2
        assert "line 43: a stage-1 record has the numbers step, loss, accuracy and pictures" in capsys.readouterr().err
    log.write_text("not json\n")
    assert cli.main(["plot", "training", str(log), "--output", str(tmp_path / "out.png")]) == 2
    assert "line 1: not JSON" in capsys.readouterr().err
    log.write_text("3\n")
    assert cli.main(["plot", "training", str(log), "--output", str(tmp_path / "out.png")]) == 2
    assert "line 1: a record is a JSON object, got '3'" in capsys.readouterr().err
    log.write_bytes(b"\xff\xfe\x00\n")
    assert cli.main(["plot", "training", str(log), "--output", str(tmp_path / "out.png")]) == 2
    assert "not a text file" in capsys.readouterr().err
    assert cli.main(["plot", "training", str(tmp_path / "none.jsonl")]) == 2
    assert "no training log at" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]


@pytest.mark.parametrize("bad, message", [
    ('"heldout_accuracy": "high"', r'heldout_accuracy is "high", not a number in \[0, 1\]'),
    ('"combination_accuracy": -0.1', r"combination_accuracy is -0\.1, not a number in \[0, 1\]"),
    ('"loss": NaN', r"loss is NaN, not a number >= 0"),
    ('"loss": Infinity', r"loss is Infinity, not a number >= 0"),
    ('"accuracy": 1.5', r"accuracy is 1\.5, not a number in \[0, 1\]"),
    ('"pictures": -1', r"pictures is -1, not an integer >= 1"),
    ('"step": -3', r"step is -3, not an integer >= 1"),
    ('"step": 41.5', r"step is 41\.5, not an integer >= 1"),
    ('"step": 40', r"step 40 after step 40; steps increase"),
    ('"step": 5', r"step 5 after step 40; steps increase"),
])
def test_plot_training_refuses_a_field_out_of_range_and_writes_nothing(tmp_path, rng, bad, message, capsys):
    import json

    log = tmp_path / "log.jsonl"
    _training_log(log, rng)
    record = json.loads(f'{{"step": 41, "loss": 0.3, "accuracy": 0.5, "pictures": 1, {bad}}}')
    log.write_text(log.read_text() + json.dumps(record) + "\n")  # line 43
    assert cli.main(["plot", "training", str(log), "--output", str(tmp_path / "out.png")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"^lookm: error: .*log\.jsonl, line 43: .*" + message, err) and err.count("\n") == 1, err
    assert os.listdir(tmp_path) == ["log.jsonl"]
