"""SmolLM2-135M decode and prefill on this CPU: lookm-jax vs HF transformers (PyTorch), side by side.

    python bench/decode_cpu.py [--lengths 512 2048] [--new-tokens 64] [--json PATH]

Each engine runs in its own subprocess (so peak RSS is its own); the parent also measures this
machine's memory read bandwidth and prints the decode roofline, tokens/s = bandwidth / bytes read
per step (all weights, the tied head included, plus the KV cache). XLA:CPU's batch-1 dots and cache
attention do not stream at that bandwidth, so the same run also times those kernels alone
(`weight_dots_time`, once, and `cache_attention_time` per length) and prints the bound they set and decode's share of it. Compile time is
reported apart from steady-state time. Needs the test extra (torch) for the HF side.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench_args import at_least, json_path

WORDS = ("river mountain bread window garden music winter paper silver forest market candle ocean letter "
         "bridge quiet bright old busy cold morning evening station harbour library orchard").split()


def prompt_ids(tokenizer, length: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    text = " ".join(f"The {rng.choice(WORDS)} near the {rng.choice(WORDS)} was {rng.choice(WORDS)}."
                    for _ in range(length))
    return tokenizer.encode(text, add_special_tokens=False).ids[:length]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_ours(lengths, new_tokens) -> dict:
    import dataclasses

    import lookm_jax
    from lookm_jax.convert.gguf import smollm2_gguf_path

    out = {}
    with tempfile.TemporaryDirectory() as cache:
        os.environ["LOOKM_CACHE"] = cache
        start = time.perf_counter()
        lookm_jax.load_default()
        out["load_default_cold_s"] = time.perf_counter() - start
        start = time.perf_counter()
        lookm_jax.load_default()
        out["load_default_warm_s"] = time.perf_counter() - start
    model = lookm_jax.load(smollm2_gguf_path())
    model = dataclasses.replace(model, config=dataclasses.replace(model.config, eos_token_ids=()))  # run all steps
    for length in lengths:
        ids = np.asarray([prompt_ids(model.tokenizer, length)], np.int32)
        first = model.run(ids, max_new_tokens=new_tokens)
        runs = [model.run(ids, max_new_tokens=new_tokens) for _ in range(2)]
        best = min(runs, key=lambda r: r.prefill_seconds + r.decode_seconds)
        out[length] = {"compile_s": first.compile_seconds, "prefill_s": best.prefill_seconds,
                       "decode_tok_s": (new_tokens - 1) / best.decode_seconds, "kv_bytes": best.cache_bytes,
                       "kernels": cache_attention_time(model, best.cache_bytes)}
    dots = weight_dots_time(model)
    for length in lengths:
        out[length]["kernels"].update(dots)
    out["weight_bytes"] = sum(a.nbytes for a in __import__("jax").tree.leaves(model.params))
    out["peak_rss_mib"] = peak_rss_mib()
    return out


def _best_ms(fn, *args, repeats: int = 10) -> float:
    """Best of `repeats` calls of a jitted fn, after one warm-up call (its compile)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def weight_dots_time(model) -> dict:
    """Every batch-1 weight dot of the model alone (its own weights, the head included), as one
    jitted chain: each dot's input depends on the previous dot's output, as in a decode step, so
    they run one after the other, not side by side. The same for every prompt length."""
    import jax
    import jax.numpy as jnp

    from lookm_jax.models import llama

    def dots(weights):
        y = jnp.ones((1, 1), weights[0].dtype)
        for w in weights:
            y = llama.dense(jnp.ones((1, w.shape[1]), w.dtype) + 0 * y[:, :1], w)  # depends on the last dot
        return y

    text = model.params["text"]
    weights = [w.reshape(-1, w.shape[-1]) for lp in text["layers"] for name, w in lp.items()
               if name.startswith("w")]  # [out, in] (b_qkv is a bias)
    weights.append(text.get("lm_head", text["embed"]))
    dots_ms = _best_ms(jax.jit(dots), weights)
    return {"dots_ms": dots_ms, "dots_gbs": sum(w.nbytes for w in weights) / dots_ms / 1e6}


def cache_attention_time(model, kv_bytes: int) -> dict:
    """Every layer's decode attention alone over a full cache of `kv_bytes` (random K/V), chained
    like the dots of `weight_dots_time`."""
    import jax
    import jax.numpy as jnp

    from lookm_jax.models import llama, llava

    cfg, dtype = llava.text_config(model.config), model.params["text"]["embed"].dtype
    slots = kv_bytes // (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize)
    shape = (1, cfg.num_kv_heads, slots, cfg.head_dim)
    keys_shape = (1, cfg.num_kv_heads, cfg.head_dim, slots)  # the cache's key layout (lookm_jax.cache)
    cache = [jax.random.normal(jax.random.key(i), shape if i % 2 else keys_shape, dtype)
             for i in range(2 * cfg.num_layers)]
    own = jnp.ones((1, cfg.num_kv_heads, 1, cfg.head_dim), dtype)
    mask = jnp.ones(shape[:3], bool)

    def attention(q, kv):
        for k, v in zip(kv[::2], kv[1::2]):
            q = q + 0 * llama.attend_step(q, k, v, mask, own, own)  # depends on the last layer's output
        return q

    attention_ms = _best_ms(jax.jit(attention), jnp.ones((1, cfg.num_heads, 1, cfg.head_dim), dtype), cache)
    return {"attention_ms": attention_ms, "attention_gbs": kv_bytes / attention_ms / 1e6}


def run_hf(lengths, new_tokens) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from lookm_jax.convert.gguf import read_gguf, smollm2_gguf_path

    path = smollm2_gguf_path()
    tokenizer = read_gguf(path).tokenizer
    out = {}
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    out["load_s"] = time.perf_counter() - start
    for length in lengths:
        ids = torch.as_tensor([prompt_ids(tokenizer, length)])
        best = None
        for _ in range(2):
            with torch.no_grad():
                start = time.perf_counter()
                model(ids, logits_to_keep=1)
                prefill = time.perf_counter() - start
                start = time.perf_counter()
                model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=0)
                total = time.perf_counter() - start
            run = {"prefill_s": prefill, "decode_tok_s": (new_tokens - 1) / max(total - prefill, 1e-9)}
            best = run if best is None or run["prefill_s"] + 1 / run["decode_tok_s"] < best["prefill_s"] + 1 / best[
                "decode_tok_s"] else best
        out[length] = best
    out["peak_rss_mib"] = peak_rss_mib()
    return out


def read_bandwidth_gbs(n_bytes: int = 2**30) -> float:
    """Best of several full reads of a 1 GiB array by a jitted (multi-threaded) reduction."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((n_bytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        total(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return n_bytes / min(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=at_least(64), nargs="+", default=[512, 2048])
    parser.add_argument("--new-tokens", type=at_least(1), default=64)
    parser.add_argument("--json", type=json_path, help="also write every printed figure to this JSON file")
    parser.add_argument("--engine", choices=("ours", "hf"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        result = (run_ours if args.engine == "ours" else run_hf)(args.lengths, args.new_tokens)
        print(json.dumps(result))
        return
    results = {}
    for engine in ("ours", "hf"):
        cmd = [sys.executable, __file__, "--engine", engine, "--lengths", *map(str, args.lengths),
               "--new-tokens", str(args.new_tokens)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[engine] = json.loads(proc.stdout.strip().splitlines()[-1])
    bandwidth = read_bandwidth_gbs()
    ours, hf = results["ours"], results["hf"]
    rows = []
    for length in args.lengths:
        o, h = ours[str(length)], hf[str(length)]
        # Bytes read per decode step: every weight, plus the KV cache at its average fill.
        step_bytes = ours["weight_bytes"] + o["kv_bytes"] * (length + args.new_tokens / 2) / (length + args.new_tokens)
        roofline = bandwidth * 1e9 / step_bytes
        kernels = o["kernels"]
        kernel_bound = 1e3 / (kernels["dots_ms"] + kernels["attention_ms"])
        rows.append({"length": length, "decode_tok_s": o["decode_tok_s"], "hf_decode_tok_s": h["decode_tok_s"],
                     "roofline_tok_s": roofline, "roofline_fraction": o["decode_tok_s"] / roofline,
                     "kernel_bound_tok_s": kernel_bound, "kernel_bound_fraction": o["decode_tok_s"] / kernel_bound,
                     "kernels": kernels,
                     "prefill_tok_s": length / o["prefill_s"], "hf_prefill_tok_s": length / h["prefill_s"],
                     "compile_s": o["compile_s"], "step_bytes": step_bytes})
    print(f"memory read bandwidth: {bandwidth:.1f} GB/s; weights {ours['weight_bytes'] / 2**20:.0f} MiB (fp32)")
    print(f"{'prompt':>6} | {'prefill tok/s ours / HF (ratio)':>32} | {'decode tok/s ours / HF (ratio)':>31} | "
          f"{'roofline tok/s':>14} | {'ours % roofline':>15} | {'kernel bound tok/s':>18} | "
          f"{'ours % kernel bound':>19} | {'compile s':>9}")
    for r in rows:
        print(f"{r['length']:>6} | {r['prefill_tok_s']:>9.0f} / {r['hf_prefill_tok_s']:>7.0f} "
              f"({r['prefill_tok_s'] / r['hf_prefill_tok_s']:>5.2f}x)      | {r['decode_tok_s']:>8.2f} / "
              f"{r['hf_decode_tok_s']:>6.2f} ({r['decode_tok_s'] / r['hf_decode_tok_s']:>5.2f}x)      | "
              f"{r['roofline_tok_s']:>14.1f} | {100 * r['roofline_fraction']:>14.0f}% | "
              f"{r['kernel_bound_tok_s']:>18.1f} | {100 * r['kernel_bound_fraction']:>18.0f}% | {r['compile_s']:>9.1f}")
    print("kernel bound = 1 / (every weight dot alone + every layer's cache attention alone), measured in the "
          "same run; they stream at:")
    for r in rows:
        k = r["kernels"]
        print(f"{r['length']:>6}: weight dots {k['dots_ms']:.1f} ms ({k['dots_gbs']:.1f} GB/s), cache attention "
              f"{k['attention_ms']:.2f} ms ({k['attention_gbs']:.1f} GB/s), against {bandwidth:.1f} GB/s for a plain sum")
    print(f"peak RSS MiB: ours {ours['peak_rss_mib']:.0f}, HF {hf['peak_rss_mib']:.0f}")
    print(f"load: load_default() cold {ours['load_default_cold_s']:.1f} s, from its converted cache "
          f"{ours['load_default_warm_s']:.1f} s; transformers from_pretrained(gguf_file=...) {hf['load_s']:.1f} s")
    if args.json:
        figures = {"bandwidth_gbs": bandwidth, "weight_bytes": ours["weight_bytes"], "new_tokens": args.new_tokens,
                   "lengths": rows, "peak_rss_mib": {"ours": ours["peak_rss_mib"], "hf": hf["peak_rss_mib"]},
                   "load_s": {"default_cold": ours["load_default_cold_s"], "default_warm": ours["load_default_warm_s"],
                              "hf": hf["load_s"]}}
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)

if __name__ == "__main__":
    main()
