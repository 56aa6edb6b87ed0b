"""Qwen2.5-VL checkpoints: tensor-name table for the windowed vision tower and its patch merger.

Names as for Qwen2-VL (`convert.qwen2_vl`: the tower and the merger under "vision."); the patch
embedding and the merger's MLP are Qwen2-VL's rows, the norms are RMSNorms (weights only) and the
blocks' MLP is SwiGLU (gate/up/down, with biases).
"""

from __future__ import annotations

import numpy as np

from lookm_jax.convert.qwen2_vl import MERGER_TABLE as QWEN2_VL_MERGER, VISION_TABLE as QWEN2_VL_VISION
from lookm_jax.convert.tables import Transform, _t, apply_table
from lookm_jax.models.qwen2_5_vl import Qwen2_5_VLConfig

_BLOCK = "blocks.{i}."
_SAME = {"patch_embed", "layers.w_qkv", "layers.b_qkv", "layers.wo", "layers.bo"}  # Qwen2-VL's rows as they are
VISION_TABLE: list[tuple[str, str, Transform]] = [
    *[row for row in QWEN2_VL_VISION if row[0] in _SAME],
    ("layers.norm1_w", f"{_BLOCK}norm1.weight", None), ("layers.norm2_w", f"{_BLOCK}norm2.weight", None),
    *[row for proj in ("gate", "up", "down") for row in ((f"layers.{proj}_w", f"{_BLOCK}mlp.{proj}_proj.weight", _t),
                                                         (f"layers.{proj}_b", f"{_BLOCK}mlp.{proj}_proj.bias", None))],
]
MERGER_TABLE: list[tuple[str, str, Transform]] = [row for row in QWEN2_VL_MERGER if row[0] != "norm_b"]


def vision_shapes(cfg: Qwen2_5_VLConfig) -> dict[str, tuple[int, ...]]:
    v = cfg.vision
    n, h, i = v.depth, v.hidden_size, v.intermediate_size
    return {"patch_embed": (v.patch_dim, h), "layers.w_qkv": (n, h, 3 * h), "layers.b_qkv": (n, 3 * h),
            "layers.wo": (n, h, h), "layers.bo": (n, h), "layers.norm1_w": (n, h), "layers.norm2_w": (n, h),
            "layers.gate_w": (n, h, i), "layers.gate_b": (n, i), "layers.up_w": (n, h, i), "layers.up_b": (n, i),
            "layers.down_w": (n, i, h), "layers.down_b": (n, h)}


def merger_shapes(cfg: Qwen2_5_VLConfig) -> dict[str, tuple[int, ...]]:
    width = cfg.merge**2 * cfg.vision.hidden_size
    return {"norm_w": (cfg.vision.hidden_size,), "w1": (width, width), "b1": (width,),
            "w2": (width, cfg.text.hidden_size), "b2": (cfg.text.hidden_size,)}


def qwen2_5_vl_vision_params(config: Qwen2_5_VLConfig, tensors: dict[str, np.ndarray], dtype) -> dict:
    """Pop the tower and the merger -> {"vision": ..., "projector": ...}."""
    return {
        "vision": apply_table(tensors, VISION_TABLE, "vision.", config.vision.depth, vision_shapes(config), dtype),
        "projector": apply_table(tensors, MERGER_TABLE, "vision.", 0, merger_shapes(config), dtype,
                                 placed_as="projector."),  # the merger's tensors sit under the tower's prefix
    }
