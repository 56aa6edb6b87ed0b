"""HF-format InternVL (transformers `InternVLForConditionalGeneration`, InternVL2.5/3 "-hf").

A tile of pixels goes through the InternViT tower (pre-norm layers with per-channel layer scale,
optional q/k RMSNorm over the full width, no final norm), loses its CLS token, is pixel-shuffled
(a k x k neighbourhood of patches becomes one token of k*k*Hv channels, in (dy, dx, c) order) and
is projected by LayerNorm -> Linear -> GELU -> Linear. A unit of pixel_values is one tile, so
`image_seq_length` is tokens per tile; an image of n tiles has n * image_seq_length placeholders.

Params: {"text": llama params, "vision": ..., "projector": ...}; vision (layers stacked on N):
    patch_embed [C*p*p, Hv], patch_bias [Hv], class_embed [Hv], pos_embed [P+1, Hv] (when absolute
    position embeddings are used), layers: norm1_w [N, Hv] (+ norm1_b for layer_norm), wq/wk/wv/wo
    [N, Hv, Hv] (+ bq/bk/bv [N, Hv] with attention_bias), bo [N, Hv], q_norm/k_norm [N, Hv] (with
    use_qk_norm), ls1/ls2 [N, Hv], norm2_w (+ norm2_b), fc1_w [N, Hv, I], fc1_b [N, I], fc2_w [N, I, Hv],
    fc2_b [N, Hv]. projector: norm_w/norm_b [k*k*Hv], w1 [k*k*Hv, H], b1 [H], w2 [H, H], b2 [H].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from lookm_jax.models.clip import patchify
from lookm_jax.models.config import ConfigError, LlamaConfig, _check_fields, _require
from lookm_jax.models.layers import gelu_exact, layer_norm, linear, rms_norm
from lookm_jax.models.llama import attend

QK_NORM_EPS = 1e-6  # HF builds the q/k RMSNorms with their default eps, not layer_norm_eps
PROJECTOR_NORM_EPS = 1e-5  # nn.LayerNorm's default
IMAGE_START, IMAGE_END = "<img>", "</img>"  # wrap each image's placeholders (InternVLProcessor)
IMAGE_MARKER = "<image>"  # what a prompt writes where an image goes (as for the other architectures)
# Vision fields that only matter for training or initialisation.
_VISION_INERT = {"hidden_dropout_prob", "projection_dropout", "layer_scale_init_value", "use_mask_token"}


def _square(value: Any, where: str, field: str) -> int:
    """An int or a [h, w] pair with h == w -> the int."""
    if isinstance(value, (list, tuple)):
        _require(len(value) == 2 and value[0] == value[1], where, field, value, "square sizes")
        value = value[0]
    return int(value)


@dataclasses.dataclass(frozen=True)
class InternVLVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    norm_type: str = "layer_norm"  # or "rms_norm"
    layer_norm_eps: float = 1e-6
    attention_bias: bool = False
    use_qk_norm: bool = False
    use_absolute_position_embeddings: bool = True

    @property
    def grid(self) -> int:
        """Patches per side of a tile."""
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "vision_config") -> "InternVLVisionConfig":
        _require(d.get("model_type", "internvl_vision") == "internvl_vision", where, "model_type",
                 d.get("model_type"), "'internvl_vision'")
        handled = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                   "patch_size", "num_channels", "norm_type", "layer_norm_eps", "attention_bias", "use_qk_norm",
                   "use_absolute_position_embeddings", "hidden_act", "use_mean_pooling"} | _VISION_INERT
        _check_fields(d, handled, where)
        _require(d.get("hidden_act", "gelu") == "gelu", where, "hidden_act", d.get("hidden_act"), "'gelu' (exact erf)")
        norm_type = d.get("norm_type", "layer_norm")
        _require(norm_type in ("layer_norm", "rms_norm"), where, "norm_type", norm_type, "'layer_norm', 'rms_norm'")
        # use_mean_pooling=False adds a final LayerNorm to the tower, which checkpoints do not use.
        _require(d.get("use_mean_pooling", True), where, "use_mean_pooling", d.get("use_mean_pooling"), "true")
        # Missing fields take HF's InternVLVisionConfig defaults.
        cfg = cls(hidden_size=int(d.get("hidden_size", 1024)), intermediate_size=int(d.get("intermediate_size", 4096)),
                  num_layers=int(d.get("num_hidden_layers", 24)), num_heads=int(d.get("num_attention_heads", 16)),
                  image_size=_square(d.get("image_size", 448), where, "image_size"),
                  patch_size=_square(d.get("patch_size", 14), where, "patch_size"),
                  num_channels=int(d.get("num_channels", 3)), norm_type=norm_type,
                  layer_norm_eps=float(d.get("layer_norm_eps", 1e-6)),
                  attention_bias=bool(d.get("attention_bias", False)), use_qk_norm=bool(d.get("use_qk_norm", False)),
                  use_absolute_position_embeddings=bool(d.get("use_absolute_position_embeddings", True)))
        _require(cfg.hidden_size % cfg.num_heads == 0, where, "num_attention_heads", cfg.num_heads,
                 f"a divisor of hidden_size={cfg.hidden_size}")
        _require(cfg.image_size % cfg.patch_size == 0, where, "patch_size", cfg.patch_size,
                 f"a divisor of image_size={cfg.image_size}")
        return cfg


@dataclasses.dataclass(frozen=True)
class InternVLConfig:
    text: LlamaConfig
    vision: InternVLVisionConfig
    image_token_id: int
    shuffle: int = 2  # k = 1 / downsample_ratio: k x k patches become one token
    vision_feature_layer: int = -1

    @property
    def image_seq_length(self) -> int:
        """Placeholder tokens (= projected features) per tile."""
        return (self.vision.grid // self.shuffle) ** 2

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one tile of pixel_values."""
        return (self.vision.num_channels, self.vision.image_size, self.vision.image_size)

    def expand_image_markers(self, text: str, image_token: str | None, tiles: Sequence[int]) -> str:
        """Each IMAGE_MARKER in `text`, in order, becomes <img> + image_token * (tiles * T) + </img>.

        This is what HF's InternVLProcessor does to the prompt; `tiles[i]` is image i's tile count
        (from `models.internvl_processing.preprocess_tiles`).
        """
        pieces = text.split(IMAGE_MARKER)
        if len(pieces) - 1 != len(tiles):
            raise ValueError(f"the prompt has {len(pieces) - 1} {IMAGE_MARKER} marker(s) but tile counts for "
                             f"{len(tiles)} image(s) were given")
        if tiles and image_token is None:
            raise ValueError(f"the tokenizer has no token for image_token_id={self.image_token_id}")
        out = [pieces[0]]
        for n, piece in zip(tiles, pieces[1:]):
            if n < 1:
                raise ValueError(f"an image has at least one tile, got {n}")
            out += [IMAGE_START, image_token * (n * self.image_seq_length), IMAGE_END, piece]
        return "".join(out)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "InternVLConfig":
        where = "internvl config"
        # image_token_index: a legacy key HF's InternVLConfig ignores (only image_token_id counts).
        handled = {"text_config", "vision_config", "image_token_id", "image_token_index", "image_seq_length",
                   "downsample_ratio", "projector_hidden_act", "vision_feature_layer",
                   "vision_feature_select_strategy", "tie_word_embeddings"}
        _check_fields(d, handled, where)
        _require(d.get("projector_hidden_act", "gelu") == "gelu", where, "projector_hidden_act",
                 d.get("projector_hidden_act"), "'gelu' (exact erf)")
        strategy = d.get("vision_feature_select_strategy", "default")
        _require(strategy == "default", where, "vision_feature_select_strategy", strategy, "'default' (CLS dropped)")
        layer = d.get("vision_feature_layer", -1)
        _require(isinstance(layer, int), where, "vision_feature_layer", layer, "one int")
        ratio = float(d.get("downsample_ratio", 0.5))
        shuffle = round(1 / ratio) if ratio > 0 else 0
        _require(shuffle >= 1 and abs(shuffle * ratio - 1) < 1e-9, where, "downsample_ratio", ratio, "1 / an integer")
        vision = InternVLVisionConfig.from_hf(d.get("vision_config") or {})
        _require(vision.grid % shuffle == 0, where, "downsample_ratio", ratio,
                 f"a ratio whose inverse divides the {vision.grid}-patch grid")
        _require(-(vision.num_layers + 1) <= layer <= vision.num_layers, where, "vision_feature_layer", layer,
                 f"indices into {vision.num_layers + 1} hidden states")
        # The top-level flag alone decides tying (HF ties lm_head to the embeddings from it).
        text = {**(d.get("text_config") or {"model_type": "qwen2"}),
                "tie_word_embeddings": bool(d.get("tie_word_embeddings", True))}
        cfg = cls(text=LlamaConfig.from_hf(text), vision=vision, image_token_id=int(d.get("image_token_id", 151667)),
                  shuffle=shuffle, vision_feature_layer=layer)
        if "image_seq_length" in d and int(d["image_seq_length"]) != cfg.image_seq_length:
            raise ConfigError(f"{where}: image_seq_length={d['image_seq_length']} disagrees with the vision geometry "
                              f"({cfg.image_seq_length} tokens per {vision.image_size}px tile)")
        return cfg


def _norm(cfg: InternVLVisionConfig, x: jax.Array, weight: jax.Array, bias: jax.Array | None) -> jax.Array:
    if cfg.norm_type == "rms_norm":
        return rms_norm(x, weight, cfg.layer_norm_eps)
    return layer_norm(x, weight, bias, cfg.layer_norm_eps)


def _encoder_layer(cfg: InternVLVisionConfig, lp: dict, h: jax.Array) -> jax.Array:
    """h [N, T, Hv] -> [N, T, Hv]: h += ls1 * attn(norm1(h)); h += ls2 * mlp(norm2(h))."""
    n, t, _ = h.shape
    x = _norm(cfg, h, lp["norm1_w"], lp.get("norm1_b"))
    q, k, v = (linear(x, lp["w" + c], lp.get("b" + c)) for c in "qkv")  # [N, T, Hv] each
    if cfg.use_qk_norm:  # over the full width, before the head split
        q, k = rms_norm(q, lp["q_norm"], QK_NORM_EPS), rms_norm(k, lp["k_norm"], QK_NORM_EPS)

    def heads(y):
        return y.reshape(n, t, cfg.num_heads, -1).transpose(0, 2, 1, 3)

    attn = attend(heads(q), heads(k), heads(v), jnp.ones((1, 1, 1, 1, t), bool))  # [N, heads, T, D]
    h = h + lp["ls1"] * linear(attn.transpose(0, 2, 1, 3).reshape(n, t, -1), lp["wo"], lp["bo"])
    x = _norm(cfg, h, lp["norm2_w"], lp.get("norm2_b"))
    return h + lp["ls2"] * linear(gelu_exact(linear(x, lp["fc1_w"], lp["fc1_b"])), lp["fc2_w"], lp["fc2_b"])


def vision_hidden(cfg: InternVLVisionConfig, params: dict, pixel_values: jax.Array, depth: int) -> jax.Array:
    """pixel_values [N, C, S, S] -> HF's hidden_states[depth]: [N, 1 + P, Hv] (CLS first).

    Only the first `depth` (static) layers run; depth 0 is the embedding output.
    """
    x = linear(patchify(cfg, pixel_values.astype(params["patch_embed"].dtype)), params["patch_embed"],
               params["patch_bias"])
    cls = jnp.broadcast_to(params["class_embed"], (x.shape[0], 1, x.shape[-1]))
    x = jnp.concatenate([cls, x], axis=1)
    if cfg.use_absolute_position_embeddings:
        x = x + params["pos_embed"]
    layers = jax.tree.map(lambda a: a[:depth], params["layers"])
    x, _ = jax.lax.scan(lambda h, lp: (_encoder_layer(cfg, lp, h), None), x, layers)
    return x


def pixel_shuffle(x: jax.Array, grid: int, k: int) -> jax.Array:
    """[N, grid*grid, C] patches (row-major) -> [N, (grid/k)^2, k*k*C], channels in (dy, dx, c) order."""
    n, _, c = x.shape
    x = x.reshape(n, grid // k, k, grid // k, k, c)  # (row', dy, col', dx, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(n, (grid // k) ** 2, k * k * c)


def internvl_image_features(cfg: InternVLConfig, params: dict, pixel_values: jax.Array) -> jax.Array:
    """pixel_values [n_tiles, C, S, S] -> projected features [n_tiles, image_seq_length, H_text]."""
    depth = cfg.vision_feature_layer % (cfg.vision.num_layers + 1)
    h = vision_hidden(cfg.vision, params["vision"], pixel_values, depth)[:, 1:]  # CLS dropped
    x = pixel_shuffle(h, cfg.vision.grid, cfg.shuffle)
    p = params["projector"]
    x = layer_norm(x, p["norm_w"], p["norm_b"], PROJECTOR_NORM_EPS)
    return linear(gelu_exact(linear(x, p["w1"], p["b1"])), p["w2"], p["b2"])
