"""LLaVA-OneVision (transformers `LlavaOnevisionForConditionalGeneration`): LLaVA-NeXT's anyres
tiling and packing over a SigLIP tower (`siglip`, the last hidden state, every patch kept: no class
token) and a Qwen2 decoder (`llama` with q/k/v biases).

What differs from LLaVA-NeXT (`llava_next`, whose layout and packing code serves both):
- `vision_aspect_ratio="anyres_max_<m>"`: an unpadded feature map of rows x cols larger than
  m * s * s by a ratio r = sqrt(rows * cols / (m * s * s)) > 1.1 is bilinearly resized (torch's
  interpolate: align_corners False, no antialias) to int(rows // r) x int(cols // r) before the
  newlines are appended (`packed_grid`; `llava_next.pack_index` gathers four weighted rows).
- HF's processor tiles only the image of a single-image prompt (`batch_num_images`); each image of a
  multi-image prompt is one square tile (padded with the mean colour) and s*s + 1 tokens: its
  features and one newline. `model.preprocess_images(images)` takes one prompt's images; join
  several prompts' with `llava_next.concat_pixels`.
- SigLIP's normalisation (mean = std = 0.5) and a square `size` in the preprocessor config.
Video inputs (`<video>`, `pixel_values_videos`) are not supported.

Params: LLaVA-NeXT's, with a SigLIP tower ({"vision": siglip params}).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, ClassVar

from lookm_jax.models.config import ConfigError, _require
from lookm_jax.models.llava_next import LlavaNextConfig
from lookm_jax.models.siglip import SiglipVisionConfig

# HF's LlavaOnevisionConfig default pinpoints: every (i, j) * 384 for i, j in 1..6.
DEFAULT_PINPOINTS = tuple((384 * i, 384 * j) for i in range(1, 7) for j in range(1, 7))


@dataclasses.dataclass(frozen=True)
class LlavaOnevisionConfig(LlavaNextConfig):
    image_grid_pinpoints: tuple[tuple[int, int], ...] = DEFAULT_PINPOINTS
    max_num_patches: int = 9  # vision_aspect_ratio "anyres_max_9"
    FEATURE_STRATEGY: ClassVar[str] = "full"  # SigLIP has no class token: every patch is a feature
    NAME: ClassVar[str] = "llava_onevision"

    def packed_grid(self, rows: int, cols: int) -> tuple[int, int]:
        """The unpadded map's (rows, columns) -> the bilinearly downsampled size when it exceeds
        max_num_patches tiles' features by a ratio over 1.1 (HF's pack_image_features and
        `_get_unpadded_features`, same float arithmetic)."""
        ratio = math.sqrt(rows * cols / (self.max_num_patches * self.side**2))
        if ratio > 1.1:
            return int(rows // ratio), int(cols // ratio)
        return rows, cols

    def buffer_rows(self, num_tiles: int, num_images: int) -> int:
        """LLaVA-NeXT's bound plus one row per image: an image without a grid packs s*s + 1."""
        return super().buffer_rows(num_tiles, num_images) + num_images

    @classmethod
    def from_hf(cls, d: dict[str, Any], vision_parser=SiglipVisionConfig.from_hf, **fields) -> "LlavaOnevisionConfig":
        """A llava-hf LLaVA-OneVision config.json (`llava-hf/llava-onevision-qwen2-7b-ov-hf`); absent
        fields take HF's LlavaOnevisionConfig defaults."""
        where = "llava_onevision config"
        aspect = d.get("vision_aspect_ratio", "anyres_max_9")
        match = re.fullmatch(r"anyres_max_([1-9][0-9]*)", aspect) if isinstance(aspect, str) else None
        _require(match is not None, where, "vision_aspect_ratio", aspect, "'anyres_max_<n>' (n >= 1)")
        for video in ("video_token_index", "video_token_id"):  # only the videos' placeholder; videos are refused
            if not (d.get(video) is None or isinstance(d.get(video), int) and not isinstance(d.get(video), bool)):
                raise ConfigError(f"{where}: {video} must be an int, got {d.get(video)!r}")
        rest = {k: v for k, v in d.items() if k not in ("vision_aspect_ratio", "video_token_index", "video_token_id")}
        rest = {"vision_feature_select_strategy": "full", "vision_feature_layer": -1, "image_token_index": 151646,
                "image_grid_pinpoints": [list(p) for p in DEFAULT_PINPOINTS], **rest}
        if "vision_config" not in rest:
            rest["vision_config"] = {"hidden_size": 1152, "intermediate_size": 4304, "patch_size": 14,
                                     "image_size": 384, "num_hidden_layers": 26, "num_attention_heads": 16}
        rest.setdefault("text_config", {"model_type": "qwen2"})
        return super().from_hf(rest, vision_parser, max_num_patches=int(match.group(1)), **fields)
