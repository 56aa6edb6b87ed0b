"""Qwen2-VL dynamic-resolution preprocessing, equal to transformers' Qwen2-VL image processor (the
PIL backend, `Qwen2VLImageProcessorPil`); numpy + PIL only.

Per image: `smart_resize` picks the size (both sides multiples of patch x merge, the area within
[min_pixels, max_pixels], the aspect ratio kept as closely as that allows); PIL resizes to it; the
pixels are rescaled (float64, then float32) and normalised (float32, CLIP statistics); then cut into
p x p patches, each repeated temporal_patch_size times and flattened (C, T, p, p), in merge-window
order (each m x m window's patches consecutive, windows row-major). An image of h x w patches
becomes h*w / m^2 tokens (`Qwen2VLConfig.expand_image_markers`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

from lookm_jax.models.image_processing import (CLIP_MEAN, CLIP_STD, _to_rgb, check_pixel_settings,
                                               check_positive_ints, pop_processor_keys)
from lookm_jax.models.internvl_processing import _normalise

_PROCESSOR_TYPES = {"Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil"}
# Keys saved with values that change nothing here.
_NEUTRAL = {"do_convert_rgb": (True,), "do_resize": (True,), "do_rescale": (True,), "do_normalize": (True,),
            "default_to_square": (False,), "data_format": ("channels_first",), "input_data_format": (None,),
            "return_tensors": (None,), "device": (None,), "disable_grouping": (None,), "do_pad": (None, False),
            "pad_size": (None,), "crop_size": (None,), "do_center_crop": (None, False)}
MAX_ASPECT = 200  # smart_resize refuses images more elongated than this


@dataclasses.dataclass(frozen=True)
class Qwen2VLImageProcessorConfig:
    """Defaults are HF's Qwen2VLImageProcessor's (the checkpoints' preprocessor_config.json may raise
    max_pixels: Qwen2-VL-7B-Instruct's is 12845056)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: int = int(Image.Resampling.BICUBIC)
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD

    def __post_init__(self):
        check_positive_ints(self, ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"))
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels={self.min_pixels} exceeds max_pixels={self.max_pixels}")
        check_pixel_settings(self)

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: one merge window of patches."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_hf_dict(cls, d: dict) -> Qwen2VLImageProcessorConfig:
        """From a Qwen2-VL preprocessor_config.json; refuses what it cannot do."""
        d = dict(d)
        pop_processor_keys(d, _PROCESSOR_TYPES, _NEUTRAL)
        kwargs = {}
        size = d.pop("size", None) or {}
        if not (isinstance(size, dict) and set(size) <= {"shortest_edge", "longest_edge"}):
            raise ValueError(f"size={size!r} is not supported (only {{'shortest_edge': min_pixels, "
                             "'longest_edge': max_pixels}})")
        # As HF's __init__: min_pixels / max_pixels override size's entries.
        for ours, key in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            value = d.pop(ours, None)
            value = size.get(key) if value is None else value
            if value is not None:
                kwargs[ours] = value
        for key in ("patch_size", "temporal_patch_size", "merge_size", "resample", "rescale_factor", "image_mean",
                    "image_std"):
            if key in d:
                value = d.pop(key)
                kwargs[key] = tuple(value) if key in ("image_mean", "image_std") else value
        if d:
            raise ValueError(f"unsupported preprocessor_config.json fields: {sorted(d)}")
        return cls(**kwargs)


def smart_resize(height: int, width: int, config: Qwen2VLImageProcessorConfig) -> tuple[int, int]:
    """(height, width) -> the resized (height, width), as HF's `smart_resize`."""
    factor, low, high = config.factor, config.min_pixels, config.max_pixels
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(f"an image's aspect ratio must be at most {MAX_ASPECT}, got {height} x {width}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > high:
        beta = math.sqrt(height * width / high)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < low:
        beta = math.sqrt(low / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_patches(image: Image.Image | np.ndarray, config: Qwen2VLImageProcessorConfig) -> tuple[np.ndarray,
                                                                                                  tuple[int, int, int]]:
    """One image -> (patches [h*w, C*T*p*p] float32, its grid (1, h, w) in patches)."""
    rgb = _to_rgb(image)
    height, width = smart_resize(rgb.height, rgb.width, config)
    x = _normalise(rgb.resize((width, height), resample=config.resample), config)  # [C, H, W]
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    c, gh, gw = x.shape[0], height // p, width // p
    x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, p, p]
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))  # the picture repeated over time
    return x.reshape(gh * gw, c * t * p * p), (1, gh, gw)


def preprocess_patches(
    images: Sequence[Image.Image | np.ndarray] | Image.Image | np.ndarray,
    config: Qwen2VLImageProcessorConfig = Qwen2VLImageProcessorConfig(),
) -> tuple[np.ndarray, np.ndarray]:
    """PIL images or [H, W, C] uint8 arrays -> (patches [total patches, C*T*p*p] float32, grids
    [n_images, 3] int64): HF's (pixel_values, image_grid_thw)."""
    if isinstance(images, (Image.Image, np.ndarray)):
        images = [images]
    if not images:
        raise ValueError("preprocess_patches needs at least one image")
    per_image = [image_patches(image, config) for image in images]
    return (np.concatenate([patches for patches, _ in per_image]),
            np.asarray([grid for _, grid in per_image], np.int64))
