"""MobileVLM-v2: CLIP features -> LDPv2 projector (MLP, 2x2 average pool, PEG) -> spliced at -200 placeholders.

LDPv2 as MobileVLM's `LDPNetV2Projector`: Linear(Hv -> H) + exact GELU + Linear(H -> H) per patch;
the G x G patch grid (row-major) average-pooled 2 x 2 with stride 2 (the original's adaptive pool to
12 x 12 on the 24 x 24 grid of CLIP ViT-L/14-336); then PEG, a depthwise 3 x 3 conv (padding 1,
bias) added to its input; flattened row-major -> (G/2)^2 tokens (144 for the real model).

Params: {"text": llama, "vision": CLIP (models/clip.py), "projector": {w1 [Hv, H], b1, w2 [H, H], b2,
peg_w [3, 3, H], peg_b [H]}}.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lookm_jax.models import clip
from lookm_jax.models.config import CLIPVisionConfig, LlamaConfig
from lookm_jax.models.layers import gelu_exact, linear


@dataclasses.dataclass(frozen=True)
class MobileVLMConfig:
    text: LlamaConfig
    vision: CLIPVisionConfig
    image_token_id: int  # -200, as MobileVLM's IMAGE_TOKEN_INDEX
    vision_feature_layer: int = -2

    @property
    def grid(self) -> int:
        """Patches per side of the CLIP grid."""
        return self.vision.image_size // self.vision.patch_size

    @property
    def image_seq_length(self) -> int:
        return (self.grid // 2) ** 2

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        return (self.vision.num_channels, self.vision.image_size, self.vision.image_size)


def ldp_v2(p: dict, x: jax.Array, grid: int) -> jax.Array:
    """LDPv2 projector: patch features x [n, G*G, Hv] -> [n, (G/2)^2, H]."""
    x = linear(gelu_exact(linear(x, p["w1"], p["b1"])), p["w2"], p["b2"])  # [n, G*G, H]
    n, _, h = x.shape
    half = grid // 2
    x = x.reshape(n, half, 2, half, 2, h).mean(axis=(2, 4))  # [n, G/2, G/2, H]
    padded = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    # Depthwise 3x3 cross-correlation, as torch's Conv2d(groups=H): out[y, x] = sum w[dy, dx] * in[y+dy-1, x+dx-1].
    peg = sum(p["peg_w"][dy, dx] * padded[:, dy:dy + half, dx:dx + half] for dy in range(3) for dx in range(3))
    return (x + peg + p["peg_b"]).reshape(n, half * half, h)


def image_features(cfg: MobileVLMConfig, params: dict, pixel_values: jax.Array) -> jax.Array:
    """pixel_values [n, C, S, S] -> [n, (G/2)^2, H_text]: CLIP hidden_states[layer] without CLS -> LDPv2."""
    index = cfg.vision_feature_layer % (cfg.vision.num_layers + 1)
    feats = clip.hidden_states(cfg.vision, params["vision"], pixel_values, depth=index)[index][:, 1:]
    return ldp_v2(params["projector"], feats, cfg.grid)
