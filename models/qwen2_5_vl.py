"""Qwen2.5-VL (transformers `Qwen2_5_VLForConditionalGeneration`): Qwen2-VL with a windowed tower.

What Qwen2-VL's code does here unchanged (`qwen2_vl`): the patches and their merge-window order,
`Pixels`, the tower's 2-D RoPE and attention, the prompt's image expansion and checks, M-RoPE
positions (`mrope_positions`: for pictures HF's `get_rope_index` is Qwen2-VL's), the decoder and
the image processor (`qwen2_vl_processing`: Qwen2.5-VL's checkpoints use Qwen2VLImageProcessor).

What differs, in the tower: RMSNorm (no bias) in place of LayerNorm, a SwiGLU MLP with biases
(down(silu(gate(x)) * up(x))), and window attention: a patch attends to the patches of its own
window, a square of `window_size // (merge * patch)` merged tokens on each image's merged grid
(windows start at the top left; the last row and column of windows may be cut short), except in
the blocks listed in `fullatt_block_indexes`, which attend within the whole image. The merger
normalises with RMSNorm. Its output width is `out_hidden_size` (`hidden_size` is the tower's).

HF reorders the patches by window (`get_vision_window_index`) so that each window is contiguous
for its varlen kernels, and restores the order after the merger. Attention under a mask does not
depend on the order of the tokens, and the reorder moves whole merge units (which the merger
keeps together), so here the patches stay in order and a mask says who shares a window
(`window_layout`, tested against HF's windows).

Params: {"text": llama params, "vision": ..., "projector": ...}; vision (blocks stacked on N):
    patch_embed [C*T*p*p, Hv]; layers: norm1_w, norm2_w [N, Hv], w_qkv [N, Hv, 3*Hv], b_qkv [N, 3*Hv],
    wo [N, Hv, Hv], bo [N, Hv], gate_w, up_w [N, Hv, I], gate_b, up_b [N, I], down_w [N, I, Hv],
    down_b [N, Hv]. projector (the merger): norm_w [Hv], w1 [m*m*Hv, m*m*Hv], b1 [m*m*Hv],
    w2 [m*m*Hv, H], b2 [H].
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from lookm_jax.models.config import _check_fields, _require
from lookm_jax.models.layers import gelu_exact, linear, rms_norm
from lookm_jax.models.qwen2_vl import (NORM_EPS, VISION_ROPE_THETA, Pixels, Qwen2VLConfig, patch_layout,
                                       vision_attention, vision_rope)


@dataclasses.dataclass(frozen=True)
class Qwen2_5_VLVisionConfig:
    """Defaults are HF's Qwen2_5_VLVisionConfig's."""

    depth: int = 32
    hidden_size: int = 3584  # the tower's width (Qwen2.5-VL-7B's config says 1280)
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112  # pixels on a side of an attention window
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    out_hidden_size: int = 3584  # the merger's output: the decoder's width
    OUTPUT_FIELD = "out_hidden_size"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def output_size(self) -> int:
        return self.out_hidden_size

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch: C x T x p x p."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def window_tokens(self) -> int:
        """Merged tokens on a side of a window (HF's `vit_merger_window_size`)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "vision_config") -> "Qwen2_5_VLVisionConfig":
        _require(d.get("model_type", "qwen2_5_vl_vision") in ("qwen2_5_vl_vision", "qwen2_5_vl"), where,
                 "model_type", d.get("model_type"), "'qwen2_5_vl_vision'")
        handled = {"depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "in_chans", "patch_size",
                   "spatial_patch_size", "spatial_merge_size", "temporal_patch_size", "window_size",
                   "fullatt_block_indexes", "out_hidden_size", "hidden_act", "rope_parameters",
                   "tokens_per_second"}  # tokens_per_second: videos' time positions only
        _check_fields(d, handled, where)
        rope = d.get("rope_parameters") or {}
        _require(rope.get("rope_type", "axial") == "axial" and float(rope.get("rope_theta", VISION_ROPE_THETA))
                 == VISION_ROPE_THETA and set(rope) <= {"rope_type", "rope_theta"}, where, "rope_parameters", rope,
                 f"axial RoPE with theta {VISION_ROPE_THETA:g}")
        _require(d.get("hidden_act", "silu") == "silu", where, "hidden_act", d.get("hidden_act"), "'silu'")
        defaults = cls()
        ints = {}
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                     "spatial_merge_size", "temporal_patch_size", "window_size", "out_hidden_size"):
            value = d.get(name, getattr(defaults, name))
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, where, name, value,
                     "an int >= 1")
            ints[name] = value
        # Older hub files also write these; HF reads in_channels and patch_size.
        for alias, name in (("in_chans", "in_channels"), ("spatial_patch_size", "patch_size")):
            _require(d.get(alias, ints[name]) == ints[name], where, alias, d.get(alias), f"{name} ({ints[name]})")
        full = d.get("fullatt_block_indexes", defaults.fullatt_block_indexes)
        _require(isinstance(full, (list, tuple)) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < ints["depth"] for i in full), where,
                 "fullatt_block_indexes", full, f"block indices in [0, depth={ints['depth']})")
        cfg = cls(**ints, fullatt_block_indexes=tuple(sorted(set(full))))
        _require(cfg.hidden_size % (4 * cfg.num_heads) == 0, where, "num_heads", cfg.num_heads,
                 f"a divisor of hidden_size={cfg.hidden_size} leaving a head width divisible by 4 (2-D RoPE)")
        _require(cfg.window_tokens >= 1, where, "window_size", cfg.window_size,
                 f"at least one merge window of pixels ({cfg.spatial_merge_size * cfg.patch_size})")
        return cfg


@dataclasses.dataclass(frozen=True)
class Qwen2_5_VLConfig(Qwen2VLConfig):
    """Qwen2-VL's config (prompt expansion, pixel checks, M-RoPE) with Qwen2.5-VL's tower."""

    vision: Qwen2_5_VLVisionConfig

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "Qwen2_5_VLConfig":
        """A Qwen2.5-VL config.json: flat (the hub's first), flat + text_config (transformers 4.5x's
        resave) or transformers 5's nested one."""
        return cls._from_hf(d, "qwen2_5_vl", Qwen2_5_VLVisionConfig.from_hf)


def window_layout(cfg: Qwen2_5_VLVisionConfig, grid: jax.Array,
                  num_patches: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """grid [n, 3] -> each of the P (static) patches' (image, row, column, window) [P] int32: the
    window is numbered row-major within its image (HF's `get_vision_window_index`)."""
    merge, side = cfg.spatial_merge_size, cfg.window_tokens
    image, row, col = patch_layout(grid, num_patches, merge)
    windows_per_row = grid[image, 2] // merge // side + 1  # HF pads every row with at least one more
    window = row // merge // side * windows_per_row + col // merge // side
    return image, row, col, window


def _block(cfg: Qwen2_5_VLVisionConfig, lp: dict, h: jax.Array, cos: jax.Array, sin: jax.Array,
           mask: jax.Array) -> jax.Array:
    """One pre-RMSNorm block over all patches h [P, Hv]: attention under `mask` [1, 1, 1, P, P], SwiGLU."""
    h = h + vision_attention(cfg.num_heads, lp, rms_norm(h, lp["norm1_w"], NORM_EPS), cos, sin, mask)
    x = rms_norm(h, lp["norm2_w"], NORM_EPS)
    gate = jax.nn.silu(linear(x, lp["gate_w"], lp["gate_b"]))
    return h + linear(gate * linear(x, lp["up_w"], lp["up_b"]), lp["down_w"], lp["down_b"])


def image_features(cfg: Qwen2_5_VLConfig, params: dict, pixels: Pixels) -> jax.Array:
    """Pixels (P patches) -> merged features [P / m^2, H_text], every image's tokens in order."""
    v, vp = cfg.vision, params["vision"]
    patches = pixels.patches.astype(vp["patch_embed"].dtype)
    image, row, col, window = window_layout(v, pixels.grid, patches.shape[0])
    cos, sin = vision_rope(v, row, col)
    same_image = image[:, None] == image[None, :]  # [P, P]
    same_window = same_image & (window[:, None] == window[None, :])
    full = jnp.zeros(v.depth, bool).at[jnp.asarray(v.fullatt_block_indexes, jnp.int32)].set(True)  # [N]

    def step(h, layer):
        lp, whole_image = layer
        mask = jnp.where(whole_image, same_image, same_window)[None, None, None]  # [1, 1, 1, P, P]
        return _block(v, lp, h, cos, sin, mask), None

    h, _ = jax.lax.scan(step, patches @ vp["patch_embed"], (vp["layers"], full))  # [P, Hv]
    p = params["projector"]
    x = rms_norm(h, p["norm_w"], NORM_EPS).reshape(-1, v.spatial_merge_size**2 * v.hidden_size)
    return linear(gelu_exact(linear(x, p["w1"], p["b1"])), p["w2"], p["b2"])
