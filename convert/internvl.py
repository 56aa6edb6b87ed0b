"""HF-format InternVL checkpoints: tensor-name table for the vision tower and projector.

Names are canonical (see `tables.canonical_name`): the tower under "vision.", the projector under
"projector.", the Qwen2/Llama decoder under "model." (mapped by `tables.LLAMA_TABLE`).
"""

from __future__ import annotations

import numpy as np

from lookm_jax.convert.tables import Transform, _conv_to_matrix, _t, apply_table, drop
from lookm_jax.models.internvl import InternVLConfig


def _first(w: np.ndarray) -> np.ndarray:
    """Drop a leading batch axis of one: position_embeddings [1, P+1, Hv] -> [P+1, Hv]."""
    return w[0]


def _vector(w: np.ndarray) -> np.ndarray:
    """cls_token [1, 1, Hv] -> [Hv]."""
    return w.reshape(-1)


_LAYER = "encoder.layer.{i}."
VISION_TABLE: list[tuple[str, str, Transform]] = [
    ("patch_embed", "embeddings.patch_embeddings.projection.weight", _conv_to_matrix),
    ("patch_bias", "embeddings.patch_embeddings.projection.bias", None),
    ("class_embed", "embeddings.cls_token", _vector),
    ("pos_embed", "embeddings.position_embeddings", _first),
    *[(f"layers.{ours}_{wb}", f"{_LAYER}{hf}.{'weight' if wb == 'w' else 'bias'}", None)
      for ours, hf in (("norm1", "layernorm_before"), ("norm2", "layernorm_after")) for wb in "wb"],
    *[(f"layers.w{c}", f"{_LAYER}attention.{c}_proj.weight", _t) for c in "qkv"],
    *[(f"layers.b{c}", f"{_LAYER}attention.{c}_proj.bias", None) for c in "qkv"],
    ("layers.q_norm", f"{_LAYER}attention.q_norm.weight", None),
    ("layers.k_norm", f"{_LAYER}attention.k_norm.weight", None),
    ("layers.wo", f"{_LAYER}attention.projection_layer.weight", _t),
    ("layers.bo", f"{_LAYER}attention.projection_layer.bias", None),
    ("layers.ls1", f"{_LAYER}lambda_1", None),
    ("layers.ls2", f"{_LAYER}lambda_2", None),
    ("layers.fc1_w", f"{_LAYER}mlp.fc1.weight", _t), ("layers.fc1_b", f"{_LAYER}mlp.fc1.bias", None),
    ("layers.fc2_w", f"{_LAYER}mlp.fc2.weight", _t), ("layers.fc2_b", f"{_LAYER}mlp.fc2.bias", None),
]
# Present when use_mask_token is set; only masked-image-modelling training reads it.
VISION_UNUSED = ("embeddings.mask_token",)

PROJECTOR_TABLE: list[tuple[str, str, Transform]] = [
    ("norm_w", "layer_norm.weight", None), ("norm_b", "layer_norm.bias", None),
    ("w1", "linear_1.weight", _t), ("b1", "linear_1.bias", None),
    ("w2", "linear_2.weight", _t), ("b2", "linear_2.bias", None),
]


def vision_shapes(cfg: InternVLConfig) -> dict[str, tuple[int, ...]]:
    v = cfg.vision
    n, h, i = v.num_layers, v.hidden_size, v.intermediate_size
    shapes = {"patch_embed": (v.num_channels * v.patch_size**2, h), "patch_bias": (h,), "class_embed": (h,),
              "pos_embed": (v.grid**2 + 1, h), "layers.fc1_w": (n, h, i), "layers.fc1_b": (n, i),
              "layers.fc2_w": (n, i, h)}
    shapes.update({f"layers.{k}": (n, h, h) for k in ("wq", "wk", "wv", "wo")})
    shapes.update({f"layers.{k}": (n, h) for k in ("bq", "bk", "bv", "bo", "q_norm", "k_norm", "ls1", "ls2",
                                                   "norm1_w", "norm1_b", "norm2_w", "norm2_b", "fc2_b")})
    return shapes


def projector_shapes(cfg: InternVLConfig) -> dict[str, tuple[int, ...]]:
    width, h = cfg.shuffle**2 * cfg.vision.hidden_size, cfg.text.hidden_size
    return {"norm_w": (width,), "norm_b": (width,), "w1": (width, h), "b1": (h,), "w2": (h, h), "b2": (h,)}


def _absent(cfg: InternVLConfig) -> tuple[str, ...]:
    """Table rows this config has no tensors for."""
    v = cfg.vision
    return ((() if v.use_absolute_position_embeddings else ("pos_embed",))
            + (() if v.attention_bias else ("layers.bq", "layers.bk", "layers.bv"))
            + (() if v.use_qk_norm else ("layers.q_norm", "layers.k_norm"))
            + (("layers.norm1_b", "layers.norm2_b") if v.norm_type == "rms_norm" else ()))


def internvl_vision_params(config: InternVLConfig, tensors: dict[str, np.ndarray], dtype) -> dict:
    """Pop the InternViT tower and the projector -> {"vision": ..., "projector": ...}."""
    for name in VISION_UNUSED:
        drop(tensors, "vision." + name)
    return {
        "vision": apply_table(tensors, VISION_TABLE, "vision.", config.vision.num_layers, vision_shapes(config),
                              dtype, skip=_absent(config)),
        "projector": apply_table(tensors, PROJECTOR_TABLE, "projector.", 0, projector_shapes(config), dtype),
    }
