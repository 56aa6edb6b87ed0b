"""Command-line arguments shared by the `lookm` commands, and the demo's default inputs.

A library module: `lookm_jax.cli` and the command modules of its groups (`eval/`, `plots.py`) import
it, never the other way round. Nothing here imports jax.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from lookm_jax.errors import MAX_SEED, InputError
from lookm_jax.models.processors import IMAGE_MARKER

# The demo: two bundled scenes (lookm_jax.scenes.DEMO_SCENES), each after its "Picture k:" marker.
ASSETS = os.path.join(os.path.dirname(__file__), "assets")
DEFAULT_IMAGES = [os.path.join(ASSETS, "scene_1.png"), os.path.join(ASSETS, "scene_2.png")]
DEFAULT_PROMPT = "Picture 1: <image>\nPicture 2: <image>\nWhat colour is the shape in picture 2?"
DEFAULT_TEXT_PROMPT = "Write a haiku about the sea."  # the default prompt without pictures (--text-only)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: ...)" to every option's help, unless the help already says its default
    (options whose default is None describe what their absence means)."""

    def _get_help_string(self, action):
        return action.help if "default" in (action.help or "") else super()._get_help_string(action)


def path_arg(text: str) -> str:
    """argparse type of a file or folder option: "" would silently mean the default or the working
    directory, so it is refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a path, got an empty string")
    return text


def _typed(text: str, convert, accepted, expected: str):
    """`convert(text)` when it parses and is `accepted`; else argparse's error "must be EXPECTED"."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}") from None
    if not accepted(value):
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text}")
    return value


def seed_arg(text: str) -> int:
    """argparse type of --seed: an int in [0, MAX_SEED] (`Model.run`'s range)."""
    return _typed(text, int, lambda v: 0 <= v <= MAX_SEED, f"an integer in [0, {MAX_SEED}]")


def int_at_least(minimum: int):
    """argparse type of a count option: an int >= minimum (argparse's error names the flag)."""
    def parse(text: str) -> int:
        return _typed(text, int, lambda v: v >= minimum, f"an integer >= {minimum}")
    return parse


def positive_float(text: str) -> float:
    """argparse type of a rate: a finite float > 0."""
    return _typed(text, float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")


def finite_float(text: str) -> float:
    """argparse type of a float option whose range check would let nan or inf through."""
    return _typed(text, float, math.isfinite, "a finite number")


def add_method_arguments(parser: argparse.ArgumentParser) -> None:
    """--method/--budget/--alpha-recent/--alpha-important/--merge, read back by `method_from_args`."""
    parser.add_argument("--method", default="full", help="KV-cache method (`lookm methods` lists them)")
    parser.add_argument("--budget", type=float,
                        help="kept fraction of the prompt in (0, 1], split into recent and important slots by the "
                             "method's share (`lookm methods`; default: the method's own alphas)")
    parser.add_argument("--alpha-recent", type=float, help="kept fraction for the recent window (default: the method's)")
    parser.add_argument("--alpha-important", type=float,
                        help="kept fraction for the top-scored tokens (default: the method's)")
    parser.add_argument("--merge", choices=("none", "averaged", "pivotal", "weighted"),
                        help="LOOK-M's merge of evicted pairs (default: the method's)")


def method_from_args(args):
    """The method the arguments name; every option given reaches `get_method`, which refuses what
    the method does not take (e.g. a budget for `full`)."""
    from lookm_jax.compression.methods import get_method

    given = {"budget": args.budget, "alpha_recent": args.alpha_recent, "alpha_important": args.alpha_important,
             "merge": args.merge}
    kwargs = {k: v for k, v in given.items() if v is not None}
    if kwargs.get("merge") == "none":
        kwargs["merge"] = None
    return get_method(args.method, **kwargs)


def add_prompt_arguments(parser: argparse.ArgumentParser, images: bool = True) -> None:
    """--model, --image (when `images`), --prompt / --prompt-file: the input of one chat turn."""
    parser.add_argument("--model", type=path_arg, help="HF llava/llama checkpoint folder, converted folder, or .gguf file "
                                        "(default: the embedded SmolLM2 demo model)")
    if images:
        parser.add_argument("--image", action="append",
                            help="image file, repeatable (default: the demo model's two bundled pictures; none for --model)")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=DEFAULT_PROMPT, help="text of the user turn")
    prompt.add_argument("--prompt-file", type=path_arg, help="read the user turn from this file, '-' for standard input (default: use --prompt)")


def read_prompt(args) -> str:
    """The user turn: --prompt-file's text (a file, or stdin for '-'), else --prompt; refused when
    empty or not UTF-8 (argv and stdin carry undecodable bytes as surrogates)."""
    source = "--prompt" if args.prompt_file is None else f"--prompt-file {args.prompt_file}"
    if args.prompt_file is None:
        text = args.prompt
    elif args.prompt_file == "-":
        text = sys.stdin.read()
    else:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as err:
            raise InputError(f"{source}: cannot be read as UTF-8 text ({err})") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(f"{source}: the prompt is not valid UTF-8 text") from None
    if not text.strip():
        raise InputError(f"{source}: the prompt is empty")
    return text


def default_images(args) -> list[str]:
    """--image as given; else the bundled pictures for the (multimodal) demo model; no images for
    --model. Known before the model loads, so the prompt's markers can be checked first."""
    if args.image is not None:
        return args.image
    return [] if args.model else DEFAULT_IMAGES


def check_image_markers(prompt: str, n_images: int) -> None:
    """Refuse a prompt with more "<image>" markers than images (the markers place that many of the
    images, `Model.encode_chat`'s num_images counts them all); checked before the model loads."""
    inline = prompt.count(IMAGE_MARKER)
    if inline > n_images:
        raise InputError(f"the prompt has {inline} {IMAGE_MARKER} markers but {n_images} image(s) were given")
