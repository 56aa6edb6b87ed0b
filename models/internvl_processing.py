"""InternVL dynamic-tiling preprocessing, equal to transformers' GotOcr2 image processor as
InternVLProcessor calls it (crop_to_patches=True); numpy + PIL only.

Per image: pick the tile grid (columns x rows, min_tiles <= columns * rows <= max_tiles) whose aspect
ratio is closest to the image's; PIL-resize the image to that canvas and cut it into tiles,
row-major; when there is more than one tile, append a thumbnail (the whole image resized to one
tile). Every tile is rescaled (float64, then float32) and normalised (float32) with ImageNet
statistics. The prompt then carries tiles * image_seq_length placeholders for the image
(`InternVLConfig.expand_image_markers`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np
from PIL import Image

from lookm_jax.models.image_processing import _to_rgb, check_pixel_settings, check_positive_ints, pop_processor_keys

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_PROCESSOR_TYPES = {"GotOcr2ImageProcessor", "GotOcr2ImageProcessorFast", "GotOcr2ImageProcessorPil"}
# Keys saved with values that change nothing here.
_NEUTRAL = {"do_convert_rgb": (True,), "do_resize": (True,), "default_to_square": (True,),
            "data_format": ("channels_first",), "input_data_format": (None,), "return_tensors": (None,),
            "device": (None,), "disable_grouping": (None,), "do_center_crop": (None, False), "crop_size": (None,),
            "do_pad": (None, False), "pad_size": (None,)}


@dataclasses.dataclass(frozen=True)
class InternVLImageProcessorConfig:
    """Defaults are the InternVL2.5/3 "-hf" checkpoints' (448 px tiles, at most 12 + a thumbnail)."""

    tile_size: int = 448
    min_tiles: int = 1
    max_tiles: int = 12
    resample: int = int(Image.Resampling.BICUBIC)
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = IMAGENET_MEAN
    image_std: tuple[float, float, float] = IMAGENET_STD

    def __post_init__(self):
        check_positive_ints(self, ("tile_size", "min_tiles", "max_tiles"))
        if self.min_tiles > self.max_tiles:
            raise ValueError(f"min_tiles={self.min_tiles} exceeds max_tiles={self.max_tiles}")
        check_pixel_settings(self)

    @classmethod
    def from_hf_dict(cls, d: dict) -> InternVLImageProcessorConfig:
        """From an InternVL preprocessor_config.json (GotOcr2 image processor); refuses what it cannot do.

        `crop_to_patches` is accepted whatever its saved value: InternVLProcessor always passes True.
        """
        d = dict(d)
        pop_processor_keys(d, _PROCESSOR_TYPES, _NEUTRAL)
        d.pop("crop_to_patches", None)
        if not d.pop("do_rescale", True) or not d.pop("do_normalize", True):
            raise ValueError("do_rescale=False / do_normalize=False are not supported")
        kwargs = {}
        if "size" in d:
            size = d.pop("size")
            if not (isinstance(size, dict) and set(size) == {"height", "width"} and size["height"] == size["width"]):
                raise ValueError(f"size={size!r} is not supported (only square {{'height': n, 'width': n}})")
            kwargs["tile_size"] = size["height"]
        for ours, hf in (("min_tiles", "min_patches"), ("max_tiles", "max_patches"), ("resample", "resample"),
                         ("rescale_factor", "rescale_factor"), ("image_mean", "image_mean"),
                         ("image_std", "image_std")):
            if hf in d:
                value = d.pop(hf)
                kwargs[ours] = tuple(value) if hf in ("image_mean", "image_std") else value
        if d:
            raise ValueError(f"unsupported preprocessor_config.json fields: {sorted(d)}")
        return cls(**kwargs)


@functools.lru_cache(maxsize=16)
def _grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """(columns, rows) with min <= columns * rows <= max, by tile count (stable: HF's order)."""
    grids = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
             if min_tiles <= c * r <= max_tiles]
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def tile_grid(width: int, height: int, config: InternVLImageProcessorConfig) -> tuple[int, int]:
    """(columns, rows) whose aspect ratio is closest to width / height.

    A tie goes to the later (more tiles) grid while the image's area exceeds half the grid's pixel area.
    """
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for columns, rows in _grids(config.min_tiles, config.max_tiles):
        diff = abs(aspect - columns / rows)
        if diff < best_diff:
            best, best_diff = (columns, rows), diff
        elif diff == best_diff and area > 0.5 * config.tile_size**2 * columns * rows:
            best = (columns, rows)
    return best


def _normalise(tile: Image.Image, config: InternVLImageProcessorConfig) -> np.ndarray:
    """RGB tile -> [3, S, S] float32, as transformers rescales (float64) and normalises (float32)."""
    x = (np.asarray(tile).astype(np.float64) * config.rescale_factor).astype(np.float32)
    x = (x - np.asarray(config.image_mean, np.float32)) / np.asarray(config.image_std, np.float32)
    return x.transpose(2, 0, 1)


def image_tiles(image: Image.Image | np.ndarray, config: InternVLImageProcessorConfig) -> list[Image.Image]:
    """One image -> its tiles, row-major, then the thumbnail when there is more than one tile."""
    rgb = _to_rgb(image)
    size = config.tile_size
    columns, rows = tile_grid(*rgb.size, config)
    canvas = rgb.resize((columns * size, rows * size), resample=config.resample)
    tiles = [canvas.crop((c * size, r * size, (c + 1) * size, (r + 1) * size))
             for r in range(rows) for c in range(columns)]
    if len(tiles) > 1:
        tiles.append(rgb.resize((size, size), resample=config.resample))
    return tiles


def preprocess_tiles(
    images: Sequence[Image.Image | np.ndarray] | Image.Image | np.ndarray,
    config: InternVLImageProcessorConfig = InternVLImageProcessorConfig(),
) -> tuple[np.ndarray, list[int]]:
    """PIL images or [H, W, C] uint8 arrays -> (pixel_values [total tiles, 3, S, S] float32, tiles per image)."""
    if isinstance(images, (Image.Image, np.ndarray)):
        images = [images]
    if not images:
        raise ValueError("preprocess_tiles needs at least one image")
    per_image = [image_tiles(image, config) for image in images]
    pixel_values = np.stack([_normalise(tile, config) for tiles in per_image for tile in tiles])
    return pixel_values, [len(tiles) for tiles in per_image]
