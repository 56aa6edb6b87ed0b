"""Compile-only figures, from shapes alone (no weights, nothing run): prefill memory and compile time.

    python bench/compile_cpu.py [--memory-lengths 8192 32768 131072] [--compile-lengths 1024 8192]
                                [--json PATH]

  * temporary bytes of the compiled prefill (`compiled.memory_analysis().temp_size_in_bytes`) with
    LOOK-M 20% compression, for SmolLM2-135M (fp32, text only) and LLaVA-1.5-7B (bf16, one image)
    at each --memory-lengths bucket; the parameters are `jax.eval_shape` structs in the runtime
    layout (`llama.runtime_params`), so no weight exists;
  * compile seconds of the SmolLM2 prefill + decode programs (full cache and LOOK-M 20%, 64 new
    tokens) at each --compile-lengths bucket, in this one process, and their ratio to the first.
Compile time depends on the machine's load; the ratio, measured in one process, much less.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp

from lookm_jax import generate as gen, get_method
from lookm_jax.convert.hf import parse_config
from lookm_jax.models import llama, llava
from lookm_jax.models.config import LlamaConfig, RopeConfig
from bench_args import at_least, json_path
from sizes import CONFIGS, abstract_params

SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope=RopeConfig(theta=100000.0),
                      tie_word_embeddings=True)
NEW_TOKENS = 64
GIB = 2**30


def model_shapes(name: str):
    """(config, abstract params in the runtime layout, dtype, image count) of a named model."""
    if name == "SmolLM2-135M":
        cfg, dtype, images = SMOLLM2, jnp.float32, 0
    else:
        cfg, dtype, images = parse_config(CONFIGS[name]), jnp.bfloat16, 1
    params = abstract_params(cfg, dtype)
    runtime = functools.partial(llama.runtime_params, llava.text_config(cfg))
    return cfg, {**params, "text": jax.eval_shape(runtime, params["text"])}, dtype, images


def compiled_prefill(cfg, params, dtype, images: int, length: int, method):
    ids = jax.ShapeDtypeStruct((1, length), jnp.int32)
    valid = jax.ShapeDtypeStruct((1, length), jnp.bool_)
    pixels = jax.ShapeDtypeStruct((images, *cfg.pixel_shape), dtype) if images else None
    return gen.prefill.lower(cfg, params, ids, valid, pixels, jax.random.key(0), method=method,
                             max_new_tokens=NEW_TOKENS, sampling=gen.Sampling()).compile()


def compile_seconds(cfg, params, length: int, method) -> float:
    """Seconds to compile the prefill and the decode of one bucket (as `Model.run` does)."""
    start = time.perf_counter()
    prefill = compiled_prefill(cfg, params, jnp.float32, 0, length, method)
    first, cache, _ = prefill.out_info
    gen.decode.lower(cfg, params["text"], first, cache, jax.random.key(0), max_new_tokens=NEW_TOKENS,
                     sampling=gen.Sampling(), eos_ids=()).compile()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory-lengths", type=at_least(64), nargs="*", default=[8192, 32768, 131072])
    parser.add_argument("--compile-lengths", type=at_least(64), nargs="*", default=[1024, 8192])
    parser.add_argument("--models", nargs="+", choices=["SmolLM2-135M", *CONFIGS], default=["SmolLM2-135M", "LLaVA-v1.5-7B"])
    parser.add_argument("--json", type=json_path, help="also write every figure to this JSON file")
    args = parser.parse_args()
    lookm = get_method("lookm", budget=0.2)
    out = {"memory": [], "compile": []}
    for name in args.models:
        cfg, params, dtype, images = model_shapes(name)
        for length in args.memory_lengths:
            stats = compiled_prefill(cfg, params, dtype, images, length, lookm).memory_analysis()
            out["memory"].append({"model": name, "length": length, "temp_bytes": stats.temp_size_in_bytes,
                                  "argument_bytes": stats.argument_size_in_bytes,
                                  "output_bytes": stats.output_size_in_bytes})
            print(f"{name:>14} prefill + LOOK-M 20% at {length:>6}: temp {stats.temp_size_in_bytes / GIB:7.2f} GiB, "
                  f"arguments {stats.argument_size_in_bytes / GIB:6.2f} GiB, output {stats.output_size_in_bytes / GIB:6.2f} GiB")
    cfg, params, _, _ = model_shapes("SmolLM2-135M")
    for method_name, method in (("full", get_method("full")), ("lookm-20%", lookm)):
        first = None
        for length in args.compile_lengths:
            seconds = compile_seconds(cfg, params, length, method)
            first = first or seconds
            out["compile"].append({"method": method_name, "length": length, "compile_s": seconds,
                                   "ratio_to_first": seconds / first})
            print(f"SmolLM2 {method_name:>9} prefill + decode compile at {length:>6}: {seconds:6.1f} s "
                  f"({seconds / first:.2f}x the {args.compile_lengths[0]} bucket)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
