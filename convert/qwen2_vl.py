"""Qwen2-VL checkpoints: tensor-name table for the vision tower and its patch merger.

Names are canonical (see `tables.canonical_name`): the tower and the merger under "vision."
(`visual.*` in hub files, `model.visual.*` as transformers 5 saves them), the decoder under
"model." (mapped by `tables.LLAMA_TABLE`).
"""

from __future__ import annotations

import numpy as np

from lookm_jax.convert.tables import Transform, _t, apply_table
from lookm_jax.models.qwen2_vl import Qwen2VLConfig


def _conv3d_to_matrix(w: np.ndarray) -> np.ndarray:
    """Patch Conv3d [Hv, C, T, p, p] -> [C*T*p*p, Hv], the flattened patches' (C, T, p, p) order."""
    return w.reshape(w.shape[0], -1).T


_BLOCK = "blocks.{i}."
VISION_TABLE: list[tuple[str, str, Transform]] = [
    ("patch_embed", "patch_embed.proj.weight", _conv3d_to_matrix),
    *[(f"layers.{norm}_{wb}", f"{_BLOCK}{norm}.{'weight' if wb == 'w' else 'bias'}", None)
      for norm in ("norm1", "norm2") for wb in "wb"],
    ("layers.w_qkv", f"{_BLOCK}attn.qkv.weight", _t), ("layers.b_qkv", f"{_BLOCK}attn.qkv.bias", None),
    ("layers.wo", f"{_BLOCK}attn.proj.weight", _t), ("layers.bo", f"{_BLOCK}attn.proj.bias", None),
    ("layers.fc1_w", f"{_BLOCK}mlp.fc1.weight", _t), ("layers.fc1_b", f"{_BLOCK}mlp.fc1.bias", None),
    ("layers.fc2_w", f"{_BLOCK}mlp.fc2.weight", _t), ("layers.fc2_b", f"{_BLOCK}mlp.fc2.bias", None),
]
MERGER_TABLE: list[tuple[str, str, Transform]] = [
    ("norm_w", "merger.ln_q.weight", None), ("norm_b", "merger.ln_q.bias", None),
    ("w1", "merger.mlp.0.weight", _t), ("b1", "merger.mlp.0.bias", None),
    ("w2", "merger.mlp.2.weight", _t), ("b2", "merger.mlp.2.bias", None),
]


def vision_shapes(cfg: Qwen2VLConfig) -> dict[str, tuple[int, ...]]:
    v = cfg.vision
    n, h, i = v.depth, v.embed_dim, v.mlp_dim
    shapes = {"patch_embed": (v.patch_dim, h), "layers.w_qkv": (n, h, 3 * h), "layers.b_qkv": (n, 3 * h),
              "layers.wo": (n, h, h), "layers.fc1_w": (n, h, i), "layers.fc1_b": (n, i), "layers.fc2_w": (n, i, h)}
    shapes.update({f"layers.{k}": (n, h) for k in ("norm1_w", "norm1_b", "norm2_w", "norm2_b", "bo", "fc2_b")})
    return shapes


def merger_shapes(cfg: Qwen2VLConfig) -> dict[str, tuple[int, ...]]:
    width = cfg.merge**2 * cfg.vision.embed_dim
    return {"norm_w": (cfg.vision.embed_dim,), "norm_b": (cfg.vision.embed_dim,), "w1": (width, width),
            "b1": (width,), "w2": (width, cfg.text.hidden_size), "b2": (cfg.text.hidden_size,)}


def qwen2_vl_vision_params(config: Qwen2VLConfig, tensors: dict[str, np.ndarray], dtype) -> dict:
    """Pop the tower and the merger -> {"vision": ..., "projector": ...}."""
    return {
        "vision": apply_table(tensors, VISION_TABLE, "vision.", config.vision.depth, vision_shapes(config), dtype),
        "projector": apply_table(tensors, MERGER_TABLE, "vision.", 0, merger_shapes(config), dtype,
                                 placed_as="projector."),  # the merger's tensors sit under the tower's prefix
    }
