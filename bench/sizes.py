"""Parameter counts and KV-cache bytes of the paper's architectures, from shapes alone (no weights).

    python bench/sizes.py [--prompt 4096] [--new-tokens 64] [--budgets 0.2 0.05]

Each real checkpoint's config.json (written out below from the published configs) is parsed by
`lookm_jax.convert.hf.parse_config`, as `lookm_jax.load` would. Parameters: the shapes the
converter checks a checkpoint against (its dry run, `params_from_hf` on `tables.ShapesOnly()`), counted.
Cache: `jax.eval_shape` of the compiled prefill (`lookm_jax.generate.prefill`) on those parameter
shapes (in the runtime layout, `llama.runtime_params`), with one image in a prompt of --prompt
tokens (its bucket) and --new-tokens to generate:
the decode cache the real program allocates, K and V of (kept prompt slots + new tokens) per layer
and KV head, in bf16 (the paper's fp16 has the same size). Full cache vs LOOK-M at each budget.
"""

from __future__ import annotations

import argparse
import functools
import math

import jax
import jax.numpy as jnp

from bench_args import at_least, kept_fraction
from lookm_jax import generate as gen, get_method
from lookm_jax.convert import original_llava, tables
from lookm_jax.convert.hf import params_from_hf, parse_config
from lookm_jax.models import llama
from lookm_jax.models.llava_next import AnyresPixels, LlavaNextConfig
from lookm_jax.models.qwen2_vl import Pixels, Qwen2VLConfig
from lookm_jax.models.qwen2_vl_processing import Qwen2VLImageProcessorConfig, smart_resize

CLIP_L_336 = "openai/clip-vit-large-patch14-336"
CONFIGS = {
    # llava-hf/llava-1.5-7b-hf: Vicuna-7B-v1.5 (fields left at HF's LlamaConfig defaults: hidden 4096,
    # 32 layers, 32 heads, MLP 11008), vocab padded to 32064 for <image> and <pad>; CLIP ViT-L/14-336.
    "LLaVA-v1.5-7B": {
        "model_type": "llava", "image_token_index": 32000, "projector_hidden_act": "gelu",
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
        "tie_word_embeddings": False,
        "text_config": {"model_type": "llama", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                        "vocab_size": 32064},
        "vision_config": {**original_llava.KNOWN_TOWERS[CLIP_L_336], "projection_dim": 768}},
    # llava-hf/llava-1.5-13b-hf: Vicuna-13B-v1.5.
    "LLaVA-v1.5-13B": {
        "model_type": "llava", "image_token_index": 32000, "projector_hidden_act": "gelu",
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
        "tie_word_embeddings": False,
        "text_config": {"model_type": "llama", "hidden_size": 5120, "intermediate_size": 13824,
                        "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
                        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "vocab_size": 32064},
        "vision_config": {**original_llava.KNOWN_TOWERS[CLIP_L_336], "projection_dim": 768}},
    # mtgv/MobileVLM_V2-3B: MobileLLaMA-2.7B (head_dim 80) + CLIP ViT-L/14-336 + LDPv2 (144 tokens).
    "MobileVLM-V2-3B": {
        "model_type": "mobilevlm", "hidden_size": 2560, "intermediate_size": 6912, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048, "hidden_act": "silu", "tie_word_embeddings": False,
        "mm_vision_tower": CLIP_L_336, "mm_hidden_size": 1024, "mm_projector_type": "ldpnetv2",
        "mm_vision_select_layer": -2, "mm_vision_select_feature": "patch", "image_aspect_ratio": "pad"},
    # OpenGVLab/InternVL-Chat-ViT-6B-Vicuna-7B, the paper's "InternVL-v1.5": original LLaVA layout,
    # InternViT-6B-224px run at 336 px, features of hidden_states[-4], mlp2x_gelu projector, Vicuna-7B.
    "InternVL-Chat-ViT-6B-Vicuna-7B": {
        "model_type": "llava", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "hidden_act": "silu", "tie_word_embeddings": False,
        "mm_vision_tower": "OpenGVLab/InternViT-6B-224px", "mm_hidden_size": 3200,
        "mm_projector_type": "mlp2x_gelu", "mm_vision_select_layer": -4, "mm_vision_select_feature": "patch",
        "image_aspect_ratio": "pad"},
    # Qwen/Qwen2-VL-7B-Instruct's config.json as published (the flat layout of transformers 4.41).
    "Qwen2-VL-7B": {
        "model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"], "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
        "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
        "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28,
        "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.41.2", "use_cache": True, "use_sliding_window": False,
        "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                          "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                          "temporal_patch_size": 2},
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 152064},
    # llava-hf/llava-v1.6-vicuna-7b-hf (LLaVA-NeXT): LLaVA-1.5-7B's parts and a learned image newline;
    # anyres tiles (a 672 x 672 picture: the base tile and a 2 x 2 grid of 336 px tiles).
    "LLaVA-NeXT-7B": {
        "architectures": ["LlavaNextForConditionalGeneration"], "ignore_index": -100,
        "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
        "image_token_index": 32000, "model_type": "llava_next", "projector_hidden_act": "gelu",
        "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                        "max_position_embeddings": 4096, "model_type": "llama", "pad_token_id": 0,
                        "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32064},
        "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.39.0.dev0",
        "use_image_newline_parameter": True,
        "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                          "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                          "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064},
    # llava-hf/llava-onevision-qwen2-7b-ov-hf: Qwen2-7B-Instruct + SigLIP-so400m/14-384 (no pooling head),
    # anyres_max_9 over HF's 36 default pinpoints (384 x 384 .. 2304 x 2304).
    "LLaVA-OneVision-7B": {
        "architectures": ["LlavaOnevisionForConditionalGeneration"], "ignore_index": -100,
        "image_grid_pinpoints": [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)],
        "image_token_index": 151646, "model_type": "llava_onevision", "projector_hidden_act": "gelu",
        "text_config": {"_name_or_path": "Qwen/Qwen2-7B-Instruct", "architectures": ["Qwen2ForCausalLM"],
                        "bos_token_id": 151643, "eos_token_id": 151645, "hidden_size": 3584,
                        "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28,
                        "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
                        "num_key_value_heads": 4, "rope_theta": 1000000.0, "sliding_window": 131072,
                        "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 152128},
        "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.45.0.dev0",
        "use_image_newline_parameter": True, "video_token_index": 151647, "vision_aspect_ratio": "anyres_max_9",
        "vision_config": {"hidden_size": 1152, "image_size": 384, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 26,
                          "patch_size": 14, "vision_use_head": False},
        "vision_feature_layer": -1, "vision_feature_select_strategy": "full", "vocab_size": 152128},
    # Qwen/Qwen2.5-VL-7B-Instruct's config.json as published (resaved by transformers 4.53.1): the
    # decoder's fields flat and in text_config (read from there, as HF does), the windowed tower.
    "Qwen2.5-VL-7B": {
        "model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
        "hidden_size": 3584, "image_token_id": 151655, "initializer_range": 0.02, "intermediate_size": 18944,
        "max_position_embeddings": 128000, "max_window_layers": 28, "num_attention_heads": 28,
        "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.53.1", "use_cache": True, "use_sliding_window": False, "video_token_id": 151656,
        "vision_end_token_id": 151653, "vision_start_token_id": 151652, "vision_token_id": 151654,
        "vocab_size": 152064,
        "text_config": {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584,
            "image_token_id": None, "initializer_range": 0.02, "intermediate_size": 18944,
            "layer_types": ["full_attention"] * 28, "max_position_embeddings": 128000, "max_window_layers": 28,
            "model_type": "qwen2_5_vl_text", "num_attention_heads": 28, "num_hidden_layers": 28,
            "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
            "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0, "sliding_window": None, "torch_dtype": "float32", "use_cache": True,
            "use_sliding_window": False, "video_token_id": None, "vision_end_token_id": 151653,
            "vision_start_token_id": 151652, "vision_token_id": 151654, "vocab_size": 152064},
        "vision_config": {
            "depth": 32, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu", "hidden_size": 1280,
            "in_channels": 3, "in_chans": 3, "initializer_range": 0.02, "intermediate_size": 3420,
            "model_type": "qwen2_5_vl", "num_heads": 16, "out_hidden_size": 3584, "patch_size": 14,
            "spatial_merge_size": 2, "spatial_patch_size": 14, "temporal_patch_size": 2, "tokens_per_second": 2,
            "torch_dtype": "float32", "window_size": 112}},
}
GIB = 2**30
PICTURE = (672, 672)  # (height, width) of the one picture of dynamic-resolution and tiling models


def one_image(cfg, dtype) -> tuple[object, int]:
    """The pixel_values of one image (ShapeDtypeStructs) and its placeholder tokens: a fixed-size
    image, or a PICTURE-sized one: for Qwen2-VL and Qwen2.5-VL through its own `smart_resize`, for
    LLaVA-NeXT and LLaVA-OneVision tiled (its base tile and grid; its placeholders include the
    newlines)."""
    if isinstance(cfg, LlavaNextConfig):
        layout = cfg.layout([PICTURE])
        tiles = 1 + int(layout[0, 1] * layout[0, 2])
        pixels = AnyresPixels(jax.ShapeDtypeStruct((tiles, *cfg.pixel_shape), dtype),
                              jax.ShapeDtypeStruct((1, 2), jnp.int32), jax.ShapeDtypeStruct(layout.shape, jnp.int32))
        return pixels, cfg.image_tokens(*PICTURE)
    if not isinstance(cfg, Qwen2VLConfig):
        return jax.ShapeDtypeStruct((1, *cfg.pixel_shape), dtype), cfg.image_seq_length
    height, width = smart_resize(*PICTURE, Qwen2VLImageProcessorConfig())
    grid = (1, height // cfg.vision.patch_size, width // cfg.vision.patch_size)
    pixels = Pixels(jax.ShapeDtypeStruct((math.prod(grid), cfg.vision.patch_dim), dtype),
                    jax.ShapeDtypeStruct((1, 3), jnp.int32))
    return pixels, cfg.image_tokens(grid)


def abstract_params(cfg, dtype) -> dict:
    """The params a checkpoint of `cfg` converts to, as ShapeDtypeStructs: the converter's dry run
    (`params_from_hf` given `tables.ShapesOnly()`), the first shape where it accepts several."""
    shapes = params_from_hf(cfg, tables.ShapesOnly())
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(tables.accepted_shapes(s)[0], dtype), shapes,
                        is_leaf=lambda x: isinstance(x, (tuple, list)))


def decode_cache(cfg, params: dict, prompt: int, new_tokens: int, method, dtype):
    """The decode cache of `generate.prefill` (ShapeDtypeStructs): one image, prompt = bucket length."""
    ids = jax.ShapeDtypeStruct((1, prompt), jnp.int32)
    valid = jax.ShapeDtypeStruct((1, prompt), jnp.bool_)
    pixels, _ = one_image(cfg, dtype)
    prefill = functools.partial(gen.prefill, cfg, method=method, max_new_tokens=new_tokens,
                                sampling=gen.Sampling())
    _, cache, _ = jax.eval_shape(prefill, params, ids, valid, pixels, jax.random.key(0))
    return cache


def nbytes(*structs) -> int:
    return sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in structs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=4096,
                        help="prompt tokens (a bucket length), more than the largest image (LLaVA-OneVision's 3699)")
    parser.add_argument("--new-tokens", type=at_least(1), default=64)
    parser.add_argument("--budgets", type=kept_fraction, nargs="+", default=[0.2, 0.05])
    args = parser.parse_args()
    configs = {name: parse_config(hf_config) for name, hf_config in CONFIGS.items()}
    images = {name: one_image(cfg, jnp.bfloat16)[1] for name, cfg in configs.items()}
    name, image = max(images.items(), key=lambda c: c[1])
    if args.prompt <= image:
        parser.error(f"--prompt must be more than {image} tokens ({name}'s one image), got {args.prompt}")
    dtype = jnp.bfloat16
    methods = [("full", get_method("full"))] + [(f"{b:.0%}", get_method("lookm", budget=b)) for b in args.budgets]

    print(f"Prompt {args.prompt} tokens (one image) + {args.new_tokens} new tokens, batch 1, bf16 cache; "
          "LOOK-M budgets split evenly into recent and important slots.\n")
    head = ["model", "LM / vision / projector params", "total params", "KV bytes per token"]
    head += [f"cache {name} (slots per head)" for name, _ in methods[:1]]
    head += [f"LOOK-M {name} (slots, x full)" for name, _ in methods[1:]]
    head += [f"image tokens ({PICTURE[1]}x{PICTURE[0]} for dynamic resolution and tiling)"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name, cfg in configs.items():
        params = abstract_params(cfg, dtype)
        counts = {part: sum(math.prod(s.shape) for s in jax.tree.leaves(tree)) for part, tree in params.items()}
        params["text"] = jax.eval_shape(functools.partial(llama.runtime_params, cfg.text), params["text"])  # the layout prefill reads
        caches = [decode_cache(cfg, params, args.prompt, args.new_tokens, method, dtype) for _, method in methods]
        full = nbytes(*caches[0].layer_keys, *caches[0].layer_values)
        t = cfg.text
        per_token = 2 * t.num_layers * t.num_kv_heads * t.head_dim * jnp.dtype(dtype).itemsize
        cells = [name, " / ".join(f"{counts[p] / 1e9:.3f} B" for p in ("text", "vision", "projector")),
                 f"{sum(counts.values()) / 1e9:.3f} B", f"{per_token / 2**10:.0f} KiB"]
        for i, cache in enumerate(caches):
            size = nbytes(*cache.layer_keys, *cache.layer_values)
            assert size == per_token * cache.capacity  # N x K [B, Hkv, D, S] and V [B, Hkv, S, D], nothing else
            ratio = "" if i == 0 else f", {size / full:.3f}x"
            cells.append(f"{size / GIB:.3f} GiB ({cache.capacity}{ratio})")
        cells.append(str(images[name]))
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
