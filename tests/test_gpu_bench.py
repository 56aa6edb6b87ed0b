"""bench/gpu.py --tiny: the accelerator benchmark runs end to end on CPU, so it is ready before a GPU is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def test_gpu_bench_runs_tiny(tmp_path):
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, "gpu.py", "--tiny", "--repeats", "1", "--new-tokens", "4", "--long-lengths", "512",
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=BENCH, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert [r["cache"] for r in figures["caches"]] == ["full", "LOOK-M 20%", "LOOK-M 5%"]
    full, lookm20, lookm5 = figures["caches"]
    assert full["cache_bytes"] > lookm20["cache_bytes"] > lookm5["cache_bytes"]
    assert all(r["decode_ms"] > 0 and r["roofline_ms"] > 0 and r["prefill_s"] > 0 for r in figures["caches"])
    assert figures["prompt_tokens"] == 256 and figures["long"][0]["length"] == 512
    assert "LOOK-M 20%" in proc.stdout
