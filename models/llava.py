"""LLaVA-1.5: CLIP features -> linear-GELU-linear projector -> spliced at the image placeholders.

Params: {"text": llama params, "vision": CLIP params, "projector": {w1, b1, w2, b2}}; a text-only
model has "text" alone. `embed` is where the modality mask `is_image` is born. A model may also carry
"image_adapters" ({name: {"a": [N, R, In], "b": [N, Out, R]}}, `cfg.image_adapter_rank` > 0): low-rank
updates of the decoder's weights that act on image tokens only (`decoder_params`), e.g. the demo's.

The splice is shared by every multimodal architecture. A multimodal config has `text`
(LlamaConfig), `image_token_id`, `image_seq_length` (features per unit of pixel_values: an image,
or a tile for tiling models) and `pixel_shape` (C, H, W of one unit); its type maps to a features
function in `IMAGE_FEATURES`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from lookm_jax.models import (clip, internvit, internvl, llama, llava_next, llava_onevision, mobilevlm, qwen2_5_vl,
                              qwen2_vl, siglip)
from lookm_jax.models.config import LlamaConfig, LlavaConfig
from lookm_jax.models.layers import gelu_exact, linear


def llava_image_features(cfg: LlavaConfig, params: dict, pixel_values: jax.Array) -> jax.Array:
    """pixel_values [n_images, C, H, W] -> projected features [n_images, T_img, H_text] (a CLIP
    tower, or SigLIP's for LLaVA-OneVision)."""
    n_hidden = cfg.vision.num_layers + 1
    layers = [i % n_hidden for i in cfg.feature_layers]  # negative indices count from the end
    tower = siglip.hidden_states if isinstance(cfg.vision, siglip.SiglipVisionConfig) else clip.hidden_states
    states = tower(cfg.vision, params["vision"], pixel_values, depth=max(layers))
    feats = [states[i] for i in layers]
    if cfg.vision_feature_select_strategy == "default":
        feats = [f[:, 1:] for f in feats]  # drop CLS
    x = jnp.concatenate(feats, axis=-1)
    p = params["projector"]
    return linear(gelu_exact(linear(x, p["w1"], p.get("b1"))), p["w2"], p.get("b2"))


def llava_next_image_features(cfg: llava_next.LlavaNextConfig, params: dict,
                              pixels: llava_next.AnyresPixels) -> jax.Array:
    """LLaVA-NeXT and LLaVA-OneVision: every tile as LLaVA-1.5's image [U, s*s, H], packed with the
    newline (`llava_next.pack_features`) -> [1, cfg.buffer_rows(U, n), H]."""
    features = llava_image_features(cfg, params, pixels.tiles)
    return llava_next.pack_features(cfg, features, params["projector"]["newline"], pixels)


# config type -> features(cfg, params, pixel_values [n_units, C, H, W]) -> [n_units, image_seq_length, H_text]
# (or, for packing architectures, every image's features in order: [1, T, H_text], T >= the placeholders).
# Other architectures define theirs in models/<arch>.py (which must not import this module) and are listed here.
# Each architecture's input processor (pictures -> pixel_values, chat turn -> ids) is listed in processors.PROCESSORS.
IMAGE_FEATURES: dict[type, Callable[[Any, dict, jax.Array], jax.Array]] = {
    LlavaConfig: llava_image_features,
    llava_next.LlavaNextConfig: llava_next_image_features,
    llava_onevision.LlavaOnevisionConfig: llava_next_image_features,
    internvit.InternViTLlavaConfig: internvit.image_features,
    mobilevlm.MobileVLMConfig: mobilevlm.image_features,
    internvl.InternVLConfig: internvl.internvl_image_features,
    qwen2_vl.Qwen2VLConfig: qwen2_vl.image_features,
    qwen2_5_vl.Qwen2_5_VLConfig: qwen2_5_vl.image_features,
}

# config type -> positions(cfg, input_ids, valid, pixel_values) -> (RoPE positions [3, B, L], next
# position [B]) for architectures whose positions are not 0 .. L-1 (M-RoPE); `rope_positions` uses it.
ROPE_POSITIONS: dict[type, Callable] = {qwen2_vl.Qwen2VLConfig: qwen2_vl.mrope_positions,
                                        qwen2_5_vl.Qwen2_5_VLConfig: qwen2_vl.mrope_positions}


def image_features(cfg, params: dict, pixel_values: jax.Array) -> jax.Array:
    """Projected image features of any registered multimodal architecture."""
    try:
        features = IMAGE_FEATURES[type(cfg)]
    except KeyError:
        raise TypeError(f"no image features registered for {type(cfg).__name__}") from None
    return features(cfg, params, pixel_values)


def rope_positions(cfg, input_ids: jax.Array, valid: jax.Array, pixel_values) -> tuple[jax.Array, jax.Array]:
    """Right-padded rows -> (RoPE positions [B, L], or M-RoPE's [3, B, L]; next position [B]: where
    each row's first new token goes). Without an entry in `ROPE_POSITIONS`: 0 .. L-1 and the lengths."""
    if type(cfg) in ROPE_POSITIONS:
        return ROPE_POSITIONS[type(cfg)](cfg, input_ids, valid, pixel_values)
    return jnp.broadcast_to(jnp.arange(valid.shape[1]), valid.shape), valid.sum(axis=1).astype(jnp.int32)


def is_multimodal(cfg) -> bool:
    return not isinstance(cfg, LlamaConfig)


def text_config(cfg) -> LlamaConfig:
    return cfg.text if is_multimodal(cfg) else cfg


def image_mask(cfg, input_ids: jax.Array) -> jax.Array:
    """[B, L] bool: the image placeholders of input_ids (none for a text-only config)."""
    return input_ids == cfg.image_token_id if is_multimodal(cfg) else jnp.zeros(input_ids.shape, bool)


def embed(cfg, params: dict, input_ids: jax.Array,
          pixel_values: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """input_ids [B, L] (one placeholder per image feature) -> (x [B, L, H], is_image [B, L]).

    Features fill the placeholders in reading order (row-major over batch, then sequence), as HF does.
    The caller checks that the placeholder count equals n_images * image_seq_length (training batches
    may pad pixel_values with trailing pictures that fill no placeholder). A text-only
    (llama) config gives an all-False `is_image`.
    """
    is_image = image_mask(cfg, input_ids)
    if not is_multimodal(cfg):
        return llama.embed_tokens(params["text"], input_ids), is_image
    # Placeholders never index the table (original-layout ids are -200, which would wrap around).
    x = llama.embed_tokens(params["text"], jnp.where(is_image, 0, input_ids))
    if pixel_values is None:
        return x, is_image
    return place_features(x, is_image, image_features(cfg, params, pixel_values)), is_image


def decoder_params(params: dict, is_image: jax.Array) -> dict:
    """The decoder's params for a pass over a prompt with image tokens `is_image` [B, L]: params["text"],
    with the model's image adapters (if it has any) acting at those tokens. Every pass over a prompt
    goes through this; a decode step or a question after a context is text and runs params["text"]."""
    if "image_adapters" not in params:
        return params["text"]
    return llama.with_adapters_at(params["text"], params["image_adapters"], is_image)


def place_features(x: jax.Array, is_image: jax.Array, features: jax.Array) -> jax.Array:
    """Image features [n_images, T_img, H] into the placeholders (`is_image` [B, L]) of the token
    embeddings x [B, L, H], in reading order."""
    features = features.astype(x.dtype).reshape(-1, features.shape[-1])  # [n_images * T_img, H]
    index = jnp.clip(jnp.cumsum(is_image.reshape(-1)) - 1, 0, features.shape[0] - 1).reshape(is_image.shape)
    return jnp.where(is_image[..., None], features[index], x)
