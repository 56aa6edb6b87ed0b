"""bench/sizes.py end to end: its table, from the converter's shapes and the compiled prefill's
abstract cache, holds the published sizes of the paper's models."""

from __future__ import annotations

import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def test_sizes_table_matches_the_published_models():
    proc = subprocess.run([sys.executable, "sizes.py", "--prompt", "4096", "--new-tokens", "64", "--budgets", "0.2"],
                          cwd=BENCH, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [[c.strip() for c in line.strip("| ").split(" | ")] for line in proc.stdout.splitlines()
             if line.startswith("| ") and "---" not in line]
    rows = {cells[0]: cells[1:] for cells in table[1:]}  # after the header
    # HF's model cards: llava-1.5-7b-hf 7.06 B parameters, llava-1.5-13b-hf 13.4 B.
    assert rows["LLaVA-v1.5-7B"][1] == "7.063 B" and rows["LLaVA-v1.5-13B"][1].startswith("13.35")
    # K and V per token, bf16: layers x KV heads x head_dim x 2 x 2 bytes.
    assert rows["LLaVA-v1.5-7B"][2] == f"{32 * 32 * 128 * 4 // 1024} KiB"
    assert rows["LLaVA-v1.5-13B"][2] == f"{40 * 40 * 128 * 4 // 1024} KiB"
    assert rows["MobileVLM-V2-3B"][2] == f"{32 * 32 * 80 * 4 // 1024} KiB"
    # Slots per head: the whole prompt + new tokens, and LOOK-M's 20% of the prompt + new tokens.
    # (the 20% split evenly into recent and important slots, each rounded down: 2 x 409 of 4096).
    kept = 2 * int(0.1 * 4096) + 64
    assert all(r[3].endswith(f"({4096 + 64})") and f"({kept}, " in r[4] for r in rows.values()), rows
    # Qwen/Qwen2-VL-7B-Instruct: 8.29 B parameters on its model card;
    # 28 layers x 4 KV heads x 128; a 672 x 672 picture is 48 x 48 patches, merged 2 x 2: 576 tokens.
    assert rows["Qwen2-VL-7B"][1] == "8.291 B" and rows["Qwen2-VL-7B"][2] == f"{28 * 4 * 128 * 4 // 1024} KiB"
    # Qwen/Qwen2.5-VL-7B-Instruct: 8.29 B on its model card (8,292,166,656 counted on HF's own model
    # built on the meta device from that config); the decoder and the picture's tokens are Qwen2-VL-7B's.
    assert rows["Qwen2.5-VL-7B"][1] == "8.292 B" and rows["Qwen2.5-VL-7B"][2] == rows["Qwen2-VL-7B"][2]
    # llava-hf/llava-v1.6-vicuna-7b-hf: 7.06 B on its model card (HF's model on the meta device counts
    # 7,063,431,168, CLIP's unused post_layernorm included: 2048 more than ours); LLaVA-1.5-7B's KV; a
    # 672 x 672 picture: 576 base features + a 2 x 2 grid's 48 x 48 map, each row with its newline.
    assert rows["LLaVA-NeXT-7B"][1] == "7.063 B" and rows["LLaVA-NeXT-7B"][2] == rows["LLaVA-v1.5-7B"][2]
    # llava-hf/llava-onevision-qwen2-7b-ov-hf: 8.03 B on its model card (HF's model on the meta device
    # counts 8,030,807,584, SigLIP's unused post_layernorm included: 2304 more than ours); Qwen2-7B's
    # 28 layers x 4 KV heads x 128; a 672 x 672 picture: 729 base features + a 2 x 2 grid's 54 x 54 map
    # (under anyres_max_9's 9 x 729: not downsampled), each row with its newline.
    assert rows["LLaVA-OneVision-7B"][1] == "8.031 B" and rows["LLaVA-OneVision-7B"][2] == rows["Qwen2-VL-7B"][2]
    assert [r[5] for r in rows.values()] == ["576", "576", "144", "576", "576", f"{576 + 48 * 49}",
                                             f"{729 + 54 * 55}", "576"]
    assert len(rows) == 8
