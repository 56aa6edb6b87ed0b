"""Original-layout LLaVA-family checkpoints: liuhaotian LLaVA-1.5, InternVL-Chat-ViT-6B-Vicuna, MobileVLM-v2.

These configs are one flat Llama config plus `mm_*` keys (`mm_vision_tower`, `mm_projector_type`,
`mm_vision_select_layer`, `mm_vision_select_feature`, `image_aspect_ratio`, ...); the tower's own
config is not in the folder, only its name. It comes, in this order, from `vision_config` (which
`with_local_tower_config` fills in when `mm_vision_tower` names a local folder with a config.json),
else from `KNOWN_TOWERS` (the hub towers the released checkpoints name). Image placeholders are
the id -200 (LLaVA's IMAGE_TOKEN_INDEX), expanded in the token stream to one per image feature.

Checkpoint names (`tables.canonical_name` rewrites them): `model.vision_tower.vision_tower.
[vision_model.]*` -> `vision.*`, `model.mm_projector.{0,2}` -> the llava-hf projector names, other
`model.mm_projector.*` -> `projector.*`; the language model keeps plain Llama names.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from lookm_jax.convert import tables
from lookm_jax.convert.tables import apply_table
from lookm_jax.models.config import CLIPVisionConfig, ConfigError, LlamaConfig, LlavaConfig, _require
from lookm_jax.models.image_processing import IMAGENET_MEAN, IMAGENET_STD
from lookm_jax.models.internvit import InternViTConfig, InternViTLlavaConfig
from lookm_jax.models.mobilevlm import MobileVLMConfig

IMAGE_TOKEN_INDEX = -200
# InternVL's LLaVA code runs InternViT-6B towers at 336 px (its CLIPImageProcessor for them is fixed
# to size 336, crop 336, ImageNet mean/std), whatever resolution the tower was pretrained at.
INTERNVIT_IMAGE_SIZE = 336
# Substrings by which InternVL's LLaVA code recognises an InternViT-6B tower name.
INTERNVIT_NAMES = ("intern_vit_6b", "internvit_6b", "InternViT-6B", "internvit6b")

KNOWN_TOWERS: dict[str, dict[str, Any]] = {
    "openai/clip-vit-large-patch14-336": {
        "model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
        "num_attention_heads": 16, "image_size": 336, "patch_size": 14, "layer_norm_eps": 1e-5,
        "hidden_act": "quick_gelu"},
    "OpenGVLab/InternViT-6B-224px": {
        "model_type": "intern_vit_6b", "hidden_size": 3200, "intermediate_size": 12800, "num_hidden_layers": 48,
        "num_attention_heads": 25, "image_size": 224, "patch_size": 14, "layer_norm_eps": 1e-6,
        "qkv_bias": False, "qk_normalization": True, "hidden_act": "gelu"},
}

# Keys of the original configs that never change an inference forward pass: training switches,
# learning rates, tokenizer/generation limits (`mm_use_im_patch_token` only adds an unused token).
_TRAINING_FIELDS = frozenset({
    "tune_mm_mlp_adapter", "freeze_mm_mlp_adapter", "mm_projector_lr", "mm_vision_tower_lr",
    "unfreeze_mm_vision_tower", "freeze_mm_vision_resampler", "tune_mm_vision_resampler", "use_mm_proj",
    "mm_use_im_patch_token", "tokenizer_model_max_length", "tokenizer_padding_side", "max_length",
    "max_sequence_length",
})
# MobileVLM configs also carry lit-gpt names of the same Llama settings; the HF names are authoritative.
MOBILEVLM_STALE_FIELDS = frozenset({"n_head", "n_query_groups", "norm_eps", "n_embd", "n_layer", "block_size"})
_MM_FIELDS = frozenset({
    "mm_vision_tower", "vision_config", "mm_hidden_size", "mm_projector_type", "mm_vision_select_layer",
    "mm_vision_select_feature", "mm_use_im_start_end", "mm_patch_merge_type", "image_aspect_ratio",
    "vision_tower_type", "image_grid_pinpoints", "mm_resampler_type",
})


def _tower_config(d: dict[str, Any], where: str) -> dict[str, Any]:
    if "vision_config" in d:
        return d["vision_config"]
    name = d["mm_vision_tower"]
    if name in KNOWN_TOWERS:
        return KNOWN_TOWERS[name]
    if any(key in name for key in INTERNVIT_NAMES):
        return KNOWN_TOWERS["OpenGVLab/InternViT-6B-224px"]
    raise ConfigError(f"{where}: unsupported mm_vision_tower={name!r}: not one of {sorted(KNOWN_TOWERS)} "
                      "(nor an InternViT-6B name), and no local folder with its config.json")


def _checked(d: dict[str, Any], where: str, stale: frozenset = frozenset()) -> tuple[LlamaConfig, dict, int, bool]:
    """-> (text config, tower config dict, select layer, keep CLS); refuses what is not implemented."""
    _require(bool(d.get("mm_vision_tower")), where, "mm_vision_tower", d.get("mm_vision_tower"), "a tower name or path")
    _require(not d.get("mm_use_im_start_end", False), where, "mm_use_im_start_end", d.get("mm_use_im_start_end"),
             "false")
    _require(d.get("mm_patch_merge_type", "flat") == "flat", where, "mm_patch_merge_type",
             d.get("mm_patch_merge_type"), "'flat'")
    _require(d.get("image_aspect_ratio") in (None, "pad", "square"), where, "image_aspect_ratio",
             d.get("image_aspect_ratio"), "'pad', 'square' or absent")
    for field in ("image_grid_pinpoints", "mm_resampler_type"):  # anyres tiling / resamplers: not implemented
        _require(d.get(field) is None, where, field, d.get(field), "null")
    feature = d.get("mm_vision_select_feature", "patch")
    _require(feature in ("patch", "cls_patch"), where, "mm_vision_select_feature", feature, "'patch', 'cls_patch'")
    ignored = _MM_FIELDS | _TRAINING_FIELDS | stale | {"model_type"}
    text = {k: v for k, v in d.items() if k not in ignored}
    return (LlamaConfig.from_hf(text, where=where), _tower_config(d, where), int(d.get("mm_vision_select_layer", -2)),
            feature == "cls_patch")


def _check_width(d: dict[str, Any], where: str, tower_width: int) -> None:
    if "mm_hidden_size" in d:
        _require(d["mm_hidden_size"] == tower_width, where, "mm_hidden_size", d["mm_hidden_size"],
                 f"the tower's hidden_size {tower_width}")


def parse_original_llava(d: dict[str, Any]) -> LlavaConfig | InternViTLlavaConfig:
    """An original-layout LLaVA-1.5 config (CLIP or InternViT-6B tower, `mlp2x_gelu` projector)."""
    where = "original llava config"
    _require(d.get("mm_projector_type", "linear") == "mlp2x_gelu", where, "mm_projector_type",
             d.get("mm_projector_type"), "'mlp2x_gelu'")
    text, tower, layer, keep_cls = _checked(d, where)
    if tower.get("model_type") == "intern_vit_6b":
        vision = InternViTConfig.from_hf(tower, INTERNVIT_IMAGE_SIZE)
        _check_width(d, where, vision.hidden_size)
        cfg = InternViTLlavaConfig(text=text, vision=vision, image_token_id=IMAGE_TOKEN_INDEX,
                                   vision_feature_layer=layer, keep_cls=keep_cls)
    else:
        vision = CLIPVisionConfig.from_hf(tower, where=f"{where}: tower")
        _check_width(d, where, vision.hidden_size)
        cfg = LlavaConfig(text=text, vision=vision, image_token_id=IMAGE_TOKEN_INDEX, vision_feature_layer=layer,
                          vision_feature_select_strategy="full" if keep_cls else "default")
    n = cfg.vision.num_layers
    _require(-(n + 1) <= layer <= n, where, "mm_vision_select_layer", layer, f"indices into {n + 1} hidden states")
    return cfg


def parse_llava_any(d: dict[str, Any]) -> LlavaConfig | InternViTLlavaConfig:
    """model_type 'llava': llava-hf (`text_config`) or the original LLaVA layout (`mm_vision_tower`)."""
    if "text_config" in d:
        return LlavaConfig.from_hf(d)
    if "mm_vision_tower" in d:
        return parse_original_llava(d)
    raise ConfigError("llava config has neither text_config (llava-hf layout) nor mm_vision_tower "
                      "(original LLaVA layout)")


def parse_mobilevlm(d: dict[str, Any]) -> MobileVLMConfig:
    """A MobileVLM-v2 config (model_type 'mobilevlm', `ldpnetv2` projector, CLIP tower)."""
    where = "mobilevlm config"
    _require(d.get("mm_projector_type") == "ldpnetv2", where, "mm_projector_type", d.get("mm_projector_type"),
             "'ldpnetv2'")
    _require(d.get("vision_tower_type", "clip") == "clip", where, "vision_tower_type", d.get("vision_tower_type"),
             "'clip'")
    _require(d.get("mm_vision_select_feature", "patch") == "patch", where, "mm_vision_select_feature",
             d.get("mm_vision_select_feature"), "'patch' (LDPv2 needs the square patch grid)")
    text, tower, layer, _ = _checked(d, where, MOBILEVLM_STALE_FIELDS)
    vision = CLIPVisionConfig.from_hf(tower, where=f"{where}: tower")
    _check_width(d, where, vision.hidden_size)
    cfg = MobileVLMConfig(text=text, vision=vision, image_token_id=IMAGE_TOKEN_INDEX, vision_feature_layer=layer)
    n = vision.num_layers
    _require(-(n + 1) <= layer <= n, where, "mm_vision_select_layer", layer, f"indices into {n + 1} hidden states")
    _require(cfg.grid % 2 == 0, where, "vision image_size / patch_size", cfg.grid, "an even patch grid (2x2 pooling)")
    return cfg


def with_local_tower_config(hf_config: dict[str, Any], folder: str) -> dict[str, Any]:
    """If `mm_vision_tower` is a local folder (absolute, or relative to the working directory or to the
    checkpoint `folder`) holding a config.json, return hf_config with it as `vision_config`, so a
    converted model no longer needs that folder. Otherwise hf_config unchanged."""
    name = hf_config.get("mm_vision_tower")
    if not isinstance(name, str) or "vision_config" in hf_config:
        return hf_config
    for base in (os.getcwd(), folder):
        path = os.path.join(base, name, "config.json")
        if os.path.isfile(path):
            return {**hf_config, "vision_config": tables.read_json_object(path)}
    return hf_config


def image_processor(config, hf_config: dict[str, Any], found: dict | None) -> dict | None:
    """The preprocessor settings of an original-layout model: the folder's preprocessor_config.json, else
    the tower's own (CLIP at the tower's resolution; InternViT: 336 px, ImageNet mean/std), with the
    config's `image_aspect_ratio` ('pad': LLaVA's pad-to-square with the mean colour). None for others."""
    if "mm_vision_tower" not in hf_config:
        return None
    if found is None:
        size = config.vision.image_size
        found = {"size": {"shortest_edge": size}, "crop_size": {"height": size, "width": size}}
        if isinstance(config, InternViTLlavaConfig):
            found.update(image_mean=list(IMAGENET_MEAN), image_std=list(IMAGENET_STD))
    return {**found, "image_aspect_ratio": hf_config.get("image_aspect_ratio")}


# ---- tensors -> params ------------------------------------------------------------------------

def _squeeze_leading(w: np.ndarray) -> np.ndarray:
    """InternViT's bare [1, 1, D] / [1, P, D] embedding parameters -> [D] / [P, D]."""
    return w.reshape(w.shape[2:]) if w.shape[:2] == (1, 1) else w[0]


INTERNVIT_TABLE: list[tuple[str, str, tables.Transform]] = [
    ("patch_embed", "embeddings.patch_embedding.weight", tables._conv_to_matrix),
    ("patch_bias", "embeddings.patch_embedding.bias", None),
    ("class_embed", "embeddings.class_embedding", _squeeze_leading),
    ("pos_embed", "embeddings.position_embedding", _squeeze_leading),
    *[(f"layers.{ours}", f"encoder.layers.{{i}}.{hf}", None)
      for ours, hf in (("norm1", "norm1.weight"), ("norm2", "norm2.weight"), ("bqkv", "attn.qkv.bias"),
                       ("q_norm", "attn.q_norm.weight"), ("k_norm", "attn.k_norm.weight"), ("bo", "attn.proj.bias"),
                       ("fc1_b", "mlp.fc1.bias"), ("fc2_b", "mlp.fc2.bias"), ("ls1", "ls1"), ("ls2", "ls2"))],
    *[(f"layers.{ours}", f"encoder.layers.{{i}}.{hf}.weight", tables._t)
      for ours, hf in (("wqkv", "attn.qkv"), ("wo", "attn.proj"), ("fc1_w", "mlp.fc1"), ("fc2_w", "mlp.fc2"))],
]

LDP_V2_TABLE: list[tuple[str, str, tables.Transform]] = [
    ("w1", "mlp.mlp.0.weight", tables._t), ("b1", "mlp.mlp.0.bias", None),
    ("w2", "mlp.mlp.2.weight", tables._t), ("b2", "mlp.mlp.2.bias", None),
    ("peg_w", "peg.peg.0.weight", lambda w: w[:, 0].transpose(1, 2, 0)),  # depthwise [H, 1, 3, 3] -> [3, 3, H]
    ("peg_b", "peg.peg.0.bias", None),
]


def internvit_shapes(cfg: InternViTConfig) -> dict[str, tuple[int, ...]]:
    n, h, i = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    shapes = {"patch_embed": (cfg.num_channels * cfg.patch_size**2, h), "patch_bias": (h,), "class_embed": (h,),
              "pos_embed": (cfg.pretrain_grid**2 + 1, h), "layers.wqkv": (n, h, 3 * h), "layers.bqkv": (n, 3 * h),
              "layers.wo": (n, h, h), "layers.fc1_w": (n, h, i), "layers.fc1_b": (n, i), "layers.fc2_w": (n, i, h)}
    shapes.update({f"layers.{k}": (n, h) for k in ("norm1", "norm2", "q_norm", "k_norm", "bo", "fc2_b", "ls1", "ls2")})
    return shapes


def _mlp_shapes(h_in: int, h: int) -> dict[str, tuple[int, ...]]:
    return {"w1": (h_in, h), "b1": (h,), "w2": (h, h), "b2": (h,)}


def internvit_llava_params(config: InternViTLlavaConfig, tensors: dict[str, np.ndarray], dtype) -> dict:
    """Pop the InternViT tower and `mlp2x_gelu` projector -> {"vision": ..., "projector": ...}."""
    v = config.vision
    skip = (() if v.qkv_bias else ("layers.bqkv",)) + (() if v.qk_normalization else ("layers.q_norm", "layers.k_norm"))
    shapes = internvit_shapes(v)
    # pos_embed: at the pretraining grid, or already resized to the input grid (InternVL's resize_pos_embeddings)
    shapes["pos_embed"] = [shapes["pos_embed"], (v.num_patches + 1, v.hidden_size)]
    return {
        "vision": apply_table(tensors, INTERNVIT_TABLE, "vision.", v.num_layers, shapes, dtype, skip=skip),
        "projector": apply_table(tensors, tables.PROJECTOR_TABLE, "projector.", 0,
                                 _mlp_shapes(v.hidden_size, config.text.hidden_size), dtype),
    }


def mobilevlm_params(config: MobileVLMConfig, tensors: dict[str, np.ndarray], dtype) -> dict:
    """Pop the CLIP tower and LDPv2 projector -> {"vision": ..., "projector": ...}."""
    for name in tables.CLIP_UNUSED:
        tables.drop(tensors, "vision." + name)
    h = config.text.hidden_size
    shapes = {**_mlp_shapes(config.vision.hidden_size, h), "peg_w": (3, 3, h), "peg_b": (h,)}
    return {
        "vision": apply_table(tensors, tables.CLIP_TABLE, "vision.", config.vision.num_layers,
                              tables.clip_shapes(config.vision), dtype),
        "projector": apply_table(tensors, LDP_V2_TABLE, "projector.", 0, shapes, dtype),
    }

