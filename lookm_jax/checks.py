"""The pieces of the API's and the CLI's input checks, in one place so every check agrees on what
a number is (a bool is never one) and on what an output path must be."""

from __future__ import annotations

import math
import numbers
import operator
import os
import tempfile

from lookm_jax.errors import InputError


def as_int(x) -> int | None:
    """x as a Python int when it is an integer scalar (Python, NumPy or a 0-d JAX array; not a
    bool), else None. For values used at run time (a seed, a count)."""
    if isinstance(x, bool) or getattr(x, "dtype", None) == bool:
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def is_int_at_least(x, minimum: int) -> bool:
    """A Python or NumPy int >= minimum: what a static (hashed, compile-time) argument may be."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= minimum


def is_real(x) -> bool:
    """A finite Python or NumPy real number (not a bool)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def nearest_existing(path: str) -> str:
    """The longest leading part of abspath(path) that exists: where a save that creates the missing
    folders of `path` starts."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return existing


def can_create_in(folder: str) -> bool:
    """Whether this process can create an entry in `folder`, tried with an empty folder that is
    removed at once (os.access would not do: root passes it for /proc, where nothing can be made)."""
    try:
        os.rmdir(tempfile.mkdtemp(dir=folder, prefix=".lookm-write-test-"))
    except OSError:
        return False
    return True


def check_output_folder(path: str, name: str) -> None:
    """Refuse (InputError) an output folder `name` (e.g. "--output") at `path`, created with its
    missing parents on save, when `path` or the nearest existing part of it is a file, or when that
    part is a folder this process cannot write into."""
    existing = nearest_existing(path)
    where = "" if existing == os.path.abspath(path) else f": {existing}"
    if not os.path.isdir(existing):
        raise InputError(f"{name} {path}{where} is a file, not a folder")
    if not can_create_in(existing):
        raise InputError(f"{name} {path}: cannot write into {existing}")


def _refuse_folder(path: str, name: str) -> None:
    if os.path.isdir(path):
        raise InputError(f"{name} {path} is a folder; give a file path")


def check_input_file(path: str, name: str, why: str) -> None:
    """Refuse an input file `name` at `path` that is a folder (InputError) or does not exist
    (FileNotFoundError, saying `why` the file is read)."""
    _refuse_folder(path, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{name} {path} does not exist ({why})")


def check_output_file(path: str, name: str, create_folder: bool = False) -> None:
    """Refuse an output file `name` at `path` that is a folder (InputError), whose folder does not
    exist (FileNotFoundError; with `create_folder` a missing folder is made on save and only its
    nearest existing part is checked) or cannot be written into (InputError)."""
    _refuse_folder(path, name)
    folder = os.path.dirname(os.path.abspath(path))
    existing = nearest_existing(folder)
    if not os.path.isdir(existing):
        raise InputError(f"{name} {path}: {existing} is a file, not a folder")
    if not create_folder and existing != folder:
        raise FileNotFoundError(f"{name} {path}: folder {folder} does not exist")
    if not can_create_in(existing):
        raise InputError(f"{name} {path}: cannot write into {existing}")
