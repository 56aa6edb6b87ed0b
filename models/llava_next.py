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
no image packs more), filled from the front. LLaVA-OneVision (`llava_onevision`) extends this: a
packed map may be a bilinear resize of the unpadded one (four weighted rows per token), and an image
may have no grid.

Params: LLaVA-1.5's ({"text", "vision": CLIP, "projector": {w1, b1, w2, b2}}) with
projector["newline"] [H].
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax.errors import InputError
from lookm_jax.models.config import CLIPVisionConfig, ConfigError, LlavaConfig, _require
from lookm_jax.models.qwen2_vl import placeholder_runs
from lookm_jax.models.llava_next_processing import (DEFAULT_PINPOINTS, as_pinpoints, check_pinpoints,
                                                    select_best_resolution)

LAYOUT_FIELDS = ("first_tile", "tile_rows", "tile_cols", "top", "rows", "left", "cols", "out_rows", "out_cols")


@flax.struct.dataclass
class AnyresPixels:
    """LLaVA-NeXT's pixel_values: tiles [U, C, S, S] (every image's base tile then its grid, images one
    after another), sizes [n, 2] int32 (each image's original height, width) and layout [n, 9] int32
    (`LlavaNextConfig.layout`: first tile, grid rows and columns in tiles, the kept window of the
    grid's feature map: top, rows, left, columns, and the packed map's rows and columns: the window's
    own, or LLaVA-OneVision's downsampled size; an image without a grid (OneVision's images of a
    multi-image prompt) has 0 x 0 tiles and a 1 x 0 map: its base tile and one newline). Arrays: one compiled program serves every image
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
    # The feature strategy that leaves a square s x s map per tile (CLIP: its class token dropped).
    FEATURE_STRATEGY: ClassVar[str] = "default"
    NAME: ClassVar[str] = "llava_next"

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

    def packed_grid(self, rows: int, cols: int) -> tuple[int, int]:
        """The unpadded map's (rows, columns) -> the packed map's: LLaVA-NeXT packs it as it is."""
        return rows, cols

    def image_row(self, height: int, width: int, patched: bool = True) -> tuple[int, ...]:
        """One image's layout row (`LAYOUT_FIELDS`, first tile 0); not `patched`: its base tile alone."""
        if not patched:
            return 0, 0, 0, 0, 1, 0, 0, 1, 0
        row = self.image_layout(height, width)
        return (*row, *self.packed_grid(row[4], row[6]))

    def layout(self, sizes: np.ndarray, patched: np.ndarray | None = None) -> np.ndarray:
        """sizes [n, 2] (height, width), patched [n] bool (default all) -> layout [n, 9] int32
        (`LAYOUT_FIELDS`)."""
        patched = np.ones(len(sizes), bool) if patched is None else np.asarray(patched, bool)
        rows = np.asarray([self.image_row(int(h), int(w), bool(p)) for (h, w), p in zip(sizes, patched)],
                          np.int64).reshape(-1, len(LAYOUT_FIELDS))
        tiles = 1 + rows[:, 1] * rows[:, 2]
        rows[:, 0] = np.concatenate([[0], np.cumsum(tiles)[:-1]])
        return rows.astype(np.int32)

    def row_tokens(self, row) -> int:
        """Placeholder tokens of an image of layout `row`: s*s + out_rows * (out_cols + 1)."""
        return self.side**2 + int(row[7]) * (int(row[8]) + 1)

    def image_tokens(self, height: int, width: int, patched: bool = True) -> int:
        """Placeholder tokens of an h x w image (HF's processor count)."""
        return self.row_tokens(self.image_row(height, width, patched))

    def buffer_rows(self, num_tiles: int, num_images: int) -> int:
        """Rows of the static packed buffer: no image packs more than its u tiles' u*s*s + (u - 1)*s."""
        return num_tiles * self.side**2 + (num_tiles - num_images) * self.side

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
        given = np.asarray(pixels.layout)
        patched = given[:, 1] > 0 if given.shape == (len(sizes), len(LAYOUT_FIELDS)) else None
        layout = self.layout(sizes, patched)
        if not np.array_equal(given, layout):
            raise InputError("AnyresPixels.layout is not the one the image sizes imply (`model.preprocess_images` "
                             "or LlavaNextConfig.layout computes it)")
        want = int((1 + layout[:, 1] * layout[:, 2]).sum())
        if want != tiles.shape[0]:
            raise InputError(f"the image sizes imply {want} tiles, AnyresPixels.tiles holds {tiles.shape[0]}")
        need = [self.row_tokens(row) for row in layout]
        runs = placeholder_runs(ids == self.image_token_id, valid)
        if not _fills(runs, need):
            raise InputError(f"the images need {need} placeholder tokens, in order; the prompt's runs of them "
                             f"have {runs}")
        return AnyresPixels(jnp.asarray(tiles, dtype), jnp.asarray(sizes, jnp.int32), jnp.asarray(layout))

    @classmethod
    def from_hf(cls, d: dict[str, Any], vision_parser=CLIPVisionConfig.from_hf, **fields) -> "LlavaNextConfig":
        """A llava-hf LLaVA-NeXT config.json (`llava-hf/llava-v1.6-vicuna-7b-hf`); `vision_parser` and
        `fields` (own fields, already read) for architectures built on it."""
        where = f"{cls.NAME} config"
        _require(d.get("use_image_newline_parameter", True) is True, where, "use_image_newline_parameter",
                 d.get("use_image_newline_parameter"), "true (HF's model always appends image_newline)")
        own = {"image_grid_pinpoints", "use_image_newline_parameter"}
        base = LlavaConfig.from_hf({k: v for k, v in d.items() if k not in own}, vision_parser)
        _require(base.vision_feature_select_strategy == cls.FEATURE_STRATEGY, where, "vision_feature_select_strategy",
                 base.vision_feature_select_strategy, f"'{cls.FEATURE_STRATEGY}' (the tiles' feature maps are square)")
        try:
            pinpoints = as_pinpoints(d.get("image_grid_pinpoints", DEFAULT_PINPOINTS))
            check_pinpoints(pinpoints, base.vision.image_size)
        except ValueError as err:
            raise ConfigError(f"{where}: unsupported value image_grid_pinpoints: {err}") from None
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(LlavaConfig)},
                   image_grid_pinpoints=pinpoints, **fields)


def _fills(runs: list[int], counts: list[int]) -> bool:
    """Whether the placeholder runs are the images' counts in order, adjacent images sharing a run."""
    counts = counts[::-1]
    for run in runs:
        while run > 0 and counts:
            run -= counts.pop()
        if run:
            return False
    return not counts


def _bilinear_source(out: jax.Array, size: jax.Array, out_size: jax.Array) -> tuple[jax.Array, ...]:
    """Output coordinates `out` of a map of `size` resized to `out_size` (all [T] int) -> the two
    source coordinates and the second one's weight, as torch's bilinear interpolate (align_corners
    False, no antialias) computes them in float32: src = max((out + 0.5) * size / out_size - 0.5, 0).
    Same sizes: the weight is exactly 0."""
    scale = size.astype(jnp.float32) / jnp.maximum(out_size, 1).astype(jnp.float32)
    src = jnp.maximum(scale * (out.astype(jnp.float32) + 0.5) - 0.5, 0.0)
    low = jnp.floor(src).astype(jnp.int32)
    return low, jnp.minimum(low + 1, size - 1), jnp.clip(src - low, 0.0, 1.0)


def pack_index(cfg: LlavaNextConfig, layout: jax.Array, num_tiles: int) -> tuple[jax.Array, jax.Array]:
    """layout [n, 9] -> (index [T, 4] int32, weight [T, 4] float32), T = `cfg.buffer_rows`: every
    image's packed tokens in order, then filler, each from four rows (corners r0c0, r0c1, r1c0, r1c1)
    of the tiles' features [U*s*s] followed by the newline (index U*s*s), weighted by (row 0, row 1,
    column 0, column 1). A packed map smaller than the unpadded window (LLaVA-OneVision) is its
    bilinear resize; otherwise the weights are (1, 0, 1, 0)."""
    side, n = cfg.side, layout.shape[0]
    per_tile = side * side
    first, _, tile_cols, top, rows, left, cols, out_rows, out_cols = (layout[:, i] for i in range(9))  # [n] each
    counts = per_tile + out_rows * (out_cols + 1)
    ends = jnp.cumsum(counts)
    t = jnp.arange(cfg.buffer_rows(num_tiles, n))
    image = jnp.minimum(jnp.searchsorted(ends, t, side="right"), n - 1)
    local = t - (ends - counts)[image]  # token within its image
    grid = local - per_tile  # within the packed map with newlines: row r, column c (c = out_cols: newline)
    r, c = grid // (out_cols[image] + 1), grid % (out_cols[image] + 1)
    r0, r1, wr = _bilinear_source(r, rows[image], out_rows[image])
    c0, c1, wc = _bilinear_source(c, cols[image], out_cols[image])

    def mapped(rr, cc):  # window row, column -> row of the tiles' features
        row, col = rr + top[image], cc + left[image]  # in the whole grid's feature map
        tile = first[image] + 1 + row // side * tile_cols[image] + col // side
        return tile * per_tile + row % side * side + col % side

    newline = num_tiles * per_tile
    corners = jnp.stack([mapped(r0, c0), mapped(r0, c1), mapped(r1, c0), mapped(r1, c1)], -1)  # [T, 4]
    weight = jnp.stack([1 - wr, wr, 1 - wc, wc], -1)  # [T, 4]: the rows' weights, the columns'
    single = (local < per_tile) | (c == out_cols[image])  # base tile or newline: one row, weight 1
    one = jnp.where(local < per_tile, first[image] * per_tile + local, newline)
    index = jnp.where(single[:, None], one[:, None], corners)
    weight = jnp.where(single[:, None], jnp.asarray([1.0, 0.0, 1.0, 0.0], jnp.float32), weight)
    return jnp.clip(index, 0, newline).astype(jnp.int32), weight


def pack_features(cfg: LlavaNextConfig, features: jax.Array, newline: jax.Array, pixels: AnyresPixels) -> jax.Array:
    """Projected tile features [U, s*s, H] and the newline [H] -> packed [1, T, H], T =
    `cfg.buffer_rows` (every image's tokens from the front; `llava.place_features` takes as many as
    there are placeholders)."""
    table = jnp.concatenate([features.reshape(-1, features.shape[-1]), newline[None].astype(features.dtype)])
    index, weight = pack_index(cfg, pixels.layout, features.shape[0])
    x = table[index]  # [T, 4, H]
    w = weight.astype(x.dtype)[..., None]  # [T, 4, 1]
    # torch's order: each row's columns, then the rows; zero weights add exact zeros
    packed = (x[:, 0] * w[:, 2] + x[:, 1] * w[:, 3]) * w[:, 0] + (x[:, 2] * w[:, 2] + x[:, 3] * w[:, 3]) * w[:, 1]
    return packed[None]


def concat_pixels(parts: list[AnyresPixels]) -> AnyresPixels:
    """Several prompts' `AnyresPixels` (each from `model.preprocess_images`) -> one, in order (the
    layouts' first tiles offset)."""
    offsets = np.cumsum([0] + [int(np.asarray(p.tiles).shape[0]) for p in parts[:-1]])
    layout = np.concatenate([np.asarray(p.layout) for p in parts])
    layout[:, 0] += np.repeat(offsets, [np.asarray(p.layout).shape[0] for p in parts]).astype(layout.dtype)
    return AnyresPixels(np.concatenate([np.asarray(p.tiles) for p in parts]),
                        np.concatenate([np.asarray(p.sizes) for p in parts]), layout)
