"""Model configs: frozen (hashable) dataclasses read from Hugging Face config dicts.

Every field of an HF config is either handled here, known to be irrelevant to the forward pass
(metadata, dropout, init), or refused with a `ConfigError` naming it: we never silently compute
something other than what the checkpoint's config describes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Fields that never change the numerics of an inference forward pass.
_METADATA_FIELDS = frozenset({
    "_name_or_path", "architectures", "auto_map", "dtype", "torch_dtype", "transformers_version",
    "model_type", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "initializer_factor", "attention_dropout", "dropout", "max_position_embeddings", "id2label",
    "label2id", "output_attentions", "output_hidden_states", "return_dict", "is_decoder",
    "is_encoder_decoder", "tokenizer_class", "chunk_size_feed_forward", "problem_type",
    "add_cross_attention", "tie_encoder_decoder", "pruned_heads", "task_specific_params",
    "finetuning_task", "prefix", "sep_token_id", "decoder_start_token_id", "cross_attention_hidden_size",
    "torchscript", "use_bfloat16", "tf_legacy_loss", "_attn_implementation_autoset", "layer_types",
})


class ConfigError(ValueError):
    """A checkpoint config asks for something this library does not implement."""


def _check_fields(raw: dict[str, Any], handled: set[str], where: str) -> None:
    unknown = sorted(set(raw) - handled - _METADATA_FIELDS)
    if unknown:
        raise ConfigError(f"{where}: unsupported config field(s) {unknown}; refusing to guess their meaning")


def _require(cond: bool, where: str, field: str, value: Any, supported: str) -> None:
    if not cond:
        raise ConfigError(f"{where}: unsupported value {field}={value!r} (supported: {supported})")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    # Llama-3 scaling ("llama3"); factor None means no scaling.
    factor: float | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # M-RoPE (Qwen2-VL): frequencies per (time, height, width) position row, summing to head_dim / 2.
    mrope_section: tuple[int, ...] | None = None

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None, where: str) -> "RopeConfig":
        params = dict(params or {})
        rope_type = params.pop("rope_type", params.pop("type", "default"))
        theta = float(params.pop("rope_theta", 10000.0))
        if rope_type == "default":
            _check_fields(params, set(), f"{where}.rope_parameters")
            return cls(theta=theta)
        _require(rope_type == "llama3", where, "rope_type", rope_type, "'default', 'llama3'")
        handled = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
        _check_fields(params, handled, f"{where}.rope_parameters")
        try:
            rope = cls(theta=theta, factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                       high_freq_factor=float(params["high_freq_factor"]),
                       original_max_position_embeddings=int(params["original_max_position_embeddings"]))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{where}.rope_parameters: llama3 scaling needs numbers {sorted(handled)}, "
                              f"got {params}") from None
        if not (rope.factor > 0 and 0 < rope.low_freq_factor < rope.high_freq_factor
                and rope.original_max_position_embeddings >= 1):  # HF divides by high - low; also refuses NaN
            raise ConfigError(f"{where}.rope_parameters: llama3 scaling needs factor > 0, 0 < low_freq_factor < "
                              f"high_freq_factor and original_max_position_embeddings >= 1, got {params}")
        return rope


def _rope_parameters(d: dict[str, Any], where: str) -> dict[str, Any]:
    """RoPE settings: transformers 5's rope_parameters, or the older rope_scaling + rope_theta; where a
    config carries both spellings they must agree (one would otherwise be dropped silently)."""
    parameters, scaling = d.get("rope_parameters") or {}, dict(d.get("rope_scaling") or {})
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    if "rope_theta" in d:
        scaling.setdefault("rope_theta", d["rope_theta"])
    disagree = {k: (parameters[k], v) for k, v in scaling.items() if k in parameters and parameters[k] != v}
    if disagree:
        raise ConfigError(f"{where}: rope_parameters and rope_scaling / rope_theta disagree on "
                          f"{', '.join(f'{k} ({a!r} vs {b!r})' for k, (a, b) in disagree.items())}; keep one")
    return {**scaling, **parameters}


_LLAMA_TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2}  # HF LlamaConfig's defaults

# HF Qwen2Config defaults where they differ from LlamaConfig's (hub configs may omit default fields).
_QWEN2_DEFAULTS = {"vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q/k/v projections carry biases (Qwen2); o_proj never does
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 2048

    def __post_init__(self):
        sizes = {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "intermediate_size":
                 self.intermediate_size, "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                 "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                 "max_position_embeddings": self.max_position_embeddings}
        bad = {name: value for name, value in sizes.items() if not value >= 1}
        if bad:
            raise ConfigError(f"config sizes must be >= 1, got {bad}")
        if not (self.rms_norm_eps > 0 and self.rope.theta > 0):  # also refuses NaN
            raise ConfigError(f"rms_norm_eps and rope_theta must be > 0, got {self.rms_norm_eps}, {self.rope.theta}")
        outside = [e for e in self.eos_token_ids if not 0 <= e < self.vocab_size]
        if outside:
            raise ConfigError(f"eos_token_id {outside[0]} outside the vocabulary [0, {self.vocab_size})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads={self.num_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_kv_heads}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "text_config") -> "LlamaConfig":
        model_type = d.get("model_type", "llama")
        _require(model_type in ("llama", "qwen2"), where, "model_type", model_type, "'llama', 'qwen2'")
        handled = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                   "rope_parameters", "rope_scaling", "rope_theta", "tie_word_embeddings",
                   "hidden_act", "attention_bias", "mlp_bias", "pretraining_tp"}
        if model_type == "qwen2":  # Llama with q/k/v biases; sliding-window attention is not implemented
            d = {**_QWEN2_DEFAULTS, **d}
            handled |= {"use_sliding_window", "sliding_window", "max_window_layers"}
            _require(not d.get("use_sliding_window", False), where, "use_sliding_window",
                     d.get("use_sliding_window"), "false")
        _check_fields(d, handled, where)
        _require(d.get("hidden_act", "silu") == "silu", where, "hidden_act", d.get("hidden_act"), "'silu'")
        for flag in ("attention_bias", "mlp_bias"):
            _require(not d.get(flag, False), where, flag, d.get(flag), "false")
        _require(d.get("pretraining_tp", 1) == 1, where, "pretraining_tp", d.get("pretraining_tp"), "1")
        rope = _rope_parameters(d, where)

        def integer(name: str, default: int) -> int:  # absent or null: HF's default
            value = d.get(name)
            if value is None:
                return default
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{where}: {name} must be an integer, got {value!r}")
            return value

        # Hub configs (e.g. llava-1.5's text_config) omit fields left at HF's LlamaConfig defaults.
        heads, hidden = integer("num_attention_heads", 32), integer("hidden_size", 4096)
        # Absent (not null) token ids take HF's class defaults: LlamaConfig's 1 / 2 (Qwen2Config's None),
        # e.g. for llava-1.5's hub text_config, which omits them.
        bos, eos = (d.get(name, _LLAMA_TOKEN_IDS[name] if model_type == "llama" else None) for name in _LLAMA_TOKEN_IDS)
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
            raise ConfigError(f"{where}: eos_token_id must be an integer or a list of them, got {d.get('eos_token_id')!r}")
        try:
            rms_norm_eps = float(d.get("rms_norm_eps", 1e-6))
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: rms_norm_eps must be a number, got {d.get('rms_norm_eps')!r}") from None
        return cls(
            vocab_size=integer("vocab_size", 32000),
            hidden_size=hidden,
            intermediate_size=integer("intermediate_size", 11008),
            num_layers=integer("num_hidden_layers", 32),
            num_heads=heads,
            num_kv_heads=integer("num_key_value_heads", heads),
            head_dim=integer("head_dim", hidden // heads if heads > 0 else 0),
            rms_norm_eps=rms_norm_eps,
            rope=RopeConfig.from_hf(rope, where),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            bos_token_id=bos,
            eos_token_ids=eos,
            max_position_embeddings=integer("max_position_embeddings", 2048),
        )


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "vision_config") -> "CLIPVisionConfig":
        _require(d.get("model_type", "clip_vision_model") in ("clip_vision_model", "clip"), where,
                 "model_type", d.get("model_type"), "'clip_vision_model'")
        handled = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "image_size", "patch_size", "num_channels", "layer_norm_eps", "hidden_act",
                   "projection_dim", "vocab_size"}  # projection_dim/vocab_size: unused by the tower
        _check_fields(d, handled, where)
        _require(d.get("hidden_act", "quick_gelu") == "quick_gelu", where, "hidden_act",
                 d.get("hidden_act"), "'quick_gelu'")
        # Missing fields take HF's CLIPVisionConfig defaults.
        return cls(hidden_size=int(d.get("hidden_size", 768)), intermediate_size=int(d.get("intermediate_size", 3072)),
                   num_layers=int(d.get("num_hidden_layers", 12)), num_heads=int(d.get("num_attention_heads", 12)),
                   image_size=int(d.get("image_size", 224)), patch_size=int(d.get("patch_size", 32)),
                   num_channels=int(d.get("num_channels", 3)),
                   layer_norm_eps=float(d.get("layer_norm_eps", 1e-5)))


@dataclasses.dataclass(frozen=True)
class LlavaConfig:
    text: LlamaConfig
    vision: CLIPVisionConfig
    image_token_id: int
    # One int or a tuple of ints (features of those layers concatenated), as HF accepts.
    vision_feature_layer: int | tuple[int, ...] = -2
    vision_feature_select_strategy: str = "default"  # 'default' drops CLS, 'full' keeps it
    projector_bias: bool = True
    # lookm's own key, not HF's: the rank of the decoder adapters that act on image tokens only
    # (params["image_adapters"], models/llava.py; the demo's); 0: none
    image_adapter_rank: int = 0

    @property
    def image_seq_length(self) -> int:
        """Placeholder tokens (= projected features) per image."""
        return self.vision.num_patches + (self.vision_feature_select_strategy == "full")

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one image of pixel_values."""
        return (self.vision.num_channels, self.vision.image_size, self.vision.image_size)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        layer = self.vision_feature_layer
        return tuple(layer) if isinstance(layer, tuple) else (layer,)

    @classmethod
    def from_hf(cls, d: dict[str, Any], vision_parser=CLIPVisionConfig.from_hf) -> "LlavaConfig":
        """`vision_parser`: the tower's config reader (LLaVA-OneVision passes SigLIP's)."""
        where = "llava config"
        handled = {"text_config", "vision_config", "image_token_index", "image_token_id",
                   "vision_feature_layer", "vision_feature_select_strategy", "projector_hidden_act",
                   "multimodal_projector_bias", "tie_word_embeddings", "image_seq_length",
                   "ignore_index", "vocab_size", "image_adapter_rank"}
        _check_fields(d, handled, where)
        rank = d.get("image_adapter_rank", 0)
        _require(isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0, where, "image_adapter_rank",
                 rank, "a whole number >= 0")
        _require(d.get("projector_hidden_act", "gelu") == "gelu", where, "projector_hidden_act",
                 d.get("projector_hidden_act"), "'gelu' (exact erf)")
        strategy = d.get("vision_feature_select_strategy", "default")
        _require(strategy in ("default", "full"), where, "vision_feature_select_strategy", strategy,
                 "'default', 'full'")
        layer = d.get("vision_feature_layer", -2)
        layer = tuple(int(x) for x in layer) if isinstance(layer, (list, tuple)) else int(layer)
        text = dict(d["text_config"])
        if "tie_word_embeddings" in d:
            text.setdefault("tie_word_embeddings", d["tie_word_embeddings"])
        cfg = cls(text=LlamaConfig.from_hf(text), vision=vision_parser(d["vision_config"]),
                  image_token_id=int(d.get("image_token_id", d.get("image_token_index", 32000))),
                  vision_feature_layer=layer, vision_feature_select_strategy=strategy,
                  projector_bias=bool(d.get("multimodal_projector_bias", True)), image_adapter_rank=rank)
        for idx in cfg.feature_layers:
            _require(-(cfg.vision.num_layers + 1) <= idx <= cfg.vision.num_layers, where,
                     "vision_feature_layer", layer, f"indices into {cfg.vision.num_layers + 1} hidden states")
        return cfg
