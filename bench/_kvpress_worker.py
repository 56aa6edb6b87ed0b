"""kvpress side of bench/peers_kvpress.py; runs inside bench/.venv-kvpress (kvpress, its own transformers).

    python _kvpress_worker.py JOB.json OUT.jsonl

JOB.json: {"gguf": path, "eos_ids": [...], "max_new_tokens": n, "samples": path of a JSONL of
{"context_ids": [...], "question_ids": [...]} (token ids made by lookm-jax's tokenizer; the prompt is
their concatenation), "cells": [{"method": name or "full", "budget": kept fraction or null,
"mode": "full" | "in_context" | "query_agnostic"}, ...], "threads": torch threads or null for torch's default}.
Appends one JSON line per (cell, sample) to OUT.jsonl: the greedy tokens, the cache length after
compression, prefill seconds and the decode loop's seconds (every token after the first).

Modes: "in_context" compresses the whole prompt, question included (as LOOK-M does);
"query_agnostic" compresses only the context and then feeds the question on the compressed cache
(kvpress's pipeline default); "full" runs the whole prompt without a press.
Decoding follows KVPressTextGenerationPipeline.generate_answer: greedy, one token per forward,
RoPE positions continuing from the uncompressed prompt length.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch
from kvpress import ObservedAttentionPress, SnapKVPress, StreamingLLMPress
from transformers import AutoModelForCausalLM, DynamicCache

# lookm-jax method name -> the kvpress press that does the same (H2O ~ ObservedAttentionPress).
PRESSES = {"snapkv": SnapKVPress, "streamingllm": StreamingLLMPress, "h2o": ObservedAttentionPress}


def load_model(gguf_path: str):
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                                 dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def make_press(cell: dict):
    if cell["mode"] == "full":
        return None
    return PRESSES[cell["method"]](compression_ratio=1.0 - cell["budget"])


@torch.no_grad()
def generate(model, press, context_ids: list[int], question_ids: list[int], query_agnostic: bool,
             eos_ids: set[int], max_new_tokens: int) -> dict:
    """Prefill (compressing with `press`), then greedy decode; returns tokens, kept length, timings."""
    prompt = context_ids if query_agnostic else context_ids + question_ids
    cache = DynamicCache()
    start = time.perf_counter()
    # ObservedAttentionPress reads the attention weights, which only eager attention returns.
    model.set_attn_implementation("eager" if isinstance(press, ObservedAttentionPress) else "sdpa")
    with press(model) if press is not None else contextlib.nullcontext():
        out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, logits_to_keep=1)
    model.set_attn_implementation("sdpa")
    kept = cache.get_seq_length()
    position = len(prompt)
    if query_agnostic:  # the question goes on top of the compressed context, uncompressed
        positions = torch.arange(position, position + len(question_ids))[None]
        out = model(input_ids=torch.tensor([question_ids]), past_key_values=cache, position_ids=positions,
                    logits_to_keep=1)
        position += len(question_ids)
    tokens = [int(out.logits[0, -1].argmax())]
    prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    while len(tokens) < max_new_tokens and tokens[-1] not in eos_ids:
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                    position_ids=torch.tensor([[position]]))
        position += 1
        tokens.append(int(out.logits[0, -1].argmax()))
    decode_seconds = time.perf_counter() - start
    return {"tokens": tokens, "kept": kept, "prefill_s": prefill_seconds, "decode_s": decode_seconds}


def main() -> None:
    job_path, out_path = sys.argv[1:3]
    with open(job_path) as f:
        job = json.load(f)
    with open(job["samples"]) as f:
        samples = [json.loads(line) for line in f]
    if job["threads"]:
        torch.set_num_threads(job["threads"])
    model = load_model(job["gguf"])
    eos_ids = set(job["eos_ids"])
    # One untimed warm-up so that allocator and thread-pool start-up land in no cell.
    generate(model, None, samples[0]["context_ids"], samples[0]["question_ids"], False, eos_ids, 2)
    with open(out_path, "a") as out:
        for cell in job["cells"]:
            press = make_press(cell)
            for index, sample in enumerate(samples):
                result = generate(model, press, sample["context_ids"], sample["question_ids"],
                                  cell["mode"] == "query_agnostic", eos_ids, job["max_new_tokens"])
                out.write(json.dumps({**cell, "sample": index, **result}) + "\n")
                out.flush()
            print(f"kvpress {cell}: done at {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
