"""SmolLM2-135M decode and prefill on this CPU: lookm-jax vs HF transformers (PyTorch), side by side.

    python bench/decode_cpu.py [--lengths 512 2048] [--new-tokens 64] [--repeats 5] [--json PATH]

Each engine runs in its own subprocess (so peak RSS is its own); the parent also measures this
machine's memory read bandwidth and prints the decode roofline, tokens/s = bandwidth / bytes read
per step (all weights, the tied head included, plus the KV cache). XLA:CPU's batch-1 dots and cache
attention do not stream at that bandwidth, so the same run also times those kernels alone
(`KernelTimes`) and prints the bound they set and decode's share of it. Each engine compiles (or
warms up) once, then runs --repeats rounds over the lengths; each of our rounds also times the
kernels, so decode and its bound are measured side by side. Every figure is the best of its rounds;
compile time is reported apart. Needs the test extra (torch) for the HF side.
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


def run_ours(lengths, new_tokens, repeats) -> dict:
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
    prompts = {length: np.asarray([prompt_ids(model.tokenizer, length)], np.int32) for length in lengths}
    runs = {length: [model.run(ids, max_new_tokens=new_tokens)] for length, ids in prompts.items()}  # compiles
    kernels = KernelTimes(model, [runs[length][0].cache_bytes for length in lengths])
    for _ in range(repeats):  # rounds: every length's decode, then the kernels that bound it, so both see one machine
        for length, ids in prompts.items():
            runs[length].append(model.run(ids, max_new_tokens=new_tokens))
        kernels.measure()
    for length in lengths:
        first, timed = runs[length][0], runs[length][1:]
        out[length] = {"compile_s": first.compile_seconds, "prefill_s": min(r.prefill_seconds for r in timed),
                       "decode_tok_s": (new_tokens - 1) / min(r.decode_seconds for r in timed),
                       "kv_bytes": first.cache_bytes, "kernels": kernels.figures(first.cache_bytes)}
    out["weight_bytes"] = sum(a.nbytes for a in __import__("jax").tree.leaves(model.params))
    out["peak_rss_mib"] = peak_rss_mib()
    return out


def _best_ms(fn, *args, repeats: int = 10) -> float:
    """Best of `repeats` calls of a jitted fn, after one warm-up call (its compile, the first time)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


class KernelTimes:
    """The kernels a decode step cannot beat on XLA:CPU, each alone: every batch-1 weight dot of
    the model (its own weights, the head included) as one chain, and every layer's decode attention
    over a full cache of each of `kv_bytes` (random K/V). Each chain is dependent, as in a decode
    step, so its kernels run one after the other, not side by side. Compiled once; `measure` times
    every chain once (best of 10 calls), so a bench can interleave it with the decode runs it
    bounds; `figures` gives the best over all `measure` calls."""

    def __init__(self, model, kv_bytes: list[int]):
        import jax
        import jax.numpy as jnp

        from lookm_jax.models import llama, llava

        text = model.params["text"]
        weights = [w.reshape(-1, w.shape[-1]) for lp in text["layers"] for name, w in lp.items()
                   if name.startswith("w")]  # [out, in] (b_qkv is a bias)
        weights.append(text.get("lm_head", text["embed"]))

        def dots(weights):
            y = jnp.ones((1, 1), weights[0].dtype)
            for w in weights:
                y = llama.dense(jnp.ones((1, w.shape[1]), w.dtype) + 0 * y[:, :1], w)  # depends on the last dot
            return y

        cfg, dtype = llava.text_config(model.config), text["embed"].dtype
        own = jnp.ones((1, cfg.num_kv_heads, 1, cfg.head_dim), dtype)

        def attention(q, kv, mask):
            for k, v in zip(kv[::2], kv[1::2]):
                q = q + 0 * llama.attend_step(q, k, v, mask, own, own)  # depends on the last layer's output
            return q

        def attention_inputs(n_bytes):
            slots = n_bytes // (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize)
            shape = (1, cfg.num_kv_heads, slots, cfg.head_dim)
            keys_shape = (1, cfg.num_kv_heads, cfg.head_dim, slots)  # the cache's key layout (lookm_jax.cache)
            cache = [jax.random.normal(jax.random.key(i), shape if i % 2 else keys_shape, dtype)
                     for i in range(2 * cfg.num_layers)]
            return jnp.ones((1, cfg.num_heads, 1, cfg.head_dim), dtype), cache, jnp.ones(shape[:3], bool)

        # chain name ("dots", or "attention N" for a cache of N bytes) -> (jitted fn, its args, bytes it reads)
        self.chains = {"dots": (jax.jit(dots), (weights,), sum(w.nbytes for w in weights))}
        attention = jax.jit(attention)
        for n_bytes in dict.fromkeys(kv_bytes):  # caches of equal size share one chain
            self.chains[f"attention {n_bytes}"] = (attention, attention_inputs(n_bytes), n_bytes)
        self.best_ms = {}

    def measure(self) -> None:
        """Time every chain once (best of 10 calls) and keep each chain's best so far."""
        for name, (fn, args, _) in self.chains.items():
            self.best_ms[name] = min(self.best_ms.get(name, float("inf")), _best_ms(fn, *args))

    def _rate_gbs(self, name: str) -> float:
        return self.chains[name][2] / self.best_ms[name] / 1e6

    def figures(self, kv_bytes: int) -> dict:
        """{dots_ms, dots_gbs, attention_ms, attention_gbs} for a cache of `kv_bytes`."""
        attention = f"attention {kv_bytes}"
        return {"dots_ms": self.best_ms["dots"], "dots_gbs": self._rate_gbs("dots"),
                "attention_ms": self.best_ms[attention], "attention_gbs": self._rate_gbs(attention)}


def run_hf(lengths, new_tokens, repeats) -> dict:
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
    prompts = {length: torch.as_tensor([prompt_ids(tokenizer, length)]) for length in lengths}
    times = {length: {"prefill_s": [], "decode_s": []} for length in lengths}
    for _ in range(1 + repeats):  # the first round warms up, as our first run compiles
        for length, ids in prompts.items():
            with torch.no_grad():
                start = time.perf_counter()
                model(ids, logits_to_keep=1)
                prefill = time.perf_counter() - start
                start = time.perf_counter()
                model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=0)
                total = time.perf_counter() - start
            times[length]["prefill_s"].append(prefill)
            times[length]["decode_s"].append(max(total - prefill, 1e-9))
    for length, t in times.items():
        out[length] = {"prefill_s": min(t["prefill_s"][1:]), "decode_tok_s": (new_tokens - 1) / min(t["decode_s"][1:])}
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
    parser.add_argument("--repeats", type=at_least(1), default=5,
                        help="timed runs per length and engine (after a first, compiling one); the best is reported")
    parser.add_argument("--json", type=json_path, help="also write every printed figure to this JSON file")
    parser.add_argument("--engine", choices=("ours", "hf"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        result = (run_ours if args.engine == "ours" else run_hf)(args.lengths, args.new_tokens, args.repeats)
        print(json.dumps(result))
        return
    results = {}
    for engine in ("ours", "hf"):
        cmd = [sys.executable, __file__, "--engine", engine, "--lengths", *map(str, args.lengths),
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
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
                   "repeats": args.repeats,
                   "lengths": rows, "peak_rss_mib": {"ours": ours["peak_rss_mib"], "hf": hf["peak_rss_mib"]},
                   "load_s": {"default_cold": ours["load_default_cold_s"], "default_warm": ours["load_default_warm_s"],
                              "hf": hf["load_s"]}}
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)

if __name__ == "__main__":
    main()
