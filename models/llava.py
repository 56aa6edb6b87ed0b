"""LLaVA-1.5: CLIP features -> linear-GELU-linear projector -> spliced at the image placeholders.

Params: {"text": llama params, "vision": CLIP params, "projector": {w1, b1, w2, b2}}; a text-only
model has "text" alone. `embed` is where the modality mask `is_image` is born.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lookm_jax.models import clip, llama
from lookm_jax.models.config import LlamaConfig, LlavaConfig
from lookm_jax.models.layers import gelu_exact, linear


def image_features(cfg: LlavaConfig, params: dict, pixel_values: jax.Array) -> jax.Array:
    """pixel_values [n_images, C, H, W] -> projected features [n_images, T_img, H_text]."""
    n_hidden = cfg.vision.num_layers + 1
    layers = [i % n_hidden for i in cfg.feature_layers]  # negative indices count from the end
    states = clip.hidden_states(cfg.vision, params["vision"], pixel_values, depth=max(layers))
    feats = [states[i] for i in layers]
    if cfg.vision_feature_select_strategy == "default":
        feats = [f[:, 1:] for f in feats]  # drop CLS
    x = jnp.concatenate(feats, axis=-1)
    p = params["projector"]
    return linear(gelu_exact(linear(x, p["w1"], p.get("b1"))), p["w2"], p.get("b2"))


def text_config(cfg: LlavaConfig | LlamaConfig) -> LlamaConfig:
    return cfg.text if isinstance(cfg, LlavaConfig) else cfg


def embed(cfg: LlavaConfig | LlamaConfig, params: dict, input_ids: jax.Array,
          pixel_values: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """input_ids [B, L] (one placeholder per image feature) -> (x [B, L, H], is_image [B, L]).

    Features fill the placeholders in reading order (row-major over batch, then sequence), as HF does.
    The caller checks that the placeholder count equals n_images * image_seq_length. A text-only
    (llama) config gives an all-False `is_image`.
    """
    x = llama.embed_tokens(params["text"], input_ids)
    if not isinstance(cfg, LlavaConfig):
        return x, jnp.zeros(input_ids.shape, bool)
    is_image = input_ids == cfg.image_token_id
    if pixel_values is None:
        return x, is_image
    feats = image_features(cfg, params, pixel_values).astype(x.dtype)
    feats = feats.reshape(-1, feats.shape[-1])  # [n_images * T_img, H]
    index = jnp.clip(jnp.cumsum(is_image.reshape(-1)) - 1, 0, feats.shape[0] - 1).reshape(is_image.shape)
    return jnp.where(is_image[..., None], feats[index], x), is_image
