"""Save / reload converted models: one safetensors file of flattened params + a JSON manifest.

Safetensors rather than orbax: converted params are one small, flat, read-only pytree; safetensors
is a single memory-mappable file with no extra dependency, readable by any tool, and loads in well
under a second. Orbax's async, sharded checkpointing solves a training problem we do not have.

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
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

from lookm_jax.checks import can_create_in, nearest_existing
from lookm_jax.convert.hf import check_shapes, parse_config
from lookm_jax.convert.tables import read_json_object
from lookm_jax.errors import InputError

FORMAT = "lookm-jax-converted"
VERSION = 1
MANIFEST = "lookm_config.json"
PARAMS = "params.safetensors"
TOKENIZER = "tokenizer.json"


def flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """Nested dict -> {"a.b.c": C-contiguous array} (safetensors writes raw buffers, ignoring strides)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = np.ascontiguousarray(value)
    return flat


def unflatten(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
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


def save_converted(path: str, params: dict, manifest: dict[str, Any], tokenizer_json: str | None = None) -> None:
    """Atomically write params + manifest (+ tokenizer) to the folder `path`, replacing it if present.

    Only a converted folder or an empty one is replaced: any other existing path (a file, a folder
    with other contents, the working directory given as "" or ".") is refused untouched.
    """
    check_replaceable(path)
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(path)}.tmp-")
    try:
        save_file(flatten(params), os.path.join(tmp, PARAMS))
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


def load_converted(path: str) -> tuple[dict[str, Any], dict, str | None]:
    """-> (manifest, numpy params tree, tokenizer json or None); params whose names or shapes (in the
    file's header) are not those its config implies are refused before they are read."""
    manifest = read_json_object(os.path.join(path, MANIFEST))
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{path}: not a {FORMAT} v{VERSION} folder (found {manifest.get('format')!r} "
                         f"v{manifest.get('version')!r}); convert the checkpoint again")
    if not isinstance(manifest.get("hf_config"), dict):
        raise ValueError(f"{path}: {MANIFEST} has no hf_config object; convert the checkpoint again")
    config = parse_config(manifest["hf_config"])
    try:
        with safe_open(os.path.join(path, PARAMS), framework="numpy") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        check_shapes(config, shapes, path)
        params = unflatten(load_file(os.path.join(path, PARAMS)))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path}: corrupt or missing {PARAMS} ({err}); convert the checkpoint again") from err
    tokenizer_path = os.path.join(path, TOKENIZER)
    tokenizer_json = open(tokenizer_path).read() if os.path.exists(tokenizer_path) else None
    return manifest, params, tokenizer_json
