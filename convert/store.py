"""Save / reload converted models: one safetensors file of flattened params + a JSON manifest.

Safetensors rather than orbax: converted params are one small, flat, read-only pytree; safetensors
is a single file with no extra dependency, readable by any tool, that can be read and written one
tensor (or one layer of a stacked tensor) at a time (convert/safetensors_io.py): converting and
loading hold one tensor on the host, not the model. Each tensor keeps its checkpoint's dtype (fp16
and bf16 stay 16-bit) unless a dtype is asked for. Orbax's async, sharded checkpointing solves a
training problem we do not have.

Writes are atomic: everything goes to a hidden temporary folder beside the target, which is renamed
into place only once complete, so an interrupted save never leaves a half-written model. The folder
and its files get the umask's usual modes (0755 / 0644 under umask 022), so a shared cache is shared.
Loads check the params' shapes, from the file's header, against the config before reading them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np
from lookm_jax.checks import can_create_in, nearest_existing
from lookm_jax.convert import runtime, safetensors_io, tables
from lookm_jax.convert.hf import ModelConfig, check_shapes, flat_paths, params_from_hf, parse_config
from lookm_jax.convert.tables import CheckpointError, read_json_object
from lookm_jax.errors import InputError

FORMAT = "lookm-jax-converted"
VERSION = 1
MANIFEST = "lookm_config.json"
PARAMS = "params.safetensors"
TOKENIZER = "tokenizer.json"


def flatten(tree: dict) -> dict[str, np.ndarray]:
    """Nested dict -> {"a.b.c": C-contiguous array} (safetensors writes raw buffers, ignoring strides)."""
    return {name: np.ascontiguousarray(value) for name, value in flat_paths(tree).items()}


def unflatten(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        tables.set_path(tree, path, value)
    return tree


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def check_replaceable(path: str) -> None:
    """Refuse (InputError) a path `save_converted` must not write: "", the working directory or a
    folder holding it, an existing path that is neither a converted folder nor an empty folder, or
    one whose nearest existing parent is not a folder it can write into (tried with an empty folder)."""
    if not path:
        raise InputError("the converted folder's path is empty")
    target = os.path.abspath(path)
    if os.path.commonpath([target, os.getcwd()]) == target:
        raise InputError(f"{path} is the working directory or holds it; refusing to replace it")
    if os.path.exists(path) and not (is_converted(path) or (os.path.isdir(path) and not os.listdir(path))):
        raise InputError(f"{path} exists and is neither a converted folder nor empty; refusing to replace it")
    parent = nearest_existing(os.path.dirname(target))  # missing folders are created on save
    if not (os.path.isdir(parent) and can_create_in(parent)):
        raise InputError(f"{path}: cannot write there ({parent} is not a folder this user can write into)")


def _umask() -> int:
    """The process's umask: reading it sets it, to 0o077 for that instant (a file another thread
    creates meanwhile is never left looser)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def save_file(flat: dict[str, np.ndarray], path: str) -> None:
    """Flat params (`flatten`) -> a safetensors file, one tensor at a time (no second copy of them)."""
    writer = safetensors_io.StreamWriter(path, list(flat))
    try:
        for name, value in flat.items():
            writer.add(name, value.dtype, value.shape)
            writer.write(name, value)
        writer.close()
    finally:
        writer.abort()


def save_converted(path: str, params: dict, manifest: dict[str, Any], tokenizer_json: str | None = None) -> None:
    """Atomically write params + manifest (+ tokenizer) to the folder `path`, replacing it if present.

    Only a converted folder or an empty one is replaced: any other existing path (a file, a folder
    with other contents, the working directory given as "" or ".") is refused untouched.
    """
    _write_folder(path, lambda file: save_file(flatten(params), file), manifest, tokenizer_json)


def convert_checkpoint(path: str, config: ModelConfig, tensors: tables.Source, manifest: dict[str, Any],
                       tokenizer_json: str | None, dtype=None) -> None:
    """A checkpoint's tensors -> the converted folder `path` (atomic, as `save_converted`), read,
    mapped and written one tensor at a time (a decoder weight one layer at a time), each in its
    checkpoint's dtype, or in `dtype` when given."""
    names = list(flat_paths(params_from_hf(config, tables.ShapesOnly())))  # the header's room is reserved for them

    def write(file: str) -> None:
        writer = safetensors_io.StreamWriter(file, names)

        def place(name: str, value: np.ndarray) -> None:
            writer.add(name, value.dtype, value.shape)
            writer.write(name, value)

        def text(cfg, jobs: list[runtime.Job]) -> dict:
            for name, index, take in jobs:
                piece = take()
                if index is None or index == 0:
                    writer.add(f"text.{name}", dtype or piece.dtype, piece.shape if index is None
                               else (cfg.num_layers, *piece.shape))
                writer.write(f"text.{name}", piece, index)
            return {}

        try:
            params_from_hf(config, tables.Source(tensors.handles, place), dtype, text=text)
            writer.close()
        finally:
            writer.abort()

    _write_folder(path, write, manifest, tokenizer_json)


def _write_folder(path: str, write_params, manifest: dict[str, Any], tokenizer_json: str | None) -> None:
    """The converted folder `path` written atomically: `write_params(file)` writes the params file
    into a hidden temporary folder beside it, renamed into place once everything is written."""
    check_replaceable(path)
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(path)}.tmp-")
    try:
        write_params(os.path.join(tmp, PARAMS))
        if tokenizer_json is not None:
            with open(os.path.join(tmp, TOKENIZER), "w") as f:
                f.write(tokenizer_json)
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump({"format": FORMAT, "version": VERSION, **manifest}, f, indent=1)
        mask = _umask()  # mkdtemp and safetensors create 0700 / 0600 whatever the umask
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o666 & ~mask)
        os.chmod(tmp, 0o777 & ~mask)
        if os.path.exists(path):
            old = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(path)}.old-")
            os.replace(path, os.path.join(old, "x"))
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_converted(path: str) -> tuple[dict[str, Any], ModelConfig, tables.Source, str | None]:
    """-> (manifest, config, params by flat path ("text.layers.wq"), each read when taken, tokenizer
    json or None); params whose names or shapes (in the file's header) are not those its config
    implies are refused here, before one is read."""
    manifest = read_json_object(os.path.join(path, MANIFEST))
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{path}: not a {FORMAT} v{VERSION} folder (found {manifest.get('format')!r} "
                         f"v{manifest.get('version')!r}); convert the checkpoint again")
    if not isinstance(manifest.get("hf_config"), dict):
        raise ValueError(f"{path}: {MANIFEST} has no hf_config object; convert the checkpoint again")
    config = parse_config(manifest["hf_config"])
    try:
        handles = safetensors_io.read_header(os.path.join(path, PARAMS))
    except (CheckpointError, OSError) as err:
        raise ValueError(f"{path}: corrupt or missing {PARAMS} ({err}); convert the checkpoint again") from None
    check_shapes(config, {name: h.shape for name, h in handles.items()}, path)
    tokenizer_path = os.path.join(path, TOKENIZER)
    tokenizer_json = open(tokenizer_path).read() if os.path.exists(tokenizer_path) else None
    return manifest, config, tables.Source(handles), tokenizer_json


def converted_params(text_config, tensors: tables.Source, dtype, place) -> dict:
    """A converted folder's params (`load_converted`) -> the runtime layout in `dtype`, each tensor
    replaced by what `place(path, array)` returns as soon as it is built: the decoder's through
    `runtime.text_params`, the rest as stored (a stacked one filled layer by layer)."""
    handles = tensors.handles
    text = {name.removeprefix("text."): h for name, h in handles.items() if name.startswith("text.")}
    params = {"text": runtime.text_params(text_config, runtime.stored_jobs(text, text_config.num_layers), dtype,
                                          place)}
    for name, handle in handles.items():
        if name.startswith("text."):
            continue
        array = tables.aligned_empty(handle.shape, dtype)
        if ".layers." in name:
            for index in range(handle.shape[0]):
                tables.copy_into(array[index], handle.layer(index).read())
        else:
            tables.copy_into(array, handle.read())
        tables.set_path(params, name, place(name, array))
        del array
    return params
