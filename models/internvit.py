"""InternViT-6B in a LLaVA-1.5 model: InternVL-Chat-ViT-6B-Vicuna-7B/13B (LOOK-M's "InternVL-v1.5").

The tower as InternVL's `InternVisionModel` computes it: a biased patch conv, class token and
position embeddings (the pretraining grid, bicubic-interpolated to the input's patch grid as
torch's `F.interpolate(mode="bicubic", align_corners=False)`), then layers
`h += ls1 * attn(rms1(h)); h += ls2 * mlp(rms2(h))` with a fused qkv projection, optional q/k RMSNorm
over the full width before the head split, and exact-GELU MLP. No pre- or post-norm. LLaVA takes
hidden_states[-4], drops CLS and applies the `mlp2x_gelu` projector.

Params (layers stacked on a leading axis N; weights [in, out]):
    vision: patch_embed [C*p*p, Hv], patch_bias [Hv], class_embed [Hv], pos_embed [G0*G0+1, Hv] (G0: the
        pretraining grid, or the input's grid in a checkpoint whose embeddings were resized already),
        layers: norm1/norm2 [Hv], wqkv [Hv, 3Hv] (+ bqkv [3Hv] when qkv_bias), q_norm/k_norm [Hv]
        (when qk_normalization), wo/bo, fc1_w/fc1_b, fc2_w/fc2_b, ls1/ls2 [Hv].
    projector: w1 [Hv, H], b1, w2 [H, H], b2.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax.models.clip import patchify, stack_hidden_states
from lookm_jax.models.config import LlamaConfig, _check_fields, _require
from lookm_jax.models.layers import gelu_exact, linear, rms_norm
from lookm_jax.models.llama import attend


@dataclasses.dataclass(frozen=True)
class InternViTConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    pretrain_image_size: int  # the position embeddings' grid: pretrain_image_size // patch_size per side
    image_size: int  # the input the tower runs at (LLaVA's image processor crop)
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    qkv_bias: bool = False
    qk_normalization: bool = True

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def pretrain_grid(self) -> int:
        return self.pretrain_image_size // self.patch_size

    @classmethod
    def from_hf(cls, d: dict[str, Any], image_size: int, where: str = "vision tower config") -> "InternViTConfig":
        """From an `InternVisionConfig` dict (model_type 'intern_vit_6b'), run at `image_size` pixels."""
        handled = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                   "patch_size", "num_channels", "layer_norm_eps", "qkv_bias", "qk_normalization", "hidden_act",
                   "norm_type", "use_flash_attn", "drop_path_rate"}  # the last two: kernels / training only
        _check_fields(d, handled, where)
        _require(d.get("hidden_act", "gelu") == "gelu", where, "hidden_act", d.get("hidden_act"), "'gelu' (exact erf)")
        _require(d.get("norm_type", "rms_norm") == "rms_norm", where, "norm_type", d.get("norm_type"), "'rms_norm'")
        cfg = cls(hidden_size=int(d["hidden_size"]), intermediate_size=int(d["intermediate_size"]),
                  num_layers=int(d["num_hidden_layers"]), num_heads=int(d["num_attention_heads"]),
                  pretrain_image_size=int(d["image_size"]), image_size=int(image_size),
                  patch_size=int(d["patch_size"]), num_channels=int(d.get("num_channels", 3)),
                  layer_norm_eps=float(d.get("layer_norm_eps", 1e-6)), qkv_bias=bool(d.get("qkv_bias", False)),
                  qk_normalization=bool(d.get("qk_normalization", True)))
        for name in ("image_size", "pretrain_image_size"):
            _require(getattr(cfg, name) % cfg.patch_size == 0, where, name, getattr(cfg, name),
                     f"a multiple of patch_size={cfg.patch_size}")
        _require(cfg.hidden_size % cfg.num_heads == 0, where, "num_attention_heads", cfg.num_heads,
                 f"a divisor of hidden_size={cfg.hidden_size}")
        return cfg


@dataclasses.dataclass(frozen=True)
class InternViTLlavaConfig:
    """LLaVA-1.5 (original layout) with an InternViT tower; placeholders carry `image_token_id` (-200)."""

    text: LlamaConfig
    vision: InternViTConfig
    image_token_id: int
    vision_feature_layer: int = -4
    keep_cls: bool = False  # mm_vision_select_feature: 'patch' drops CLS, 'cls_patch' keeps it

    @property
    def image_seq_length(self) -> int:
        return self.vision.num_patches + self.keep_cls

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        return (self.vision.num_channels, self.vision.image_size, self.vision.image_size)


def bicubic_matrix(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] float64 weights of torch's 1-D bicubic resize (align_corners=False, A=-0.75).

    Source coordinate (i + 0.5) * n_in / n_out - 0.5, four taps at floor - 1 .. floor + 2 with the
    Keys cubic kernel, taps outside the input clamped to its edge, as `upsample_bicubic2d` does.
    """
    a = -0.75
    src = (np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5
    base = np.floor(src)
    t = src - base

    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    weights = np.zeros((n_out, n_in))
    for offset, coeff in zip((-1, 0, 1, 2), (far(t + 1), near(t), near(1 - t), far(2 - t))):
        idx = np.clip(base + offset, 0, n_in - 1).astype(int)
        np.add.at(weights, (np.arange(n_out), idx), coeff)
    return weights


def position_embeddings(cfg: InternViTConfig, pos_embed: jax.Array) -> jax.Array:
    """[G0*G0+1, Hv] (the grid the checkpoint stores) -> [G*G+1, Hv] for the input's grid; CLS row unchanged."""
    g0, g = math.isqrt(pos_embed.shape[0] - 1), cfg.image_size // cfg.patch_size
    if g0 == g:
        return pos_embed
    resize = jnp.asarray(bicubic_matrix(g0, g), jnp.float32)  # [G, G0]
    grid = pos_embed[1:].astype(jnp.float32).reshape(g0, g0, -1)  # row-major (y, x) as torch's reshape
    grid = jnp.einsum("yi,xj,ijc->yxc", resize, resize, grid, precision=jax.lax.Precision.HIGHEST)
    return jnp.concatenate([pos_embed[:1], grid.reshape(g * g, -1).astype(pos_embed.dtype)], axis=0)


def _encoder_layer(cfg: InternViTConfig, lp: dict, h: jax.Array) -> jax.Array:
    """h [N, T, Hv] -> [N, T, Hv]."""
    n, t, width = h.shape
    x = rms_norm(h, lp["norm1"], cfg.layer_norm_eps)
    q, k, v = jnp.split(linear(x, lp["wqkv"], lp.get("bqkv")), 3, axis=-1)  # each [N, T, Hv]
    if cfg.qk_normalization:  # over the full width, before the head split
        q, k = rms_norm(q, lp["q_norm"], cfg.layer_norm_eps), rms_norm(k, lp["k_norm"], cfg.layer_norm_eps)

    def heads(y):
        return y.reshape(n, t, cfg.num_heads, -1).transpose(0, 2, 1, 3)

    attn = attend(heads(q), heads(k), heads(v), jnp.ones((1, 1, 1, 1, t), bool))
    h = h + lp["ls1"] * linear(attn.transpose(0, 2, 1, 3).reshape(n, t, width), lp["wo"], lp["bo"])
    x = rms_norm(h, lp["norm2"], cfg.layer_norm_eps)
    return h + lp["ls2"] * linear(gelu_exact(linear(x, lp["fc1_w"], lp["fc1_b"])), lp["fc2_w"], lp["fc2_b"])


def hidden_states(cfg: InternViTConfig, params: dict, pixel_values: jax.Array, depth: int) -> jax.Array:
    """[depth + 1, N, G*G+1, Hv]: entry 0 the embeddings, entry i the output of layer i (`depth` static)."""
    x = linear(patchify(cfg, pixel_values.astype(params["patch_embed"].dtype)), params["patch_embed"],
               params["patch_bias"])
    cls = jnp.broadcast_to(params["class_embed"], (x.shape[0], 1, x.shape[-1]))
    x = jnp.concatenate([cls, x], axis=1) + position_embeddings(cfg, params["pos_embed"])
    return stack_hidden_states(lambda h, lp: _encoder_layer(cfg, lp, h), params["layers"], x, depth)


def image_features(cfg: InternViTLlavaConfig, params: dict, pixel_values: jax.Array) -> jax.Array:
    """pixel_values [n, C, S, S] -> [n, image_seq_length, H_text]: hidden_states[layer] -> mlp2x_gelu."""
    index = cfg.vision_feature_layer % (cfg.vision.num_layers + 1)
    feats = hidden_states(cfg.vision, params["vision"], pixel_values, depth=index)[index]
    if not cfg.keep_cls:
        feats = feats[:, 1:]
    p = params["projector"]
    return linear(gelu_exact(linear(feats, p["w1"], p["b1"])), p["w2"], p["b2"])
