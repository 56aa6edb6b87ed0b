"""CLIP vision tower as HF's `CLIPVisionModel` computes it (pre-LN, class token, quick_gelu).

Params (encoder layers stacked on a leading axis N; weights [in, out]):
    patch_embed [C*p*p, Hv] (the bias-free patch conv, flattened in (C, p, p) order),
    class_embed [Hv], pos_embed [P+1, Hv], pre_norm_w/pre_norm_b [Hv],
    layers: ln1_w/ln1_b, wq/bq, wk/bk, wv/bv, wo/bo, ln2_w/ln2_b, fc1_w/fc1_b, fc2_w/fc2_b.
The post-layernorm only feeds CLIP's pooled output, which LLaVA never reads, so it is not kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from typing import Callable

from lookm_jax.models.config import CLIPVisionConfig
from lookm_jax.models.layers import layer_norm, linear, quick_gelu
from lookm_jax.models.llama import attend


def patchify(cfg: CLIPVisionConfig, pixel_values: jax.Array) -> jax.Array:
    """[N, C, H, W] -> [N, P, C*p*p] non-overlapping patches, row-major over the patch grid; pixels
    past the last whole patch are dropped, as the stride-p convolution does (SigLIP's 384 / 14)."""
    n, c, height, width = pixel_values.shape
    p = cfg.patch_size
    pixel_values = pixel_values[:, :, :height // p * p, :width // p * p]
    x = pixel_values.reshape(n, c, height // p, p, width // p, p)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(n, (height // p) * (width // p), c * p * p)


def _encoder_layer(cfg: CLIPVisionConfig, lp: dict, h: jax.Array,
                   act: Callable[[jax.Array], jax.Array] = quick_gelu) -> jax.Array:
    """h [N, T, Hv] -> [N, T, Hv]: pre-LN self-attention and an `act` MLP (CLIP's quick_gelu,
    SigLIP's tanh GELU), each residual."""
    n, t, _ = h.shape
    x = layer_norm(h, lp["ln1_w"], lp["ln1_b"], cfg.layer_norm_eps)

    def heads(w, b):
        return linear(x, w, b).reshape(n, t, cfg.num_heads, -1).transpose(0, 2, 1, 3)

    attn = attend(heads(lp["wq"], lp["bq"]), heads(lp["wk"], lp["bk"]), heads(lp["wv"], lp["bv"]),
                  jnp.ones((1, 1, 1, 1, t), bool))
    h = h + linear(attn.transpose(0, 2, 1, 3).reshape(n, t, -1), lp["wo"], lp["bo"])
    x = layer_norm(h, lp["ln2_w"], lp["ln2_b"], cfg.layer_norm_eps)
    return h + linear(act(linear(x, lp["fc1_w"], lp["fc1_b"])), lp["fc2_w"], lp["fc2_b"])


def hidden_states(cfg: CLIPVisionConfig, params: dict, pixel_values: jax.Array, depth: int) -> jax.Array:
    """HF's `hidden_states` tuple, stacked: [depth + 1, N, P+1, Hv].

    Entry 0 is the pre-layernormed embedding, entry i the output of encoder layer i; only the first
    `depth` (static) layers run, so features from layer -2 never pay for the last layer.
    """
    x = linear(patchify(cfg, pixel_values.astype(params["patch_embed"].dtype)), params["patch_embed"])
    cls = jnp.broadcast_to(params["class_embed"], (x.shape[0], 1, x.shape[-1]))
    x = jnp.concatenate([cls, x], axis=1) + params["pos_embed"]
    x = layer_norm(x, params["pre_norm_w"], params["pre_norm_b"], cfg.layer_norm_eps)
    return stack_hidden_states(lambda h, lp: _encoder_layer(cfg, lp, h), params["layers"], x, depth)


def stack_hidden_states(encoder_layer, layers: dict, x: jax.Array, depth: int) -> jax.Array:
    """Run the first `depth` (static) stacked `layers` on x [N, T, Hv] with `encoder_layer(h, lp)`;
    -> [depth + 1, N, T, Hv], entry 0 being x itself (HF's `hidden_states` tuple, stacked)."""
    def layer(h, lp):
        h = encoder_layer(h, lp)
        return h, h

    _, outs = jax.lax.scan(layer, x, jax.tree.map(lambda a: a[:depth], layers))
    return jnp.concatenate([x[None], outs], axis=0)
