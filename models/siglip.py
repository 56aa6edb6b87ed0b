"""SigLIP vision tower as HF's `SiglipVisionModel` computes its hidden states (LLaVA-OneVision's).

CLIP's encoder (`clip._encoder_layer`) with three differences: no class token and no pre-layernorm,
a biased patch convolution, and the tanh-approximated GELU (`gelu_pytorch_tanh`) in the MLP.
LLaVA-OneVision reads a hidden state (by default the last layer's output, before the
post-layernorm), so neither the post-layernorm nor the attention-pooling head is kept.

Params (encoder layers stacked on a leading axis N; weights [in, out]):
    patch_embed [C*p*p, Hv], patch_bias [Hv], pos_embed [P, Hv],
    layers: as CLIP's (ln1_w/ln1_b, wq/bq, wk/bk, wv/bv, wo/bo, ln2_w/ln2_b, fc1_w/fc1_b, fc2_w/fc2_b).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from lookm_jax.models import clip
from lookm_jax.models.config import CLIPVisionConfig, _check_fields, _require
from lookm_jax.models.layers import linear


@dataclasses.dataclass(frozen=True)
class SiglipVisionConfig(CLIPVisionConfig):
    """CLIPVisionConfig's sizes, read from a `siglip_vision_model` config (HF's SiglipVisionConfig
    defaults for absent fields)."""

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "vision_config") -> "SiglipVisionConfig":
        _require(d.get("model_type", "siglip_vision_model") == "siglip_vision_model", where, "model_type",
                 d.get("model_type"), "'siglip_vision_model'")
        handled = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                   "patch_size", "num_channels", "layer_norm_eps", "hidden_act", "vision_use_head"}
        _check_fields(d, handled, where)  # vision_use_head: the pooling head is never read by LLaVA
        _require(d.get("hidden_act", "gelu_pytorch_tanh") == "gelu_pytorch_tanh", where, "hidden_act",
                 d.get("hidden_act"), "'gelu_pytorch_tanh'")
        return cls(hidden_size=int(d.get("hidden_size", 768)), intermediate_size=int(d.get("intermediate_size", 3072)),
                   num_layers=int(d.get("num_hidden_layers", 12)), num_heads=int(d.get("num_attention_heads", 12)),
                   image_size=int(d.get("image_size", 224)), patch_size=int(d.get("patch_size", 16)),
                   num_channels=int(d.get("num_channels", 3)), layer_norm_eps=float(d.get("layer_norm_eps", 1e-6)))


def gelu_tanh(x: jax.Array) -> jax.Array:
    """HF's 'gelu_pytorch_tanh': GELU with the tanh approximation."""
    return jax.nn.gelu(x, approximate=True)


def hidden_states(cfg: SiglipVisionConfig, params: dict, pixel_values: jax.Array, depth: int) -> jax.Array:
    """pixel_values [N, C, H, W] -> HF's `hidden_states` tuple, stacked: [depth + 1, N, P, Hv] (entry 0
    the embeddings, entry i encoder layer i's output; only the first `depth` (static) layers run)."""
    x = linear(clip.patchify(cfg, pixel_values.astype(params["patch_embed"].dtype)), params["patch_embed"],
               params["patch_bias"]) + params["pos_embed"]
    return clip.stack_hidden_states(lambda h, lp: clip._encoder_layer(cfg, lp, h, gelu_tanh), params["layers"], x,
                                    depth)
