"""Per-architecture input processors: pictures -> pixel_values, a rendered chat turn -> token ids.

One processor per config type, listed in `PROCESSORS` (as `llava.IMAGE_FEATURES` lists each
architecture's features function): `Model.preprocess_images` and `Model.encode_chat` only look
it up. The placeholder convention decides the encoding:

- `TextOnly`: a llama/qwen2 text model; images are refused.
- `TokenPlaceholders` (llava-hf): the image token is in the vocabulary; each one the tokenizer
  emits expands to `image_seq_length` copies, as HF's LlavaProcessor does.
- `SplitPlaceholders` (original LLaVA layout, MobileVLM-v2, InternViT-6B-Vicuna): the placeholder
  id (-200) is no token, so the text is split at "<image>", each piece encoded on its own and the
  placeholders put between them, as LLaVA's `tokenizer_image_token` does.
- `Tiles` (HF-format InternVL): dynamic tiles per image; each "<image>" becomes
  <img> + tiles x `image_seq_length` placeholders + </img>, as InternVLProcessor does.
- `AnyresTiles` (LLaVA-NeXT): a base tile and a grid of tiles per image; `preprocess` returns
  `llava_next.AnyresPixels` and each image's placeholder count, and each image token expands to
  its image's count, as LlavaNextProcessor does. `OnevisionTiles` (LLaVA-OneVision): the same for
  one prompt's images, tiled only when it has one (HF's batch_num_images rule).
- `Grids` (Qwen2-VL, Qwen2.5-VL): dynamic resolution; `preprocess` returns `qwen2_vl.Pixels` (patches and
  image grids) and the grids, and each "<image>" becomes <|vision_start|> + grid tokens x
  <|image_pad|> + <|vision_end|>, as Qwen2VLProcessor does.

The CLIP processors use the checkpoint's preprocessor settings, or the CLIP defaults at the
tower's own image size when it has none.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from lookm_jax.errors import InputError
from lookm_jax.models.config import LlamaConfig, LlavaConfig
from lookm_jax.models.internvit import InternViTLlavaConfig
from lookm_jax.models.internvl import InternVLConfig
from lookm_jax.models.llava_next import AnyresPixels, LlavaNextConfig
from lookm_jax.models.llava_onevision import LlavaOnevisionConfig
from lookm_jax.models.mobilevlm import MobileVLMConfig
from lookm_jax.models.qwen2_5_vl import Qwen2_5_VLConfig
from lookm_jax.models.qwen2_vl import IMAGE_PAD, Pixels, Qwen2VLConfig

IMAGE_MARKER = "<image>"


@dataclasses.dataclass(frozen=True)
class Processor(abc.ABC):
    """The input side of one architecture. `settings`: the checkpoint's preprocessor_config.json."""

    config: Any
    settings: dict | None = None
    tiling: ClassVar[bool] = False  # pixel_values units are tiles, so placeholders depend on each image

    def preprocess(self, pictures: Sequence) -> tuple[np.ndarray, list[int] | None]:
        """PIL images -> (pixel_values [units, C, H, W] float32, tiles per image or None)."""
        from lookm_jax.models.image_processing import CLIPImageProcessorConfig, preprocess_images

        settings = self.settings
        if not settings:  # no preprocessor_config.json: the CLIP processor at the tower's own size
            _, height, width = self.config.pixel_shape
            settings = {"size": {"shortest_edge": height}, "crop_size": {"height": height, "width": width}}
        return preprocess_images(pictures, CLIPImageProcessorConfig.from_hf_dict(settings)), None

    def tiles_unchanged(self, total: int, kept: int) -> bool:
        """Whether the last `kept` images of a `total`-image prompt keep their tiles when the others are
        dropped (each image is preprocessed on its own unless a processor says otherwise)."""
        return True

    @abc.abstractmethod
    def encode(self, tokenizer, text: str, image_tiles: Sequence[int] | None) -> list[int]:
        """A rendered chat turn with "<image>" markers -> ids, one placeholder per image feature."""

    def _no_tiles(self, image_tiles) -> None:
        if image_tiles is not None:
            raise InputError("image_tiles is only for tiling architectures (InternVL, LLaVA-NeXT) and image grids "
                             "(Qwen2-VL, Qwen2.5-VL)")


class TextOnly(Processor):
    def preprocess(self, pictures):
        raise InputError(f"{len(pictures)} image(s) given, but this is a text-only model")

    def encode(self, tokenizer, text, image_tiles):
        self._no_tiles(image_tiles)
        return tokenizer.encode(text, add_special_tokens=False).ids


class TokenPlaceholders(Processor):
    def encode(self, tokenizer, text, image_tiles):
        self._no_tiles(image_tiles)
        image_id, n = self.config.image_token_id, self.config.image_seq_length
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        return [t for i in ids for t in ([i] * n if i == image_id else [i])]


class SplitPlaceholders(Processor):
    def encode(self, tokenizer, text, image_tiles):
        self._no_tiles(image_tiles)
        pieces = [tokenizer.encode(piece, add_special_tokens=False).ids for piece in text.split(IMAGE_MARKER)]
        placeholders = [self.config.image_token_id] * self.config.image_seq_length
        return pieces[0] + [t for piece in pieces[1:] for t in placeholders + piece]


class Tiles(Processor):
    tiling = True

    def preprocess(self, pictures):
        from lookm_jax.models.internvl_processing import InternVLImageProcessorConfig, preprocess_tiles

        return preprocess_tiles(pictures, InternVLImageProcessorConfig.from_hf_dict(self.settings or {}))

    def encode(self, tokenizer, text, image_tiles):
        image_token = tokenizer.id_to_token(self.config.image_token_id)
        text = self.config.expand_image_markers(text, image_token, image_tiles or ())
        return tokenizer.encode(text, add_special_tokens=False).ids


class Grids(Processor):
    tiling = True

    def preprocess(self, pictures):
        """-> (qwen2_vl.Pixels, the grids [(1, h, w), ...] for `encode`)."""
        from lookm_jax.models.qwen2_vl_processing import Qwen2VLImageProcessorConfig, preprocess_patches

        settings = self.settings or {"image_processor_type": "Qwen2VLImageProcessor"}
        patches, grids = preprocess_patches(pictures, Qwen2VLImageProcessorConfig.from_hf_dict(settings))
        return Pixels(patches, grids.astype(np.int32)), [tuple(g) for g in grids.tolist()]

    def encode(self, tokenizer, text, image_tiles):
        if tokenizer.token_to_id(IMAGE_PAD) != self.config.image_token_id:
            raise InputError(f"the tokenizer's {IMAGE_PAD} is not image_token_id={self.config.image_token_id}")
        text = self.config.expand_image_markers(text, image_tiles or ())
        return tokenizer.encode(text, add_special_tokens=False).ids


class AnyresTiles(Processor):
    tiling = True

    def default_settings(self) -> dict:
        """No preprocessor_config.json saved: the tower's own tile size and the config's pinpoints."""
        side = self.config.vision.image_size
        return {"image_processor_type": "LlavaNextImageProcessor", "size": {"shortest_edge": side},
                "crop_size": {"height": side, "width": side},
                "image_grid_pinpoints": [list(p) for p in self.config.image_grid_pinpoints]}

    def patched(self, pictures) -> bool:
        """Whether the images are tiled (LLaVA-NeXT: always)."""
        return True

    def preprocess(self, pictures):
        """-> (llava_next.AnyresPixels, each image's placeholder count for `encode`)."""
        from lookm_jax.models.llava_next_processing import LlavaNextImageProcessorConfig, preprocess_anyres

        patched = self.patched(pictures)
        settings = LlavaNextImageProcessorConfig.from_hf_dict(self.settings or self.default_settings())
        tiles, sizes = preprocess_anyres(pictures, settings, patched)
        layout = self.config.layout(sizes, np.full(len(sizes), patched))
        return AnyresPixels(tiles, sizes.astype(np.int32), layout), [self.config.row_tokens(row) for row in layout]

    def encode(self, tokenizer, text, image_tiles):
        """Each image token the tokenizer emits, in order, expands to that image's count (as HF's
        LlavaNextProcessor does)."""
        image_id, counts = self.config.image_token_id, list(image_tiles or ())
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if ids.count(image_id) != len(counts):
            raise InputError(f"the prompt has {ids.count(image_id)} image token(s) but placeholder counts for "
                             f"{len(counts)} image(s) were given (`preprocess_images` returns them)")
        counts.reverse()
        return [t for i in ids for t in ([i] * counts.pop() if i == image_id else [i])]


class OnevisionTiles(AnyresTiles):
    """LLaVA-OneVision: `preprocess` takes one prompt's images; as HF's processor, a single image is
    tiled, each of several is one padded square tile (s*s + 1 placeholders)."""

    def default_settings(self) -> dict:
        side = self.config.vision.image_size
        return {"image_processor_type": "LlavaOnevisionImageProcessor", "size": {"height": side, "width": side},
                "image_grid_pinpoints": [list(p) for p in self.config.image_grid_pinpoints],
                "image_mean": [0.5] * 3, "image_std": [0.5] * 3}

    def patched(self, pictures) -> bool:
        return len(pictures) == 1

    def tiles_unchanged(self, total, kept):
        return (total == 1) == (kept == 1)


def _llava(config: LlavaConfig, settings: dict | None) -> Processor:
    """llava-hf's image token is a vocabulary id; the original layout's (-200) is none."""
    cls = SplitPlaceholders if config.image_token_id < 0 else TokenPlaceholders
    return cls(config, settings)


# config type -> processor(config, preprocessor settings). A new architecture lists its processor here.
PROCESSORS: dict[type, Callable[[Any, dict | None], Processor]] = {
    LlamaConfig: TextOnly,
    LlavaConfig: _llava,
    InternViTLlavaConfig: SplitPlaceholders,
    MobileVLMConfig: SplitPlaceholders,
    InternVLConfig: Tiles,
    Qwen2VLConfig: Grids,
    Qwen2_5_VLConfig: Grids,
    LlavaNextConfig: AnyresTiles,
    LlavaOnevisionConfig: OnevisionTiles,
}


def processor(config, settings: dict | None = None) -> Processor:
    """The registered processor of `config`'s architecture."""
    try:
        make = PROCESSORS[type(config)]
    except KeyError:
        raise TypeError(f"no processor registered for {type(config).__name__}") from None
    return make(config, settings)
