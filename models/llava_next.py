"""LLaVA-NeXT (transformers `LlavaNextForConditionalGeneration`): LLaVA-1.5's CLIP tower, projector
and decoder over "anyres" tiles, packed with a learned newline.

An image of h x w pixels is tiled (`llava_next_processing`): the whole image at S x S, then a grid
of R x C tiles of its best pinpoint resolution. Every tile goes through the tower and projector as
LLaVA-1.5's image does (s x s features, s = S / patch, CLS dropped). HF's `pack_image_features`
then writes, per image: the base tile's s*s features; the grid's features as one (R*s) x (C*s) map
with the rows and columns of padding around the resized image cut off (`unpad_image`: the image's
aspect ratio decides how many), each remaining row followed by the `image_newline` vector. An image
is s*s + rows * (columns + 1) placeholder tokens; the newlines count as image tokens (`is_image`).

`AnyresPixels` carries the tiles and, per image, its size and `layout` (computed on the host from
the size, exactly as HF's Python does); the features function gathers the packed sequence from the
tiles' features by index in jit, into a static buffer of U*s*s + (U - n)*s rows (U tiles, n images:
no image packs more), filled from the front.

Params: LLaVA-1.5's ({"text", "vision": CLIP, "projector": {w1, b1, w2, b2}}) with
projector["newline"] [H].
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax.errors import InputError
from lookm_jax.models.config import ConfigError, LlavaConfig, _require
from lookm_jax.models.qwen2_vl import placeholder_runs
from lookm_jax.models.llava_next_processing import (DEFAULT_PINPOINTS, as_pinpoints, check_pinpoints,
                                                    select_best_resolution)

LAYOUT_FIELDS = ("first_tile", "tile_rows", "tile_cols", "top", "rows", "left", "cols")


@flax.struct.dataclass
class AnyresPixels:
    """LLaVA-NeXT's pixel_values: tiles [U, C, S, S] (every image's base tile then its grid, images one
    after another), sizes [n, 2] int32 (each image's original height, width) and layout [n, 7] int32
    (`LlavaNextConfig.layout`: first tile, grid rows and columns in tiles, then the kept window of the
    grid's feature map: top, rows, left, columns). Arrays: one compiled program serves every image
    size of the same tile and image counts."""
    tiles: jax.Array
    sizes: jax.Array
    layout: jax.Array

    @property
    def shape(self) -> tuple[tuple[int, ...], ...]:
        """The static shapes a compiled program depends on."""
        return self.tiles.shape, self.sizes.shape, self.layout.shape


@dataclasses.dataclass(frozen=True)
class LlavaNextConfig(LlavaConfig):
    image_grid_pinpoints: tuple[tuple[int, int], ...] = DEFAULT_PINPOINTS

    @property
    def side(self) -> int:
        """Features on a side of one tile (s)."""
        return self.vision.image_size // self.vision.patch_size

    def image_layout(self, height: int, width: int) -> tuple[int, ...]:
        """An h x w image -> (0, grid rows, grid columns, top, rows, left, columns): its tile grid
        (HF's `get_anyres_image_grid_shape`) and the window `unpad_image` keeps of the grid's
        feature map, in features (first tile 0: `layout` offsets it)."""
        best_h, best_w = select_best_resolution(height, width, self.image_grid_pinpoints)
        tile_rows, tile_cols = best_h // self.vision.image_size, best_w // self.vision.image_size
        map_h, map_w = tile_rows * self.side, tile_cols * self.side
        top = left = 0
        rows, cols = map_h, map_w
        if width / height > map_w / map_h:  # wider than the map: rows of padding above and below
            top = (map_h - int(round(height * (map_w / width), 7))) // 2
            rows = map_h - 2 * top
        else:
            left = (map_w - int(round(width * (map_h / height), 7))) // 2
            cols = map_w - 2 * left
        return 0, tile_rows, tile_cols, top, rows, left, cols

    def layout(self, sizes: np.ndarray) -> np.ndarray:
        """sizes [n, 2] (height, width) -> layout [n, 7] int32 (`LAYOUT_FIELDS`)."""
        rows = np.asarray([self.image_layout(int(h), int(w)) for h, w in sizes], np.int64).reshape(-1, 7)
        tiles = 1 + rows[:, 1] * rows[:, 2]
        rows[:, 0] = np.concatenate([[0], np.cumsum(tiles)[:-1]])
        return rows.astype(np.int32)

    def image_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens of an h x w image: s*s + rows * (columns + 1) (HF's processor count)."""
        *_, rows, _, cols = self.image_layout(height, width)
        return self.side**2 + rows * (cols + 1)

    def check_pixels(self, dtype, ids: np.ndarray, valid: np.ndarray, pixels) -> AnyresPixels:
        """Host-side check of `AnyresPixels` against the prompt: shapes, finite values, the tiles and
        placeholders every image's size implies."""
        if not isinstance(pixels, AnyresPixels):
            raise InputError(f"LLaVA-NeXT takes pixel_values as llava_next.AnyresPixels (`model.preprocess_images` "
                             f"returns them), got {type(pixels).__name__}")
        tiles, sizes = np.asarray(pixels.tiles), np.asarray(pixels.sizes)
        if tiles.ndim != 4 or tiles.shape[1:] != self.pixel_shape or sizes.ndim != 2 or sizes.shape[1] != 2:
            raise InputError(f"AnyresPixels need tiles [U, {', '.join(map(str, self.pixel_shape))}] and sizes "
                             f"[images, 2], got {tiles.shape} and {sizes.shape}")
        if tiles.dtype.kind != "f" or not np.isfinite(tiles).all():
            raise InputError(f"AnyresPixels.tiles must be finite floats, got dtype {tiles.dtype}")
        if sizes.dtype.kind not in "iu" or (sizes < 1).any():
            raise InputError(f"AnyresPixels.sizes must be positive (height, width) ints, got {sizes.tolist()}")
        layout = self.layout(sizes)
        if not np.array_equal(np.asarray(pixels.layout), layout):
            raise InputError("AnyresPixels.layout is not the one the image sizes imply (`model.preprocess_images` "
                             "or LlavaNextConfig.layout computes it)")
        want = int((1 + layout[:, 1] * layout[:, 2]).sum())
        if want != tiles.shape[0]:
            raise InputError(f"the image sizes imply {want} tiles, AnyresPixels.tiles holds {tiles.shape[0]}")
        need = [self.image_tokens(int(h), int(w)) for h, w in sizes]
        runs = placeholder_runs(ids == self.image_token_id, valid)
        if not _fills(runs, need):
            raise InputError(f"the images need {need} placeholder tokens, in order; the prompt's runs of them "
                             f"have {runs}")
        return AnyresPixels(jnp.asarray(tiles, dtype), jnp.asarray(sizes, jnp.int32), jnp.asarray(layout))

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "LlavaNextConfig":
        """A llava-hf LLaVA-NeXT config.json (`llava-hf/llava-v1.6-vicuna-7b-hf`)."""
        where = "llava_next config"
        _require(d.get("use_image_newline_parameter", True) is True, where, "use_image_newline_parameter",
                 d.get("use_image_newline_parameter"), "true (HF's model always appends image_newline)")
        own = {"image_grid_pinpoints", "use_image_newline_parameter"}
        base = LlavaConfig.from_hf({k: v for k, v in d.items() if k not in own})
        _require(base.vision_feature_select_strategy == "default", where, "vision_feature_select_strategy",
                 base.vision_feature_select_strategy, "'default' (the tiles' feature maps are square)")
        try:
            pinpoints = as_pinpoints(d.get("image_grid_pinpoints", DEFAULT_PINPOINTS))
            check_pinpoints(pinpoints, base.vision.image_size)
        except ValueError as err:
            raise ConfigError(f"{where}: unsupported value image_grid_pinpoints: {err}") from None
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(LlavaConfig)},
                   image_grid_pinpoints=pinpoints)


def _fills(runs: list[int], counts: list[int]) -> bool:
    """Whether the placeholder runs are the images' counts in order, adjacent images sharing a run."""
    counts = counts[::-1]
    for run in runs:
        while run > 0 and counts:
            run -= counts.pop()
        if run:
            return False
    return not counts


def pack_index(cfg: LlavaNextConfig, layout: jax.Array, num_tiles: int) -> jax.Array:
    """layout [n, 7] -> index [U*s*s + (U - n)*s] int32 into the tiles' features [U*s*s] followed by
    the newline (index U*s*s): every image's packed tokens in order, then filler."""
    side, n = cfg.side, layout.shape[0]
    per_tile = side * side
    first, _, tile_cols, top, rows, left, cols = (layout[:, i] for i in range(7))  # [n] each
    counts = per_tile + rows * (cols + 1)
    ends = jnp.cumsum(counts)
    t = jnp.arange(num_tiles * per_tile + (num_tiles - n) * side)
    image = jnp.minimum(jnp.searchsorted(ends, t, side="right"), n - 1)
    local = t - (ends - counts)[image]  # token within its image
    grid = local - per_tile  # within the unpadded map with newlines: row r, column c (c = cols: newline)
    r, c = grid // (cols[image] + 1), grid % (cols[image] + 1)
    row, col = r + top[image], c + left[image]  # in the whole grid's feature map
    tile = first[image] + 1 + row // side * tile_cols[image] + col // side
    mapped = tile * per_tile + row % side * side + col % side
    newline = num_tiles * per_tile
    index = jnp.where(local < per_tile, first[image] * per_tile + local, jnp.where(c == cols[image], newline, mapped))
    return jnp.clip(index, 0, newline).astype(jnp.int32)


def pack_features(cfg: LlavaNextConfig, features: jax.Array, newline: jax.Array, pixels: AnyresPixels) -> jax.Array:
    """Projected tile features [U, s*s, H] and the newline [H] -> packed [1, U*s*s + (U - n)*s, H]
    (every image's tokens from the front; `llava.place_features` takes as many as there are
    placeholders)."""
    table = jnp.concatenate([features.reshape(-1, features.shape[-1]), newline[None].astype(features.dtype)])
    return table[pack_index(cfg, pixels.layout, features.shape[0])][None]
