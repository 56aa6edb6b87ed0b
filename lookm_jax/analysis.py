"""Attention each prompt token receives, per decoder layer (LOOK-M eq. 4), for pictures and analysis.

A_s[j] = sum over the valid queries i >= j of softmax row i at column j, averaged over all query
heads: the statistic LOOK-M ranks tokens by, taken from the decoder's own attention as it encodes
the prompt (``llama.causal_attention`` accumulates it; no second attention pass, no [L, L] matrix).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax import generate as gen, inputs
from lookm_jax.models import llama, llava
from lookm_jax.scoring import SUMS, scores_from_stats


@functools.partial(jax.jit, static_argnames=("cfg",))
def attention_received_padded(cfg, params: dict, input_ids: jax.Array, valid: jax.Array,
                              pixel_values: jax.Array | None) -> jax.Array:
    """input_ids/valid [B, L] (right-padded), pixel_values [n_images, C, H, W] or None.

    Static: cfg; L is the static bucket length. Scans the layers as ``llama.forward`` does and
    returns A_s per layer, mean over every query head: [num_layers, B, L] float32, 0 at padding.
    """
    text_cfg = llava.text_config(cfg)
    x, _ = llava.embed(cfg, params, input_ids, pixel_values)  # [B, L, H]
    positions = jnp.broadcast_to(jnp.arange(x.shape[1]), valid.shape)
    cos, sin = llama.rope_tables(text_cfg, positions, x.dtype)

    def layer(h, lp):
        q, k, v = llama.project_qkv(text_cfg, lp, h, cos, sin)
        attn, stats = llama.causal_attention(q, k, v, valid, statistics=(SUMS,))
        received = scores_from_stats(stats).mean(axis=1)  # [B, Hkv, L] -> [B, L]
        return llama.finish_layer(text_cfg, lp, h, attn), received

    _, received = jax.lax.scan(layer, x, params["text"]["layers"])
    return received


def attention_received(model, input_ids, pixel_values=None) -> np.ndarray:
    """One prompt: ids [1, L] or [L] (images expanded, as ``Model.encode_chat`` gives them) and its
    pixel_values -> A_s of each of its L tokens in every layer, [num_layers, L] float32.

    Each layer's row sums to L (every query's softmax row sums to one).
    """
    ids = np.asarray(input_ids, np.int32)
    if ids.ndim not in (1, 2) or (ids.ndim == 2 and ids.shape[0] != 1):
        raise ValueError(f"attention_received takes one prompt, ids [L] or [1, L]; got shape {ids.shape}")
    ids = ids.reshape(1, -1)
    packed, valid = gen.pack_prompts(ids, None, model.buckets)
    pixels = inputs.pixel_values(model.config, model.dtype, packed, valid, pixel_values)
    received = attention_received_padded(model.config, model.params, jnp.asarray(packed), jnp.asarray(valid), pixels)
    return np.asarray(received[:, 0, : ids.shape[1]], np.float32)


def _mean(x: np.ndarray) -> np.ndarray:
    """Mean over the last axis; NaN where it is empty."""
    return x.mean(axis=-1) if x.shape[-1] else np.full(x.shape[:-1], np.nan, np.float32)


def modality_summary(received: np.ndarray, is_image: np.ndarray) -> dict:
    """Where one prompt's attention goes, per layer, by modality.

    received [N, L] (``attention_received``), is_image [L] bool. The first token is kept apart
    (it is usually the attention sink); "image" and "text" mean positions 1..L-1 of that modality.
    Returns {image_share, text_share, first_share: [N], each modality's share of the layer's A_s
    mass (the three sum to 1); image_per_query, text_per_query: [N], mean over the modality's
    tokens of A_s[j] / (L - j), the attention a token gets per query that sees it;
    image_token_share: float, image tokens / L}.
    """
    received = np.asarray(received, np.float64)
    is_image = np.asarray(is_image, bool)
    length = received.shape[1]
    total = received.sum(axis=1)  # [N]
    rest = np.arange(length) > 0
    image, text = rest & is_image, rest & ~is_image
    per_query = received / (length - np.arange(length))  # [N, L]
    return {"image_share": received[:, image].sum(1) / total, "text_share": received[:, text].sum(1) / total,
            "first_share": received[:, 0] / total, "image_per_query": _mean(per_query[:, image]),
            "text_per_query": _mean(per_query[:, text]), "image_token_share": float(is_image.mean())}
