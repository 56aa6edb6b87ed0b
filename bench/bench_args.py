"""argparse types shared by the bench scripts: a bad value ends the script at once with argparse's
one-line error, before anything is loaded or measured."""

from __future__ import annotations

import argparse
import os

from lookm_jax.cli_args import int_at_least
from lookm_jax.errors import InputError


at_least = int_at_least  # the type of an int option that must be >= its minimum, as the `lookm` commands parse it


def json_path(text: str) -> str:
    """--json: a file whose folder exists, so that a run is not lost at its very end."""
    folder = os.path.dirname(os.path.abspath(text))
    if not text.strip() or not os.path.isdir(folder) or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"must be a file in an existing folder, got {text!r}")
    return text


def kept_fraction(text: str) -> float:
    """A LOOK-M budget: a kept fraction in (0, 1], refused as `get_method` refuses it."""
    from lookm_jax.compression.methods import get_method

    try:
        value = float(text)
        get_method("lookm", budget=value)
    except (ValueError, InputError) as error:
        raise argparse.ArgumentTypeError(str(error) if isinstance(error, InputError) else
                                         f"must be a fraction in (0, 1], got {text!r}") from None
    return value
