"""Host memory and time of loading and converting a LLaVA-style checkpoint, vs transformers.

    python bench/load_memory.py [--size-gib 1.0] [--repeats 2] [--json PATH]

Builds a random LLaVA-1.5-style checkpoint (fp16 safetensors, llava-hf names: a Llama decoder of
hidden 2048, 16 heads, MLP 5632, vocab 32000, as many layers as fill --size-gib, and a 4-layer
CLIP tower of width 1024 at 336 px with its projector) in a temporary folder, then runs each step
in a fresh process and reads that process's peak RSS (VmHWM of /proc/self/status at its end: the
exec'd program's own peak, whereas ru_maxrss would count the forking parent's size) and the step's
own wall time (imports excluded):
  * baseline: python + jax + lookm_jax imported and the CPU backend started (nothing loaded);
  * load bf16 / load fp32: `lookm_jax.load(folder, dtype=...)`;
  * convert: `lookm convert folder out/` (the converted folder's bytes too);
  * load converted bf16: `lookm_jax.load(out/, dtype=bfloat16)`;
  * transformers: `LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16)`.
The steps run in --repeats interleaved rounds (the machine's load changes); a step's time is its
best round, its peak RSS its highest. Figures are printed as ratios to the checkpoint's bytes, and
checked against the targets of
issue 33: load (bf16) <= the params' bytes + 1.3x the largest tensor + baseline, convert <= 1.3x
the largest tensor + baseline, both <= transformers' peak; load time <= transformers'; the converted
folder within 5% of the checkpoint's bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

GIB = 2**30
STEPS = ("baseline", "load_bf16", "load_fp32", "convert", "load_converted", "transformers")


@dataclasses.dataclass(frozen=True)
class Dims:
    """The random checkpoint's sizes (defaults: LLaVA-1.5's decoder at hidden 2048, a small CLIP tower)."""

    hidden: int = 2048
    heads: int = 16
    intermediate: int = 5632
    vocab: int = 32000
    layers: int = 7
    vision_hidden: int = 1024
    vision_heads: int = 16
    vision_intermediate: int = 4096
    vision_layers: int = 4
    image_size: int = 336
    patch: int = 14

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """llava-hf tensor name -> shape (torch layouts)."""
        h, i, v, hv, iv = self.hidden, self.intermediate, self.vocab, self.vision_hidden, self.vision_intermediate
        shapes = {"language_model.model.embed_tokens.weight": (v, h), "language_model.model.norm.weight": (h,),
                  "language_model.lm_head.weight": (v, h)}
        for n in range(self.layers):
            layer = f"language_model.model.layers.{n}."
            shapes.update({layer + f"self_attn.{p}_proj.weight": (h, h) for p in "qkvo"})
            shapes.update({layer + "mlp.gate_proj.weight": (i, h), layer + "mlp.up_proj.weight": (i, h),
                           layer + "mlp.down_proj.weight": (h, i), layer + "input_layernorm.weight": (h,),
                           layer + "post_attention_layernorm.weight": (h,)})
        tower = "vision_tower."
        patches = (self.image_size // self.patch) ** 2
        shapes.update({tower + "embeddings.class_embedding": (hv,),
                       tower + "embeddings.patch_embedding.weight": (hv, 3, self.patch, self.patch),
                       tower + "embeddings.position_embedding.weight": (patches + 1, hv),
                       **{tower + f"{norm}.{wb}": (hv,) for norm in ("pre_layrnorm", "post_layernorm")
                          for wb in ("weight", "bias")}})
        for n in range(self.vision_layers):
            layer = f"{tower}encoder.layers.{n}."
            for p in ("q_proj", "k_proj", "v_proj", "out_proj"):
                shapes.update({layer + f"self_attn.{p}.weight": (hv, hv), layer + f"self_attn.{p}.bias": (hv,)})
            shapes.update({layer + "mlp.fc1.weight": (iv, hv), layer + "mlp.fc1.bias": (iv,),
                           layer + "mlp.fc2.weight": (hv, iv), layer + "mlp.fc2.bias": (hv,),
                           **{layer + f"layer_norm{k}.{wb}": (hv,) for k in (1, 2) for wb in ("weight", "bias")}})
        shapes.update({"multi_modal_projector.linear_1.weight": (h, hv), "multi_modal_projector.linear_1.bias": (h,),
                       "multi_modal_projector.linear_2.weight": (h, h), "multi_modal_projector.linear_2.bias": (h,)})
        return shapes

    def config(self) -> dict:
        """config.json as transformers 5 writes it for LlavaForConditionalGeneration in fp16."""
        text = {"model_type": "llama", "hidden_size": self.hidden, "intermediate_size": self.intermediate,
                "num_hidden_layers": self.layers, "num_attention_heads": self.heads, "num_key_value_heads": self.heads,
                "head_dim": self.hidden // self.heads, "vocab_size": self.vocab, "rms_norm_eps": 1e-5,
                "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
                "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
        vision = {"model_type": "clip_vision_model", "hidden_size": self.vision_hidden,
                  "intermediate_size": self.vision_intermediate, "num_hidden_layers": self.vision_layers,
                  "num_attention_heads": self.vision_heads, "image_size": self.image_size, "patch_size": self.patch,
                  "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5, "num_channels": 3, "projection_dim": 768}
        return {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "dtype": "float16",
                "text_config": text, "vision_config": vision, "image_token_index": self.vocab - 1,
                "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
                "projector_hidden_act": "gelu", "multimodal_projector_bias": True, "tie_word_embeddings": False}


def dims_for(size_bytes: float) -> Dims:
    """The default dims with as many decoder layers as bring the fp16 checkpoint nearest `size_bytes`."""
    base = Dims(layers=0)
    fixed = 2 * sum(math.prod(s) for s in base.tensors().values())
    per_layer = 2 * sum(math.prod(s) for s in Dims(layers=1).tensors().values()) - fixed
    return dataclasses.replace(base, layers=max(1, round((size_bytes - fixed) / per_layer)))


def build_checkpoint(folder: str, dims: Dims, seed: int = 0) -> None:
    """A random fp16 checkpoint folder (config.json + model.safetensors), written one tensor at a time."""
    from lookm_jax.convert.safetensors_io import StreamWriter

    rng = np.random.default_rng(seed)
    shapes = dims.tensors()
    writer = StreamWriter(os.path.join(folder, "model.safetensors"), list(shapes))
    for name, shape in shapes.items():
        writer.add(name, np.float16, shape)
    for name, shape in shapes.items():
        if name.endswith(("norm.weight", "layrnorm.weight", "layernorm.weight", "norm1.weight", "norm2.weight")):
            value = rng.uniform(0.5, 1.5, shape)
        else:
            value = rng.standard_normal(shape, np.float32) * (0.02 if len(shape) > 1 else 0.01)
        writer.write(name, value.astype(np.float16))
    writer.close()
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dims.config(), f, indent=1)


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))


def _worker(step: str, folder: str, out: str) -> dict:
    """One step, in this (fresh) process -> {"seconds": the step's wall time, ...}."""
    if step == "transformers":
        import torch
        from transformers import LlavaForConditionalGeneration

        start = time.perf_counter()
        model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16)
        return {"seconds": time.perf_counter() - start,
                "params_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    import jax
    import jax.numpy as jnp

    import lookm_jax
    from lookm_jax import cli

    jnp.zeros(1).block_until_ready()  # the backend started: part of the baseline
    start = time.perf_counter()
    if step == "baseline":
        return {"seconds": 0.0}
    if step == "convert":
        if cli.main(["convert", folder, out, "--force"]) != 0:  # --force: the round before wrote it
            raise SystemExit("lookm convert failed")
        return {"seconds": time.perf_counter() - start, "folder_bytes": folder_bytes(out)}
    dtype = jnp.float32 if step == "load_fp32" else jnp.bfloat16
    model = lookm_jax.load(out if step == "load_converted" else folder, dtype=dtype)
    leaves = jax.block_until_ready(jax.tree.leaves(model.params))
    return {"seconds": time.perf_counter() - start, "params_bytes": sum(a.nbytes for a in leaves)}


def peak_rss_bytes() -> int:
    """This process's peak resident set (Linux VmHWM)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def measure(step: str, folder: str, out: str) -> dict:
    """Run `step` in a fresh process -> its result, with "peak_rss_bytes" (the whole process's peak)."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", step, folder, out, result.name],
                              stdout=subprocess.DEVNULL, env={**os.environ, "TQDM_DISABLE": "1"})
        if proc.returncode != 0:
            raise SystemExit(f"step {step} failed (exit status {proc.returncode})")
        return json.load(result)


def largest_tensor_bytes(folder: str) -> int:
    from lookm_jax.convert.safetensors_io import read_header

    return max(t.nbytes for t in read_header(os.path.join(folder, "model.safetensors")).values())


def run(folder: str, steps=STEPS, repeats: int = 1) -> dict:
    """Measure `steps` on the checkpoint in `folder` (its converted folder goes beside it), in
    `repeats` rounds -> the report: per step its best time and highest peak, and every round's."""
    out = folder.rstrip("/") + "-converted"
    report = {"checkpoint_bytes": folder_bytes(folder), "largest_tensor_bytes": largest_tensor_bytes(folder),
              "steps": {}, "rounds": []}
    for _ in range(repeats):
        report["rounds"].append({step: measure(step, folder, out) for step in steps})
    for step in steps:
        found = [r[step] for r in report["rounds"]]
        report["steps"][step] = {**found[0], "seconds": min(f["seconds"] for f in found),
                                 "peak_rss_bytes": max(f["peak_rss_bytes"] for f in found)}
    report["checks"] = checks(report)
    return report


def checks(report: dict) -> dict[str, bool]:
    """Issue 33's targets, each that the measured steps allow."""
    s, largest = report["steps"], report["largest_tensor_bytes"]
    found = {}
    if {"baseline", "load_bf16"} <= set(s):
        bound = s["load_bf16"]["params_bytes"] + 1.3 * largest + s["baseline"]["peak_rss_bytes"]
        found["load_bf16 peak <= params + 1.3 x largest tensor + baseline"] = s["load_bf16"]["peak_rss_bytes"] <= bound
    if {"baseline", "convert"} <= set(s):
        bound = 1.3 * largest + s["baseline"]["peak_rss_bytes"]
        found["convert peak <= 1.3 x largest tensor + baseline"] = s["convert"]["peak_rss_bytes"] <= bound
        found["converted folder within 5% of the checkpoint"] = (
            abs(s["convert"]["folder_bytes"] - report["checkpoint_bytes"]) <= 0.05 * report["checkpoint_bytes"])
    if "transformers" in s:
        for step in ("load_bf16", "convert"):
            if step in s:
                found[f"{step} peak <= transformers'"] = s[step]["peak_rss_bytes"] <= s["transformers"]["peak_rss_bytes"]
        if "load_bf16" in s:
            found["load_bf16 time <= transformers'"] = s["load_bf16"]["seconds"] <= s["transformers"]["seconds"]
    return found


def print_report(report: dict) -> None:
    ckpt = report["checkpoint_bytes"]
    print(f"checkpoint: {ckpt / GIB:.2f} GiB fp16, largest tensor {report['largest_tensor_bytes'] / GIB:.3f} GiB")
    print(f"{'step':<16} {'peak RSS GiB':>12} {'x checkpoint':>12} {'seconds':>8}")
    for step, r in report["steps"].items():
        print(f"{step:<16} {r['peak_rss_bytes'] / GIB:>12.2f} {r['peak_rss_bytes'] / ckpt:>12.2f} {r['seconds']:>8.1f}")
    if "convert" in report["steps"]:
        print(f"converted folder: {report['steps']['convert']['folder_bytes'] / ckpt:.3f} x the checkpoint's bytes")
    for name, ok in report["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        step, folder, out, result = sys.argv[2:]
        found = _worker(step, folder, out)
        with open(result, "w") as f:
            json.dump({**found, "peak_rss_bytes": peak_rss_bytes()}, f)
        return
    from bench_args import at_least, json_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="the checkpoint's size, in GiB (> 0)")
    parser.add_argument("--repeats", type=at_least(1), default=2, help="rounds over the steps")
    parser.add_argument("--json", type=json_path, help="also write the report here")
    args = parser.parse_args()
    if not 0 < args.size_gib <= 64:
        parser.error(f"--size-gib must be in (0, 64], got {args.size_gib}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "checkpoint")
        os.makedirs(folder)
        build_checkpoint(folder, dims_for(args.size_gib * GIB))
        report = run(folder, repeats=args.repeats)
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
