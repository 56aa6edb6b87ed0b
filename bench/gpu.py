"""LLaVA-1.5-7B-shaped prefill, LOOK-M compression and decode on an accelerator, next to the HBM roofline.

    python bench/gpu.py [--new-tokens 64] [--repeats 3] [--long-lengths 32768 131072] [--json PATH]
    python bench/gpu.py --tiny        # the same script on a tiny config, on CPU (tests/test_gpu_bench.py)

Random bf16 weights of LLaVA-1.5-7B's shapes (bench/sizes.py's config) are created on the device,
so nothing is downloaded or copied from the host. The prompt fills the 4096 bucket: 6 images of 576
tokens between 7 runs of random text. Reported, best of --repeats after a compiling run:
  * prefill + compression seconds (vision tower, projector, decoder, compression) per cache;
  * decode ms/token with the full cache and LOOK-M at 20% and 5%, each next to its HBM byte
    roofline: (decoder weights read per step + the static K/V cache) / the device's read
    bandwidth, measured in the same run; and the paper's RTX 3090 figures (28.16 / 20.98 / 18.22 ms);
  * --long-lengths: prefill + LOOK-M 20% compression seconds of longer prompts (more text).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench_args import at_least, json_path
from decode_cpu import read_bandwidth_gbs
from lookm_jax import LONG_BUCKETS, Model, get_method
from lookm_jax.convert.hf import parse_config
from lookm_jax.models import llama
from lookm_jax.models.config import CLIPVisionConfig, LlamaConfig, LlavaConfig, RopeConfig
from sizes import CONFIGS, abstract_params

PAPER_3090_MS = {"full": 28.16, "LOOK-M 20%": 20.98, "LOOK-M 5%": 18.22}  # LOOK-M paper, LLaVA-1.5-7B decode
CACHES = {"full": get_method("full"), "LOOK-M 20%": get_method("lookm", budget=0.2),
          "LOOK-M 5%": get_method("lookm", budget=0.05)}
N_IMAGES = 6


def tiny_config() -> LlavaConfig:
    text = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, rope=RopeConfig(theta=1000.0))
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, image_size=30,
                              patch_size=6)  # 25 image tokens
    return LlavaConfig(text=text, vision=vision, image_token_id=255)


def random_params(cfg: LlavaConfig, dtype, seed: int = 0) -> dict:
    """Random params of cfg's shapes, made on the device: matrices ~N(0, 1/fan_in), norms 1, the rest 0.

    The decoder is built directly in the runtime layout (`llama.runtime_params`, weights [out, in])."""
    abstract = abstract_params(cfg, dtype)
    abstract["text"] = jax.eval_shape(functools.partial(llama.runtime_params, cfg.text), abstract["text"])
    leaves, tree = jax.tree_util.tree_flatten_with_path(abstract)
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    def init(path, leaf, key):
        name, part = (str(getattr(k, "key", k)) for k in (path[-1], path[0]))
        if name.endswith("norm") or name in ("pre_norm_w", "ln1_w", "ln2_w"):
            return _filled(leaf.shape, dtype, 1.0)
        if leaf.ndim < 2 or name.startswith("b_"):  # biases (Qwen2's b_qkv is [Hkv, G + 2, D])
            return _filled(leaf.shape, dtype, 0.0)
        fan_in = leaf.shape[-1] if part == "text" else leaf.shape[-2]  # decoder [out, in], vision [in, out]
        return _normal(key, leaf.shape, dtype, fan_in**-0.5)

    return jax.tree_util.tree_unflatten(tree, [init(p, leaf, k) for (p, leaf), k in zip(leaves, keys)])


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _filled(shape, dtype, value):
    return jnp.full(shape, value, dtype)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(key, shape, dtype, scale):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def build_prompt(cfg: LlavaConfig, length: int, rng: np.random.Generator) -> np.ndarray:
    """ids [1, length]: N_IMAGES images of cfg.image_seq_length placeholders between 7 runs of random text."""
    text = length - N_IMAGES * cfg.image_seq_length
    cuts = np.linspace(0, text, N_IMAGES + 2).astype(int)
    words = rng.integers(1, min(cfg.text.vocab_size, 32000) - 1, text)
    pieces = []
    for i in range(N_IMAGES + 1):
        pieces.append(words[cuts[i]:cuts[i + 1]])
        if i < N_IMAGES:
            pieces.append(np.full(cfg.image_seq_length, cfg.image_token_id))
    return np.concatenate(pieces).astype(np.int32)[None]


def decoder_step_bytes(params: dict) -> int:
    """Bytes of decoder weights one decode step reads: every layer, the final norm and the LM head."""
    text = params["text"]
    head = text.get("lm_head", text["embed"])
    return sum(a.nbytes for a in jax.tree.leaves(text["layers"])) + text["final_norm"].nbytes + head.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny config on CPU: checks that the script runs")
    parser.add_argument("--new-tokens", type=at_least(1), default=64)
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--long-lengths", type=int, nargs="*", default=[])
    parser.add_argument("--json", type=json_path, help="also write every printed figure to this JSON file")
    args = parser.parse_args()
    if args.tiny:
        jax.config.update("jax_platforms", "cpu")
        cfg, dtype, length, bandwidth_bytes = tiny_config(), jnp.float32, 256, 2**26
    else:
        cfg, dtype, length, bandwidth_bytes = parse_config(CONFIGS["LLaVA-v1.5-7B"]), jnp.bfloat16, 4096, 2**32
    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, eos_token_ids=()))  # decode every step
    image_tokens = N_IMAGES * cfg.image_seq_length
    if any(n < image_tokens for n in args.long_lengths):
        parser.error(f"--long-lengths must each be >= {image_tokens} (the prompt's {N_IMAGES} images), "
                     f"got {args.long_lengths}")
    start = time.perf_counter()
    model = Model(config=cfg, params=random_params(cfg, dtype), manifest={}, buckets=LONG_BUCKETS)
    jax.block_until_ready(model.params)
    init_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    ids = build_prompt(cfg, length, rng)
    pixels = rng.standard_normal((N_IMAGES, *cfg.pixel_shape)).astype(np.float32)
    bandwidth = read_bandwidth_gbs(bandwidth_bytes)
    weight_bytes = decoder_step_bytes(model.params)
    print(f"{jax.devices()[0].device_kind} ({jax.default_backend()}); {'tiny config' if args.tiny else 'LLaVA-1.5-7B shapes'}, "
          f"{jnp.dtype(dtype).name} random weights made on the device in {init_s:.1f} s; read bandwidth "
          f"{bandwidth:.0f} GB/s; decoder weights read per step {weight_bytes / 2**30:.2f} GiB")
    print(f"prompt {ids.shape[1]} tokens ({N_IMAGES} x {cfg.image_seq_length} image), {args.new_tokens} new tokens, "
          f"best of {args.repeats}\n")
    rows = []
    for name, method in CACHES.items():
        compile_s = model.run(ids, pixels, max_new_tokens=args.new_tokens, method=method).compile_seconds
        runs = [model.run(ids, pixels, max_new_tokens=args.new_tokens, method=method) for _ in range(args.repeats)]
        step_bytes = weight_bytes + runs[0].cache_bytes
        roofline_ms = step_bytes / bandwidth / 1e6
        decode_ms = min(r.decode_ms_per_token for r in runs)
        rows.append({"cache": name, "prefill_s": min(r.prefill_seconds for r in runs), "decode_ms": decode_ms,
                     "cache_bytes": runs[0].cache_bytes, "step_bytes": step_bytes, "roofline_ms": roofline_ms,
                     "roofline_ratio": decode_ms / roofline_ms, "paper_3090_ms": PAPER_3090_MS[name],
                     "compile_s": compile_s})
    print(f"{'cache':<11} | {'prefill+compress s':>18} | {'decode ms/tok':>13} | {'roofline ms':>11} | "
          f"{'x roofline':>10} | {'K/V GiB':>7} | {'paper 3090 ms':>13} | {'compile s':>9}")
    for r in rows:
        print(f"{r['cache']:<11} | {r['prefill_s']:>18.3f} | {r['decode_ms']:>13.2f} | {r['roofline_ms']:>11.2f} | "
              f"{r['roofline_ratio']:>9.2f}x | {r['cache_bytes'] / 2**30:>7.3f} | {r['paper_3090_ms']:>13.2f} | "
              f"{r['compile_s']:>9.1f}")
    long_rows = []
    for long_length in args.long_lengths:
        long_ids = build_prompt(cfg, long_length, rng)
        first = model.run(long_ids, pixels, max_new_tokens=2, method=CACHES["LOOK-M 20%"])
        again = model.run(long_ids, pixels, max_new_tokens=2, method=CACHES["LOOK-M 20%"])
        long_rows.append({"length": long_length, "prefill_s": again.prefill_seconds, "compile_s": first.compile_seconds,
                          "cache_bytes": again.cache_bytes})
        print(f"prompt {long_length}: prefill + LOOK-M 20% {again.prefill_seconds:.2f} s "
              f"(compile {first.compile_seconds:.1f} s), cache {again.cache_bytes / 2**30:.3f} GiB")
    if args.json:
        figures = {"device": jax.devices()[0].device_kind, "tiny": args.tiny, "prompt_tokens": int(ids.shape[1]),
                   "new_tokens": args.new_tokens, "bandwidth_gbs": bandwidth, "weight_bytes": weight_bytes,
                   "init_s": init_s, "caches": rows, "long": long_rows}
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
