"""The bench scripts refuse bad arguments with argparse's one-line error (exit 2) before they load
or measure anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.mark.parametrize("script, argv, message", [
    ("decode_cpu.py", ["--new-tokens", "0"], "argument --new-tokens: must be an integer >= 1, got 0"),
    ("decode_cpu.py", ["--lengths", "10"], "argument --lengths: must be an integer >= 64, got 10"),
    ("compress_cpu.py", ["--length", "10"], "argument --length: must be an integer >= 256, got 10"),
    ("compress_cpu.py", ["--repeats", "0"], "argument --repeats: must be an integer >= 1, got 0"),
    ("compress_cpu.py", ["--json", "/nonexistent/x.json"], "argument --json: must be a file in an existing folder"),
    ("compile_cpu.py", ["--models", "Bogus"], "argument --models: invalid choice: 'Bogus'"),
    ("compile_cpu.py", ["--memory-lengths", "-5"], "argument --memory-lengths: must be an integer >= 64, got -5"),
    ("gpu.py", ["--tiny", "--long-lengths", "100"], "--long-lengths must each be >= 150"),
    ("gpu.py", ["--tiny", "--json", BENCH], "argument --json: must be a file in an existing folder"),
    ("sizes.py", ["--prompt", "100"], "--prompt must be more than 3699 tokens (LLaVA-OneVision-7B's one image), got 100"),
    ("sizes.py", ["--budgets", "0.2", "1.5"], "argument --budgets: budget must be a fraction in (0, 1], got 1.5"),
    ("merge_analysis.py", ["--pictures", "1"], "--pictures must be in [2, 16], got 1"),
    ("merge_analysis.py", ["--budgets", "nan"], "argument --budgets: budget must be a fraction in (0, 1], got nan"),
    ("picture_coverage.py", ["--pictures", "1"], "--pictures must be in [2, 16], got 1"),
    ("picture_coverage.py", ["--methods", "lookm_quota:picture_balance=True", "bogus"], "--methods: "),
    ("peers_kvpress.py", ["--seed", "-1"], "argument --seed: must be an integer in [0, 4294967295], got -1"),
    ("ask_cpu.py", ["--question-tokens", "0"], "argument --question-tokens: must be an integer >= 1, got 0"),
    ("ask_cpu.py", ["--budget", "1.5"], "argument --budget: budget must be a fraction in (0, 1], got 1.5"),
    ("kept_selection.py", ["--pictures", "1"], "--pictures must be in [2, 16], got 1"),
    ("kept_selection.py", ["--methods", "h2o", "bogus"], "--methods: unknown method 'bogus'"),
    ("kept_selection.py", ["--tasks", "needle"], "argument --tasks: invalid choice: 'needle'"),
    ("oracle_tokens.py", ["--learning-rate", "0"], "argument --learning-rate: must be a finite number > 0, got 0"),
    ("accuracy_by_picture.py", ["--jsonl", "/nonexistent/rows.jsonl"], "--jsonl: no such file '/nonexistent/rows.jsonl'"),
    ("accuracy_by_picture.py", ["--jsonl", "accuracy_by_picture.py"], "--jsonl: "),
    ("accuracy_by_picture.py", ["--jsonl", "x", "--budgets", "0"], "argument --budgets: budget must be a fraction"),
    ("adapter_scale.py", ["--scales", "1", "nan"], "--scales must be finite numbers > 0, got [1.0, nan]"),
    ("adapter_scale.py", ["--scales", "1", "--layers", "5", "3"], "--layers needs FIRST <= LAST, got [5, 3]"),
])
def test_bench_scripts_refuse_bad_arguments(script, argv, message):
    proc = subprocess.run([sys.executable, script, *argv], cwd=BENCH, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and message in lines[-1] and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_accuracy_by_picture_splits_by_the_named_picture(tmp_path):
    """Rows marked correct exactly when their question names picture 3 (read from the question's own
    text) come out 1.0 at picture 3 and 0.0 at every other picture asked about."""
    import json
    import re

    from lookm_jax.eval import scenes as bench

    rows, named = [], []
    for sample in range(12):
        question = bench.task_sample("picture_shape", 4, 5, sample).questions[0]
        named.append(int(re.search(r"picture (\d+)", question.text).group(1)))
        rows.append({"seed": 5, "pictures": 4, "task": "picture_shape", "asked": "after compression", "sample": sample,
                     "prompt_tokens": 300, "label": "H2O", "method": "h2o", "text_prior": "", "merge": "",
                     "budget": 0.2, "answer": question.answer, "output": "", "correct": named[-1] == 3,
                     "fidelity": 1.0})
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "by_picture.json"
    proc = subprocess.run([sys.executable, "accuracy_by_picture.py", "--jsonl", str(path), "--json", str(out)],
                          cwd=BENCH, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (result,) = json.loads(out.read_text())
    assert result["questions"] == [named.count(k) for k in (1, 2, 3, 4)] and named.count(3) > 0
    assert result["accuracy"] == [None if not named.count(k) else float(k == 3) for k in (1, 2, 3, 4)]
    assert "| H2O | 0.2 | 4 |" in proc.stdout
