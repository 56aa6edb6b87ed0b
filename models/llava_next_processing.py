"""LLaVA-NeXT "anyres" preprocessing, equal to transformers' LLaVA-NeXT image processor (the PIL
backend, `LlavaNextImageProcessorPil`) and LLaVA-OneVision's (`LlavaOnevisionImageProcessorPil`,
the same tiling); numpy + PIL only.

Per image of h x w pixels: `select_best_resolution` picks the grid pinpoint (H, W) that keeps the
most of the image's pixels and wastes the least; the image is resized into it keeping its aspect
ratio (`fitted_size`), centred on black (zero) padding, and cut into S x S tiles, row-major (S: the
tower's image size); the whole image resized to S x S (aspect ignored) comes first. Every tile is
rescaled (float64, then float32) and normalised (float32) as the CLIP processor does.

LLaVA-OneVision tiles only the image of a single-image prompt: each image of a multi-image prompt is
padded to a square of its longer side with the mean colour (`expand2square`) and resized to S x S,
one tile (`patched=False`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

from lookm_jax.models.image_processing import (CLIP_MEAN, CLIP_STD, _to_rgb, check_pixel_settings,
                                               check_positive_ints, expand2square, pop_processor_keys)
from lookm_jax.models.internvl_processing import _normalise

_PROCESSOR_TYPES = {"LlavaNextImageProcessor", "LlavaNextImageProcessorFast", "LlavaNextImageProcessorPil",
                    "LlavaOnevisionImageProcessor", "LlavaOnevisionImageProcessorFast",
                    "LlavaOnevisionImageProcessorPil"}
# Keys saved with values that change nothing here (do_pad pads the tile counts of a batch to one size:
# here every image's tiles are concatenated instead).
_NEUTRAL = {"do_convert_rgb": (True,), "do_resize": (True,), "do_center_crop": (True, None), "do_rescale": (True,),
            "do_normalize": (True,), "do_pad": (None, True, False), "default_to_square": (False,),
            "data_format": ("channels_first",), "input_data_format": (None,), "return_tensors": (None,),
            "device": (None,), "disable_grouping": (None,)}
DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


@dataclasses.dataclass(frozen=True)
class LlavaNextImageProcessorConfig:
    """Defaults are llava-hf/llava-v1.6-*'s preprocessor_config.json (HF's class defaults say 224)."""

    tile_size: int = 336  # size.shortest_edge = crop_size: one tile, the base image's side
    image_grid_pinpoints: tuple[tuple[int, int], ...] = DEFAULT_PINPOINTS
    resample: int = int(Image.Resampling.BICUBIC)
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD

    def __post_init__(self):
        check_positive_ints(self, ("tile_size",))
        check_pinpoints(self.image_grid_pinpoints, self.tile_size)
        check_pixel_settings(self)

    @classmethod
    def from_hf_dict(cls, d: dict) -> LlavaNextImageProcessorConfig:
        """From a LLaVA-NeXT preprocessor_config.json; refuses what it cannot do."""
        d = dict(d)
        onevision = str(d.get("image_processor_type")).startswith("LlavaOnevision")  # a square `size`
        pop_processor_keys(d, _PROCESSOR_TYPES, _NEUTRAL)
        size, crop = d.pop("size", {"shortest_edge": 336}), d.pop("crop_size", None)
        square = (onevision and isinstance(size, dict) and set(size) == {"height", "width"}
                  and size["height"] == size["width"])
        if not (isinstance(size, dict) and set(size) == {"shortest_edge"} or square):
            raise ValueError(f"size={size!r} is not supported (only {{'shortest_edge': n}}, or for LLaVA-OneVision "
                             "a square {'height': n, 'width': n})")
        side = size["height"] if square else size["shortest_edge"]
        if crop is not None and crop != {"height": side, "width": side}:
            raise ValueError(f"crop_size={crop!r} is not supported (only the square of size's shortest_edge, {side})")
        kwargs = {"tile_size": side}
        if "image_grid_pinpoints" in d:
            kwargs["image_grid_pinpoints"] = as_pinpoints(d.pop("image_grid_pinpoints"))
        for key in ("resample", "rescale_factor", "image_mean", "image_std"):
            if key in d:
                value = d.pop(key)
                kwargs[key] = tuple(value) if key in ("image_mean", "image_std") else value
        if d:
            raise ValueError(f"unsupported preprocessor_config.json fields: {sorted(d)}")
        return cls(**kwargs)


def as_pinpoints(value) -> tuple[tuple[int, int], ...]:
    """[[H, W], ...] -> ((H, W), ...); refuses anything else."""
    ok = isinstance(value, (list, tuple)) and value and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                             for x in p) for p in value)
    if not ok:
        raise ValueError(f"image_grid_pinpoints must be a non-empty list of [height, width] ints, got {value!r}")
    return tuple((int(h), int(w)) for h, w in value)


def check_pinpoints(pinpoints: tuple[tuple[int, int], ...], tile: int) -> None:
    """Every pinpoint is a whole number of tiles on each side (HF's model divides them by the tile)."""
    bad = [p for p in pinpoints if not all(x >= tile and x % tile == 0 for x in p)]
    if bad:
        raise ValueError(f"image_grid_pinpoints {bad} are not positive multiples of the tile size {tile}")


def select_best_resolution(height: int, width: int, pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The pinpoint (H, W) keeping the most of an h x w image's pixels, then wasting the least (HF's)."""
    best, most, least = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > most or (effective == most and wasted < least):
            best, most, least = (h, w), effective, wasted
    return best


def fitted_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """(height, width) of the image resized into `target` keeping its aspect (HF's `get_patch_output_size`)."""
    target_h, target_w = target
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_h), target_w
    return target_h, min(math.ceil(width * scale_h), target_w)


def image_tiles(image: Image.Image | np.ndarray, config: LlavaNextImageProcessorConfig,
                patched: bool = True) -> tuple[np.ndarray, tuple[int, int]]:
    """One image -> (tiles [1 + rows * columns, 3, S, S] float32: the whole image, then the grid
    row-major; its original (height, width)); not `patched`: [1, 3, S, S], the image padded to a
    square with the mean colour and resized (OneVision's multi-image prompts)."""
    rgb = _to_rgb(image)
    height, width, side = rgb.height, rgb.width, config.tile_size
    if not patched:
        square = expand2square(rgb, tuple(int(m * 255) for m in config.image_mean))
        return _normalise(square.resize((side, side), resample=config.resample), config)[None], (height, width)
    best_h, best_w = select_best_resolution(height, width, config.image_grid_pinpoints)
    new_h, new_w = fitted_size(height, width, (best_h, best_w))
    canvas = np.zeros((best_h, best_w, 3), np.uint8)  # black padding, centred (an odd pixel below / right)
    top, left = (best_h - new_h) // 2, (best_w - new_w) // 2
    canvas[top:top + new_h, left:left + new_w] = np.asarray(rgb.resize((new_w, new_h), resample=config.resample))
    tiles = [rgb.resize((side, side), resample=config.resample)]
    tiles += [Image.fromarray(np.ascontiguousarray(canvas[r:r + side, c:c + side])) for r in range(0, best_h, side)
              for c in range(0, best_w, side)]
    return np.stack([_normalise(tile, config) for tile in tiles]), (height, width)


def preprocess_anyres(
    images: Sequence[Image.Image | np.ndarray] | Image.Image | np.ndarray,
    config: LlavaNextImageProcessorConfig = LlavaNextImageProcessorConfig(),
    patched: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """PIL images or [H, W, C] uint8 arrays -> (tiles [total tiles, 3, S, S] float32, every image's
    tiles one after another; image_sizes [n_images, 2] int64 (height, width)): HF's pixel_values
    without the padding of each image's tile count to the batch's largest, and its image_sizes.
    `patched` False: one padded square tile per image (`image_tiles`)."""
    if isinstance(images, (Image.Image, np.ndarray)):
        images = [images]
    if not images:
        raise ValueError("preprocess_anyres needs at least one image")
    per_image = [image_tiles(image, config, patched) for image in images]
    return (np.concatenate([tiles for tiles, _ in per_image]),
            np.asarray([size for _, size in per_image], np.int64))
