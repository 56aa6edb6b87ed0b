"""Hugging Face checkpoint folder (config.json + safetensors, one file or sharded) -> params, no torch."""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np
from tqdm.auto import tqdm

from lookm_jax.convert import original_llava, safetensors_io, tables
from lookm_jax.convert.internvl import internvl_vision_params
from lookm_jax.convert.qwen2_5_vl import qwen2_5_vl_vision_params
from lookm_jax.convert.qwen2_vl import qwen2_vl_vision_params
from lookm_jax.convert.tables import CheckpointError, apply_table, read_json_object
from lookm_jax.models.config import ConfigError, LlamaConfig, LlavaConfig
from lookm_jax.models.internvit import InternViTLlavaConfig
from lookm_jax.models.internvl import InternVLConfig
from lookm_jax.models.llava_next import LlavaNextConfig
from lookm_jax.models.llava_onevision import LlavaOnevisionConfig
from lookm_jax.models.siglip import SiglipVisionConfig
from lookm_jax.models.mobilevlm import MobileVLMConfig
from lookm_jax.models.qwen2_5_vl import Qwen2_5_VLConfig
from lookm_jax.models.qwen2_vl import Qwen2VLConfig

ModelConfig = LlamaConfig | LlavaConfig


# model_type -> parser of the HF config dict. An architecture defines its parser in models/<arch>.py
# and its converter in convert/<arch>.py (importing convert.tables, never this module) and is listed here.
CONFIG_PARSERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "llava": original_llava.parse_llava_any,  # llava-hf, or the original layout (incl. InternViT-6B towers)
    "mobilevlm": original_llava.parse_mobilevlm,
    "llama": lambda d: LlamaConfig.from_hf(d, where="config"),
    "qwen2": lambda d: LlamaConfig.from_hf(d, where="config"),
    "internvl": InternVLConfig.from_hf,
    "qwen2_vl": Qwen2VLConfig.from_hf,
    "qwen2_5_vl": Qwen2_5_VLConfig.from_hf,
    "llava_next": LlavaNextConfig.from_hf,
    "llava_onevision": LlavaOnevisionConfig.from_hf,
}


_NESTED = ("text_config", "vision_config", "llm_config", "rope_parameters", "rope_scaling")  # objects, if present


def parse_config(hf_config: dict[str, Any]) -> ModelConfig:
    """An HF config dict -> our frozen config; refuses what it cannot honour."""
    model_type = hf_config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_PARSERS:
        raise CheckpointError(f"unsupported model_type {model_type!r} (supported: {sorted(CONFIG_PARSERS)})")
    for name in _NESTED:
        for where, d in (("", hf_config), *((f"{k}.", v) for k, v in hf_config.items() if isinstance(v, dict))):
            if d.get(name) is not None and not isinstance(d[name], dict):
                raise ConfigError(f"config.json: {where}{name} must be an object, got {d[name]!r}")
    try:
        return CONFIG_PARSERS[model_type](hf_config)
    except (ConfigError, CheckpointError):
        raise
    except (TypeError, AttributeError, KeyError, ValueError, OverflowError) as e:
        # A field of another JSON type than the parser reads (a string where a number belongs), or missing.
        raise ConfigError(f"config.json ({model_type}): a field is missing or of the wrong type "
                          f"({type(e).__name__}: {e})") from None


def _shard_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json_object(index, ("weight_map",))["weight_map"]
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    missing = [f for f in files if not os.path.exists(os.path.join(folder, f))]
    if missing:
        raise CheckpointError(f"{folder}: missing shard(s) {missing} named by the index")
    return files


def read_safetensors(folder: str) -> tables.Source:
    """All tensors of a checkpoint folder, keyed by canonical HF name (see `tables.canonical_name`),
    each read when it is taken (only the shards' headers are read here)."""
    handles = {}
    for name in _shard_files(folder):
        for key, tensor in safetensors_io.read_header(os.path.join(folder, name)).items():
            handles[tables.canonical_name(key)] = tensor
    return tables.Source(handles)


def llava_vision_params(config: LlavaConfig, tensors: dict[str, np.ndarray], dtype) -> dict:
    """Pop the CLIP (or, for LLaVA-OneVision, SigLIP) tower and projector of a LLaVA checkpoint ->
    {"vision": ..., "projector": ...}."""
    siglip = isinstance(config.vision, SiglipVisionConfig)
    for name in tables.SIGLIP_UNUSED if siglip else tables.CLIP_UNUSED:
        tables.drop(tensors, "vision." + name)
    if siglip and not isinstance(tensors, tables.ShapesOnly):
        for name in [k for k in tensors if k.startswith("vision." + tables.SIGLIP_HEAD)]:
            tables.drop(tensors, name)
    table, shapes = (tables.SIGLIP_TABLE, tables.siglip_shapes) if siglip else (tables.CLIP_TABLE, tables.clip_shapes)
    params = {
        "vision": apply_table(tensors, table, "vision.", config.vision.num_layers, shapes(config.vision), dtype),
        "projector": apply_table(tensors, tables.PROJECTOR_TABLE, "projector.", 0, tables.projector_shapes(config),
                                 dtype, skip=() if config.projector_bias else ("b1", "b2")),
    }
    if config.image_adapter_rank:
        params["image_adapters"] = apply_table(tensors, tables.IMAGE_ADAPTER_TABLE, "image_adapters.",
                                               config.text.num_layers, tables.image_adapter_shapes(config), dtype)
    return params


def llava_next_vision_params(config: LlavaNextConfig, tensors: dict[str, np.ndarray], dtype) -> dict:
    """LLaVA-1.5's tower and projector, and the image newline as projector["newline"]."""
    params = llava_vision_params(config, tensors, dtype)
    params["projector"].update(apply_table(tensors, [("newline", "image_newline", None)], "projector.", 0,
                                           {"newline": (config.text.hidden_size,)}, dtype))
    return params


# multimodal config type -> fn(config, tensors, dtype) popping the non-text tensors into params.
VISION_PARAMS: dict[type, Callable[[Any, dict[str, np.ndarray], Any], dict]] = {
    LlavaConfig: llava_vision_params,
    InternViTLlavaConfig: original_llava.internvit_llava_params,
    MobileVLMConfig: original_llava.mobilevlm_params,
    InternVLConfig: internvl_vision_params,
    Qwen2VLConfig: qwen2_vl_vision_params,
    Qwen2_5_VLConfig: qwen2_5_vl_vision_params,
    LlavaNextConfig: llava_next_vision_params,
    LlavaOnevisionConfig: llava_next_vision_params,
}


def params_from_hf(config: ModelConfig, tensors: dict[str, np.ndarray], dtype=np.float32,
                   text: Callable[[LlamaConfig, list], dict] | None = None) -> dict:
    """Canonically named HF tensors -> {"text": ..., [vision parts: "vision", "projector", ...]}.

    Consumes `tensors` (a dict, or a `tables.Source` read one tensor at a time); any tensor no table
    row explains is an error (it would be silently unused). `dtype`: of every parameter (None: each
    keeps its checkpoint's). `text(text_config, jobs)` builds the decoder's part from its tensors'
    `tables.table_jobs`, each layer's together (default: the stored layout, stacked by `apply_table`).
    Given `tables.ShapesOnly()`, reads nothing and returns the shapes the config implies in place of arrays.
    """
    multimodal = not isinstance(config, LlamaConfig)
    text_cfg = config.text if multimodal else config
    tied = text_cfg.tie_word_embeddings
    if tied:
        tables.drop(tensors, "lm_head.weight")  # some tied checkpoints still store the head
    with tqdm(total=1 + multimodal, desc="converting", unit="part", leave=False,
              disable=isinstance(tensors, tables.ShapesOnly)) as bar:
        rows = (tensors, tables.LLAMA_TABLE, "", text_cfg.num_layers, tables.llama_shapes(text_cfg))
        skip = (("lm_head",) if tied else ()) + (() if text_cfg.qkv_bias else tables.LLAMA_QKV_BIAS)
        params = {"text": apply_table(*rows, dtype, skip=skip) if text is None or isinstance(tensors, tables.ShapesOnly)
                  else text(text_cfg, tables.table_jobs(*rows, skip=skip, layer_major=True))}
        bar.update()
        if multimodal:
            params.update(VISION_PARAMS[type(config)](config, tensors, dtype))
            bar.update()
    if tensors:
        raise CheckpointError(f"checkpoint has tensors no mapping explains: {sorted(tensors)[:5]}")
    return params


def flat_paths(tree: dict, prefix: str = "") -> dict:
    """Nested dict -> {"a.b.c": leaf}."""
    flat = {}
    for key, value in tree.items():
        flat.update(flat_paths(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return flat


def check_shapes(config: ModelConfig, found: dict[str, tuple[int, ...]], where: str) -> None:
    """Refuse (CheckpointError) params ({"text.embed": shape, ...}) other than those `config` implies
    (`params_from_hf`'s dry run), naming the first that differs, its shape and the expected one."""
    expected = flat_paths(params_from_hf(config, tables.ShapesOnly()))
    for name in [*expected, *sorted(set(found) - set(expected))]:
        accepted = tables.accepted_shapes(expected[name]) if name in expected else []
        if found.get(name) not in accepted:
            raise CheckpointError(f"{where}: parameter {name} has shape {found.get(name, 'none (absent)')}, its "
                                  f"config implies {' or '.join(map(str, accepted)) or 'no such parameter'}; "
                                  "convert the checkpoint again")


def open_hf_folder(folder: str) -> tuple[dict[str, Any], ModelConfig, tables.Source]:
    """HF checkpoint folder -> (raw HF config dict, our config, its tensors, read when taken)."""
    config_path = os.path.join(folder, "config.json")
    if not os.path.exists(config_path):
        raise CheckpointError(f"{folder}: no config.json")
    hf_config = read_json_object(config_path)
    hf_config = original_llava.with_local_tower_config(hf_config, folder)
    config = parse_config(hf_config)
    return hf_config, config, read_safetensors(folder)
