"""LOOK-M on the SmolLM2 demo model, CPU: decode speed vs cache size, prefill cost, prefill memory.

    python bench/compress_cpu.py [--length 4096] [--new-tokens 64] [--repeats 3]
                                 [--rss-lengths 4096 8192 16384] [--json PATH]

Prints one table of figures and ratios (steady-state times are the best of --repeats runs,
interleaved across configurations; compile time is reported apart):
  * decode ms/token with the full cache and LOOK-M (paper default: text-prior, pivotal merge) at
    20% and 5% budget, SnapKV (uniform per layer), PyramidKV (the same total split over layers)
    and AdaKV (each layer's total split over its KV heads, in one pool) at 20% and 5%, and the
    ratio to full; the bytes one decode step reads (decoder weights,
    the tied head included, + the whole static K/V cache: empty slots are masked, not skipped),
    the bound bytes / bandwidth with the memory read bandwidth measured in the same run, and how
    close each measured step comes to its bound; and, since XLA:CPU's batch-1 dots and cache
    attention do not stream at that bandwidth, the kernel bound: every weight dot alone plus
    every layer's cache attention alone over that cache (`decode_cpu.KernelTimes`, timed in every
    round, after the configurations' runs), and each step's share of it;
  * each adaptive layout against its uniform twin at the same budget: K/V bytes, the compiled
    decode's memory (arguments + temporaries, `memory_analysis`) and ms/token, as ratios;
  * prefill + compression time over plain prefill (full cache), also with the scores recomputed
    by the standalone scorer (``scoring.column_stats``) instead of taken from the prefill's own
    attention: the path before the two were fused; and the composite (`lookm_quota`) at 20% with its
    default split scores and with eq. 4's (`scores="attention"`), the first encoding the prompt twice over;
  * peak RSS (ru_maxrss) of prefill + scoring + compression at each --rss-lengths, each in a fresh
    subprocess whose peak counter is reset (/proc/self/clear_refs) after the model is loaded and
    the program compiled, so neither is counted. These run first, while this process is small.
Prompts are ~80% image tokens: demo pictures of 64 tokens (the two bundled scenes, cycled) and
filler text. What the tower sees does not matter for speed or memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

from bench_args import at_least, json_path
from decode_cpu import WORDS, KernelTimes, peak_rss_mib, read_bandwidth_gbs

IMAGE_FRACTION = 0.8
ADAPTIVE_TWINS = {"PyramidKV": "SnapKV", "AdaKV": "SnapKV"}  # adaptive layout -> the uniform method it redistributes
MIB = 2**20


def current_rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / MIB


def reset_peak_rss() -> None:
    """Linux: restart the peak-RSS counter (VmHWM, hence ru_maxrss) from the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def build_prompt(model, length: int) -> tuple[np.ndarray, np.ndarray]:
    """A chat prompt of at most `length` tokens, IMAGE_FRACTION of them image tokens.

    -> (ids [1, <= length] int32, pixel_values [n_images, 3, 112, 112] float32)."""
    from PIL import Image

    from lookm_jax.cli_args import DEFAULT_IMAGES
    from lookm_jax.models.image_processing import CLIPImageProcessorConfig, preprocess_images

    n_images = round(IMAGE_FRACTION * length / model.config.image_seq_length)
    processor = CLIPImageProcessorConfig.from_hf_dict(model.manifest["image_processor"])
    pictures = preprocess_images([Image.open(p) for p in DEFAULT_IMAGES], processor)
    pixels = np.resize(pictures, (n_images, *pictures.shape[1:]))  # cycles the pictures
    words = length - model.encode_chat("", n_images).shape[1]
    while words >= 0:
        ids = model.encode_chat(" ".join(WORDS[i % len(WORDS)] for i in range(words)), n_images)
        if ids.shape[1] <= length:
            return ids, pixels
        words -= ids.shape[1] - length
    raise ValueError(f"{n_images} images of {model.config.image_seq_length} tokens do not fit in {length} tokens")


def recomputed_scores(method):
    """`method` scored by the standalone scorer instead of the prefill attention's statistics."""
    from lookm_jax.compression.methods import Method

    @dataclasses.dataclass(frozen=True)
    class RecomputedScores(Method):
        inner: Method  # statistics stays (): the prefill accumulates none and passes {}

        def capacity(self, bucket_len: int) -> int:
            return self.inner.capacity(bucket_len)

        def __call__(self, queries, keys, values, is_image, valid, stats=None, layer=None):
            return self.inner(queries, keys, values, is_image, valid, layer=layer)  # stats=None: recompute

    return RecomputedScores(method)


def rss_child(length: int, new_tokens: int) -> dict:
    """Peak RSS of one LOOK-M 20% prefill (+ scoring + compression) of a `length`-token prompt."""
    import jax
    import jax.numpy as jnp

    import lookm_jax
    from lookm_jax import generate as gen

    model = lookm_jax.load_default()
    ids, pixels = build_prompt(model, length)
    packed, valid = gen.pack_prompts(ids, buckets=model.buckets)
    args = (model.config, model.params, jnp.asarray(packed), jnp.asarray(valid), jnp.asarray(pixels),
            jax.random.key(0))
    start = time.perf_counter()
    prefill = gen.prefill.lower(*args, method=lookm_jax.get_method("lookm", budget=0.2),
                                max_new_tokens=new_tokens, sampling=gen.Sampling()).compile()
    compile_s = time.perf_counter() - start
    reset_peak_rss()
    before = current_rss_mib()
    start = time.perf_counter()
    jax.block_until_ready(prefill(*args[1:]))
    prefill_s = time.perf_counter() - start
    n_image = int((packed == model.config.image_token_id).sum())
    return {"tokens": int(valid.sum()), "bucket": packed.shape[1], "image": n_image,
            "before_mib": before, "peak_mib": peak_rss_mib(), "compile_s": compile_s, "prefill_s": prefill_s}


def decode_memory_bytes(model, ids, pixels, method, new_tokens: int) -> int:
    """Arguments + temporaries of the compiled decode program on `method`'s cache (XLA's memory analysis)."""
    import jax
    import jax.numpy as jnp

    from lookm_jax import generate as gen

    packed, valid = gen.pack_prompts(ids, buckets=model.buckets)
    args = (model.params, jnp.asarray(packed), jnp.asarray(valid), jnp.asarray(pixels), jax.random.key(0))
    first, cache, _ = jax.eval_shape(lambda *a: gen.prefill(model.config, *a, method=method, max_new_tokens=new_tokens,
                                                            sampling=gen.Sampling()), *args)
    stats = gen.decode.lower(model.text_config, model.params["text"], first, cache, args[-1], max_new_tokens=new_tokens,
                             sampling=gen.Sampling(), eos_ids=()).compile().memory_analysis()
    return stats.argument_size_in_bytes + stats.temp_size_in_bytes


def time_configs(model, ids, pixels, configs: dict, new_tokens: int, repeats: int) -> dict:
    """Compile, then `repeats` rounds of every config and of the kernels that bound its decode
    (`KernelTimes`); best prefill, decode and kernel times."""
    out = {}
    for name, method in configs.items():
        r = model.run(ids, pixels, max_new_tokens=new_tokens, method=method)
        out[name] = {"compile_s": r.compile_seconds, "prefill_s": [], "decode_ms": [], "cache_bytes": r.cache_bytes,
                     "kept": float(r.kept_image_tokens[0] + r.kept_text_tokens[0]),
                     "kept_text": float(r.kept_text_tokens[0]),
                     "decode_memory": decode_memory_bytes(model, ids, pixels, method, new_tokens)}
    kernels = KernelTimes(model, [row["cache_bytes"] for row in out.values()])
    for _ in range(repeats):
        for name, method in configs.items():
            r = model.run(ids, pixels, max_new_tokens=new_tokens, method=method)
            assert int(r.lengths[0]) == new_tokens
            out[name]["prefill_s"].append(r.prefill_seconds)
            out[name]["decode_ms"].append(r.decode_ms_per_token)
        kernels.measure()
    for row in out.values():
        row["prefill_s"], row["decode_ms"] = min(row["prefill_s"]), min(row["decode_ms"])
        row["kernels"] = kernels.figures(row["cache_bytes"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=at_least(256), default=4096, help="prompt tokens of the speed runs")
    parser.add_argument("--new-tokens", type=at_least(1), default=64)
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--rss-lengths", type=at_least(256), nargs="*", default=[4096, 8192, 16384])
    parser.add_argument("--json", type=json_path, help="also write every printed figure to this JSON file")
    parser.add_argument("--rss-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        print(json.dumps(rss_child(args.rss_child, args.new_tokens)))
        return
    load_start = os.getloadavg()
    rss = []
    for length in args.rss_lengths:
        cmd = [sys.executable, __file__, "--rss-child", str(length), "--new-tokens", str(args.new_tokens)]
        rss.append(json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1]))

    import jax

    import lookm_jax

    model = lookm_jax.load_default()
    text_cfg = dataclasses.replace(model.config.text, eos_token_ids=())  # always decode every step
    model = dataclasses.replace(model, config=dataclasses.replace(model.config, text=text_cfg))
    ids, pixels = build_prompt(model, args.length)
    lookm20 = lookm_jax.get_method("lookm", budget=0.2)
    configs = {"full": lookm_jax.get_method("full"), "LOOK-M 20%": lookm20,
               "LOOK-M 5%": lookm_jax.get_method("lookm", budget=0.05),
               "LOOK-M 20%, scores recomputed": recomputed_scores(lookm20),
               "composite 20%": lookm_jax.get_method("lookm_quota", budget=0.2),
               "composite 20%, eq. 4": lookm_jax.get_method("lookm_quota", budget=0.2, scores="attention")}
    for budget in (0.2, 0.05):
        for name in dict.fromkeys((*ADAPTIVE_TWINS.values(), *ADAPTIVE_TWINS)):  # each uniform twin once
            configs[f"{name} {budget:.0%}"] = lookm_jax.get_method(name.lower(), budget=budget)
    timed = time_configs(model, ids, pixels, configs, args.new_tokens, args.repeats)
    bandwidth = read_bandwidth_gbs()
    dots_ms = timed["full"]["kernels"]["dots_ms"]
    load_end = os.getloadavg()

    n_image = int((ids == model.config.image_token_id).sum())
    weight_bytes = sum(a.nbytes for a in jax.tree.leaves(model.params["text"]))
    print(f"command: python bench/compress_cpu.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"SmolLM2-135M demo, fp32, {os.cpu_count()} CPU cores; prompt {ids.shape[1]} tokens "
          f"({n_image} image = {n_image / ids.shape[1]:.0%}), {args.new_tokens} new tokens; "
          f"best of {args.repeats} interleaved runs")
    print(f"load average 1/5/15 min: {' '.join(f'{x:.2f}' for x in load_start)} at start, "
          f"{' '.join(f'{x:.2f}' for x in load_end)} at end")
    print(f"memory read bandwidth {bandwidth:.1f} GB/s (jitted sum of 1 GiB, best of 5); "
          f"decoder weights {weight_bytes / MIB:.0f} MiB\n")
    full = timed["full"]
    bound_full = (weight_bytes + full["cache_bytes"]) / bandwidth / 1e6
    rows = []
    for name, row in timed.items():
        step_bytes = weight_bytes + row["cache_bytes"]
        bound = step_bytes / bandwidth / 1e6
        kernel_bound = row["kernels"]["dots_ms"] + row["kernels"]["attention_ms"]
        rows.append({"cache": name, "kept": row["kept"], "kept_text": row["kept_text"], "cache_bytes": row["cache_bytes"],
                     "decode_ms": row["decode_ms"], "speed_up": full["decode_ms"] / row["decode_ms"],
                     "step_bytes": step_bytes, "bound_ms": bound, "bound_speed_up": bound_full / bound,
                     "bound_fraction": bound / row["decode_ms"], "kernels": row["kernels"],
                     "kernel_bound_ms": kernel_bound, "kernel_bound_fraction": kernel_bound / row["decode_ms"],
                     "prefill_s": row["prefill_s"], "decode_memory": row["decode_memory"],
                     "prefill_vs_full": row["prefill_s"] / full["prefill_s"], "compile_s": row["compile_s"]})
    print(f"{'cache':<30} | {'kept/head':>9} | {'text kept':>9} | {'K/V MiB':>7} | {'decode mem MiB':>14} | {'decode ms/tok':>13} | "
          f"{'speed-up':>8} | {'read/step MiB':>13} | {'bound ms/tok':>12} | {'bound speed-up':>14} | "
          f"{'% of bound':>10} | {'kernel bound ms':>15} | {'% of kernel bound':>17} | {'prefill s':>9} | {'vs full':>7} | {'compile s':>9}")
    for r in rows:
        print(f"{r['cache']:<30} | {r['kept']:>9.0f} | {r['kept_text']:>9.0f} | {r['cache_bytes'] / MIB:>7.1f} | "
              f"{r['decode_memory'] / MIB:>14.1f} | "
              f"{r['decode_ms']:>13.1f} | {r['speed_up']:>7.2f}x | {r['step_bytes'] / MIB:>13.0f} | "
              f"{r['bound_ms']:>12.1f} | {r['bound_speed_up']:>13.2f}x | {100 * r['bound_fraction']:>9.0f}% | "
              f"{r['kernel_bound_ms']:>15.1f} | {100 * r['kernel_bound_fraction']:>16.0f}% | "
              f"{r['prefill_s']:>9.2f} | {r['prefill_vs_full']:>6.2f}x | {r['compile_s']:>9.1f}")
    print(f"kernel bound = every weight dot alone ({dots_ms:.1f} ms) + every layer's cache attention alone over "
          f"the cache, timed in the same run; the attention streams at "
          + ", ".join(f"{r['kernels']['attention_gbs']:.1f}" for r in rows) + " GB/s")
    print("\nadaptive layouts against their uniform twin (same budget, same run)")
    print(f"{'layout':<16} | {'twin':<12} | {'K/V bytes':>9} | {'decode memory':>13} | {'ms/token':>8}")
    by_name = {r["cache"]: r for r in rows}
    twins = []
    for budget in ("20%", "5%"):
        for adaptive, uniform in ADAPTIVE_TWINS.items():
            a, u = by_name[f"{adaptive} {budget}"], by_name[f"{uniform} {budget}"]
            twin = {"layout": a["cache"], "twin": u["cache"], "bytes_ratio": a["cache_bytes"] / u["cache_bytes"],
                    "decode_memory_ratio": a["decode_memory"] / u["decode_memory"],
                    "decode_ms_ratio": a["decode_ms"] / u["decode_ms"]}
            twins.append(twin)
            print(f"{twin['layout']:<16} | {twin['twin']:<12} | {twin['bytes_ratio']:>8.3f}x | "
                  f"{twin['decode_memory_ratio']:>12.3f}x | {twin['decode_ms_ratio']:>7.3f}x")
    if rss:  # --rss-lengths with no value: speed only
        print("\npeak RSS of one LOOK-M 20% prefill + scoring + compression (fresh process each; "
              "counter reset after load and compile)")
        print(f"{'prompt':>6} | {'image':>5} | {'bucket':>6} | {'RSS before MiB':>14} | {'peak MiB':>8} | "
              f"{'peak - before':>13} | {'tokens vs first':>15} | {'growth vs first':>15} | {'prefill s':>9} | "
              f"{'compile s':>9}")
        first = rss[0]
        for row in rss:
            row["growth_mib"] = row["peak_mib"] - row["before_mib"]
            row["growth_vs_first"] = row["growth_mib"] / (first["peak_mib"] - first["before_mib"])
            row["tokens_vs_first"] = row["tokens"] / first["tokens"]
            print(f"{row['tokens']:>6} | {row['image'] / row['tokens']:>5.0%} | {row['bucket']:>6} | "
                  f"{row['before_mib']:>14.0f} | {row['peak_mib']:>8.0f} | {row['growth_mib']:>13.0f} | "
                  f"{row['tokens_vs_first']:>14.2f}x | {row['growth_vs_first']:>14.2f}x | {row['prefill_s']:>9.1f} | "
                  f"{row['compile_s']:>9.1f}")
    if args.json:
        figures = {"command": " ".join(sys.argv), "cpu_count": os.cpu_count(), "prompt_tokens": int(ids.shape[1]),
                   "image_tokens": n_image, "new_tokens": args.new_tokens, "repeats": args.repeats,
                   "load_average": {"start": load_start, "end": load_end}, "bandwidth_gbs": bandwidth,
                   "weight_bytes": weight_bytes, "configs": rows, "adaptive_vs_uniform": twins, "rss": rss}
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)

if __name__ == "__main__":
    main()
