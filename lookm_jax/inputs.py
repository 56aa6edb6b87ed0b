"""Checks of what a caller hands the `Model` API, done once where it enters.

`prepare` is the one gate of `Model.run` and `sweep.generate_methods` (`Model.logits` uses its
pieces): token ids, padding mask, prompt bucket, context length, method budgets and pixel values.
Each refusal is an `InputError` naming the value and the accepted range.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax import generate as gen
from lookm_jax.checks import as_int, is_int_at_least
from lookm_jax.compression.scoring import RECONSTRUCTION
from lookm_jax.errors import MAX_SEED, PARAM_DTYPES, InputError, PromptTooLongError
from lookm_jax.models import llava


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A checked, right-padded batch of prompts."""
    ids: np.ndarray  # [B, bucket] int32
    valid: np.ndarray  # [B, bucket] bool, True = real token
    pixel_values: jax.Array | None  # [units, C, H, W] in the model's dtype

    @property
    def lengths(self) -> np.ndarray:
        """[B] real tokens per row."""
        return self.valid.sum(1)


def check_max_new_tokens(max_new_tokens) -> None:
    if not is_int_at_least(max_new_tokens, 1):
        raise InputError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")


def check_dtype(dtype) -> None:
    """A parameter and activation dtype the programs support (`PARAM_DTYPES`, by name or dtype)."""
    try:
        name = None if dtype is None else jnp.dtype(dtype).name  # jnp.dtype(None) is float64
    except (TypeError, ValueError):
        name = None
    if name not in PARAM_DTYPES:
        raise InputError(f"dtype must be one of {', '.join(PARAM_DTYPES)}, got {name or repr(dtype)}")


def check_seed(seed) -> None:
    value = as_int(seed)
    if value is None or not 0 <= value <= MAX_SEED:
        raise InputError(f"seed must be an int in [0, {MAX_SEED}], got {seed!r}")


def check_flag(value, name: str) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise InputError(f"{name} must be True or False, got {value!r}")


def check_buckets(buckets) -> None:
    """`Model.buckets`: the prompt lengths programs are compiled for."""
    if not (isinstance(buckets, (tuple, list)) and buckets and all(is_int_at_least(b, 1) for b in buckets)):
        raise InputError(f"model.buckets must be a non-empty tuple of prompt lengths (ints >= 1), got {buckets!r}")


def _array(values, name: str) -> np.ndarray:
    try:
        return np.asarray(values)
    except ValueError:  # ragged nested lists
        raise InputError(f"{name} must be a rectangular [batch, length] array; its rows differ in length") from None


def token_ids(config, input_ids, attention_mask=None) -> tuple[np.ndarray, np.ndarray]:
    """-> (ids [B, L] int32, mask [B, L] bool). Refuses non-integer ids, a mask that is not 0/1, rows
    without a real token and, at real (unmasked) positions, ids outside [0, vocab_size) other than
    the image placeholder."""
    ids = _array(input_ids, "input_ids")
    if ids.dtype.kind not in "iu":
        raise InputError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
    if ids.ndim != 2 or 0 in ids.shape:
        raise InputError(f"input_ids must be [batch, length] with both >= 1, got shape {ids.shape}")
    mask = np.ones(ids.shape, bool) if attention_mask is None else _array(attention_mask, "attention_mask")
    if mask.shape != ids.shape:
        raise InputError(f"attention_mask shape {mask.shape} != input_ids shape {ids.shape}")
    if mask.dtype != bool:
        if mask.dtype.kind not in "iuf" or not np.isin(mask, (0, 1)).all():
            raise InputError(f"attention_mask must hold only 0 and 1 (1 = real token), got dtype {mask.dtype}")
        mask = mask.astype(bool)
    empty = np.flatnonzero(mask.sum(1) == 0)
    if empty.size:
        raise InputError(f"every row needs at least one real token; rows {empty.tolist()} have none")
    vocab = llava.text_config(config).vocab_size
    outside = mask & ((ids < 0) | (ids >= vocab))
    placeholder = config.image_token_id if llava.is_multimodal(config) else None
    if placeholder is not None:
        outside &= ids != placeholder
    if outside.any():
        row, col = np.argwhere(outside)[0]
        also = "" if placeholder is None else f" or the image placeholder {placeholder}"
        raise InputError(f"input_ids hold {int(outside.sum())} id(s) outside the vocabulary [0, {vocab}){also}: "
                         f"first {int(ids[row, col])} at row {row}, position {col}")
    return ids.astype(np.int32), mask


def suggest_bucket(length: int) -> int:
    """The smallest bucket >= length continuing the default table (2^k and 1.5 x 2^k)."""
    k = max(length - 1, 1).bit_length() - 1  # 2^k < length <= 2^(k+1)
    return (3 << (k - 1)) if k and length <= (3 << (k - 1)) else 2 << k


def check_bucket(length: int, buckets: Sequence[int]) -> None:
    if length > max(buckets):
        bucket = suggest_bucket(length)
        raise PromptTooLongError(
            f"prompt of {length} tokens is longer than the largest bucket ({max(buckets)}); add a bucket: "
            f"`model.buckets = (*model.buckets, {bucket})`, or `lookm generate --buckets {bucket}`")


MAX_SLOTS = 2**31 - 1  # a cache's slots (bucket + new tokens) are numbered by int32 positions and indices


def check_context(text_config, length: int, max_new_tokens: int, ignore_context_limit: bool) -> None:
    """prompt + new tokens must fit max_position_embeddings, unless deliberately overridden."""
    limit = text_config.max_position_embeddings
    if length + max_new_tokens > limit and not ignore_context_limit:
        raise InputError(
            f"prompt of {length} tokens + max_new_tokens={max_new_tokens} = {length + max_new_tokens} positions "
            f"exceed the model's context length ({limit}, max_position_embeddings); shorten them, or pass "
            "ignore_context_limit=True (`lookm generate --ignore-context-limit`) to run past it deliberately")


def check_read_twice(text_config, length: int, ignore_context_limit: bool) -> None:
    """A prefill that reads the prompt twice over (scores="reconstruction" or "split") numbers 2 x length positions."""
    limit = text_config.max_position_embeddings
    if 2 * length > limit and not ignore_context_limit:
        raise InputError(
            f"scores='reconstruction' or 'split' (lookm_quota's default) reads a prompt of {length} tokens twice over: "
            f"{2 * length} positions exceed the model's context length ({limit}, max_position_embeddings); use a "
            f"prompt of at most {limit // 2} tokens, scores='attention', or ignore_context_limit=True to run past it "
            "deliberately")


def forward_ids(model, input_ids, attention_mask=None, ignore_context_limit: bool = False):
    """ids of a forward pass without generation (logits, attention statistics): `token_ids`, and a
    length that fits the buckets and the context. -> (ids [B, L] int32, mask [B, L] bool)."""
    check_flag(ignore_context_limit, "ignore_context_limit")
    check_buckets(model.buckets)
    ids, mask = token_ids(model.config, input_ids, attention_mask)
    check_bucket(ids.shape[1], model.buckets)
    check_context(model.text_config, ids.shape[1], 0, ignore_context_limit)
    return ids, mask


def pixel_values(config, dtype, ids: np.ndarray, valid: np.ndarray, pixels) -> jax.Array | None:
    """pixels [units, C, H, W] matching the prompt's placeholders (units = images, or tiles), or what a
    config's own `check_pixels` accepts."""
    multimodal = llava.is_multimodal(config)
    n_placeholders = int(((ids == config.image_token_id) & valid).sum()) if multimodal else 0
    if pixels is None:
        if n_placeholders:
            raise InputError(f"prompt has {n_placeholders} image placeholder tokens but no pixel_values")
        return None
    if not multimodal:
        raise InputError("pixel_values given, but this is a text-only model")
    if hasattr(config, "check_pixels"):  # its own pixel layout (Qwen2-VL: patches + image grids)
        return config.check_pixels(dtype, ids, valid, pixels)
    pixels = np.asarray(pixels)
    expected = config.pixel_shape
    if pixels.ndim != 4 or pixels.shape[1:] != expected:
        raise InputError(f"pixel_values must be [num_images, {', '.join(map(str, expected))}], got {pixels.shape}")
    real = jnp.issubdtype(pixels.dtype, jnp.floating) or jnp.issubdtype(pixels.dtype, jnp.integer)  # bf16 too
    if not real or not np.isfinite(pixels).all():
        raise InputError(f"pixel_values must be finite real numbers (`preprocess_images` gives them), got dtype "
                         f"{pixels.dtype}{' with NaN or inf' if real else ''}")
    n_images = pixels.shape[0]
    if n_placeholders != n_images * config.image_seq_length:
        raise InputError(f"{n_images} image(s) need {n_images * config.image_seq_length} placeholder tokens "
                         f"({config.image_seq_length} each), the prompt has {n_placeholders}")
    return jnp.asarray(pixels, dtype)


def prepare(model, input_ids, pixels, attention_mask, max_new_tokens: int, methods: Sequence,
            ignore_context_limit: bool = False) -> Prompt:
    """Check a generation request against `model` and `methods`, and pack it into its bucket."""
    from lookm_jax.compression.methods import Method

    check_max_new_tokens(max_new_tokens)
    for method in methods:
        if not isinstance(method, Method):
            raise InputError(f"method must be a lookm_jax method (lookm_jax.get_method), got {method!r}")
    check_flag(ignore_context_limit, "ignore_context_limit")
    check_buckets(model.buckets)
    ids, mask = token_ids(model.config, input_ids, attention_mask)
    lengths = mask.sum(1)
    check_bucket(int(lengths.max()), model.buckets)
    check_context(model.text_config, int(lengths.max()), max_new_tokens, ignore_context_limit)
    if any(RECONSTRUCTION in method.statistics for method in methods):
        check_read_twice(model.text_config, int(lengths.max()), ignore_context_limit)
    for method in methods:
        method.check_prompt_lengths(lengths)
    ids, valid = gen.pack_prompts(ids, mask, model.buckets)
    if ids.shape[1] + max_new_tokens > MAX_SLOTS:  # reachable past the context only (ignore_context_limit)
        raise InputError(f"bucket {ids.shape[1]} + max_new_tokens={max_new_tokens} = {ids.shape[1] + max_new_tokens} "
                         f"cache slots exceed the {MAX_SLOTS} that int32 positions can number")
    return Prompt(ids, valid, pixel_values(model.config, model.dtype, ids, valid, pixels))


def open_image(image):
    """An image file (path) -> PIL image, decoded (so a cut file fails here, not mid-run); a PIL
    image or array passes through. Raises InputError for a missing, unreadable, 16-bit or float file."""
    from PIL import Image

    from lookm_jax.models.image_processing import check_bit_depth

    if not isinstance(image, (str, os.PathLike)):
        return image
    try:
        picture = Image.open(image)
        picture.load()
    except FileNotFoundError:
        raise InputError(f"image {image} not found") from None
    except Exception as err:  # PIL raises OSError, SyntaxError, struct.error, ... for a broken file
        raise InputError(f"image {image} is not a readable image ({type(err).__name__}: {err})") from None
    check_bit_depth(picture, f"image {image}")
    return picture
