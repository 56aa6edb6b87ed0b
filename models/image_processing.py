"""CLIP image preprocessing (LLaVA-1.5), equal to transformers' CLIPImageProcessor; numpy + PIL only.

Without torchvision, transformers 5.x gives `CLIPImageProcessorPil` for `CLIPImageProcessor`; this
module reproduces it step by step: RGB (alpha composited onto white) -> PIL resize of the shortest
edge -> center crop (zero pad if smaller) -> rescale (float64, then float32) -> normalise (float32).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from PIL import Image

from lookm_jax.errors import InputError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_PROCESSOR_TYPES = {"CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil", "CLIPFeatureExtractor"}
# Keys newer transformers versions save with values that change nothing here.
_NEUTRAL = {
    "default_to_square": (False,),
    "do_pad": (None, False),
    "pad_size": (None,),
    "data_format": ("channels_first",),
    "input_data_format": (None,),
    "return_tensors": (None,),
    "device": (None,),
    "disable_grouping": (None,),
}


def check_positive_ints(config, names: tuple[str, ...]) -> None:
    """Each named field of an image processor config is a positive int (not a bool)."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def pop_processor_keys(d: dict, kinds: set[str], neutral: dict[str, tuple]) -> None:
    """Remove from a preprocessor_config.json dict its image_processor_type (one of `kinds`), the
    informational processor_class and the `neutral` keys (each only with a value it lists)."""
    kind = d.pop("image_processor_type", None)
    if kind not in kinds:
        raise ValueError(f"image_processor_type {kind!r} is not supported (only {sorted(kinds)})")
    d.pop("processor_class", None)  # which processor wraps this one: informational
    for key, allowed in neutral.items():
        if key in d and d.pop(key) not in allowed:
            raise ValueError(f"preprocessor field {key!r} is only supported with values {allowed}")


def check_pixel_settings(config) -> None:
    """Validate the fields every image processor config shares: resample, rescale_factor, image_mean/std."""
    if not isinstance(config.rescale_factor, (int, float)) or config.rescale_factor <= 0:
        raise ValueError(f"rescale_factor must be a positive number, got {config.rescale_factor!r}")
    if config.resample not in {int(r) for r in Image.Resampling}:
        raise ValueError(f"resample={config.resample!r} is not a PIL resampling filter")
    for name in ("image_mean", "image_std"):
        value = getattr(config, name)
        if len(value) != 3 or not all(isinstance(v, (int, float)) for v in value):
            raise ValueError(f"{name} must be 3 numbers (R, G, B), got {value!r}")
    if 0 in config.image_std:
        raise ValueError(f"image_std must be non-zero, got {config.image_std!r}")


@dataclasses.dataclass(frozen=True)
class CLIPImageProcessorConfig:
    """Preprocessing settings; defaults are LLaVA-1.5's (336 px CLIP ViT-L/14)."""

    do_convert_rgb: bool = True
    do_resize: bool = True
    shortest_edge: int = 336
    resample: int = int(Image.Resampling.BICUBIC)
    do_center_crop: bool = True
    crop_height: int = 336
    crop_width: int = 336
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    # Original LLaVA-family configs' key: 'pad' first pads each image to a square (`expand2square`).
    image_aspect_ratio: str | None = None

    def __post_init__(self):
        if self.image_aspect_ratio not in (None, "pad", "square"):
            raise ValueError(f"image_aspect_ratio={self.image_aspect_ratio!r} is not supported (None, 'pad', 'square')")
        for name in ("do_convert_rgb", "do_resize", "do_center_crop", "do_rescale", "do_normalize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not self.do_convert_rgb:
            raise ValueError("do_convert_rgb=False is not supported: images are always converted to RGB")
        for name in ("shortest_edge", "crop_height", "crop_width"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        check_pixel_settings(self)

    @classmethod
    def from_hf_dict(cls, d: dict) -> CLIPImageProcessorConfig:
        """From a Hugging Face preprocessor_config.json dict; refuses fields or values not implemented."""
        d = dict(d)
        kinds = {d.pop(k) for k in ("image_processor_type", "feature_extractor_type") if k in d}
        if kinds - _PROCESSOR_TYPES:
            raise ValueError(f"image_processor_type {sorted(kinds)} is not supported (only {sorted(_PROCESSOR_TYPES)})")
        d.pop("processor_class", None)  # which processor wraps this one: informational
        for key, allowed in _NEUTRAL.items():
            if key in d and d.pop(key) not in allowed:
                raise ValueError(f"preprocessor field {key!r} is only supported with values {allowed}")
        kwargs = {}
        if "size" in d:
            kwargs["shortest_edge"] = _shortest_edge(d.pop("size"))
        if "crop_size" in d:
            kwargs["crop_height"], kwargs["crop_width"] = _crop_size(d.pop("crop_size"))
        for field in ("do_convert_rgb", "do_resize", "resample", "do_center_crop", "do_rescale", "rescale_factor",
                      "do_normalize", "image_mean", "image_std", "image_aspect_ratio"):  # fmt: skip
            if field in d:
                value = d.pop(field)
                kwargs[field] = tuple(value) if field in ("image_mean", "image_std") else value
        if d:
            raise ValueError(f"unsupported preprocessor_config.json fields: {sorted(d)}")
        return cls(**kwargs)


def _shortest_edge(size) -> int:
    if isinstance(size, int):  # legacy CLIPFeatureExtractor form: the shortest edge
        return size
    if isinstance(size, dict) and set(size) == {"shortest_edge"}:
        return size["shortest_edge"]
    raise ValueError(f"size={size!r} is not supported (only {{'shortest_edge': n}})")


def _crop_size(crop) -> tuple[int, int]:
    if isinstance(crop, int):  # legacy form: a square
        return crop, crop
    if isinstance(crop, dict) and set(crop) == {"height", "width"}:
        return crop["height"], crop["width"]
    raise ValueError(f"crop_size={crop!r} is not supported (only {{'height': h, 'width': w}})")


def check_bit_depth(image: Image.Image, what: str = "an image") -> None:
    """Refuse 16-bit and float PIL images (modes I;16*, I, F): converting them to RGB, as transformers
    does too, clips every value above 255, so most pictures would come out white."""
    if image.mode in ("I", "F") or image.mode.startswith("I;16"):
        raise InputError(f"{what} has {'float' if image.mode == 'F' else '16/32-bit integer'} pixels (PIL mode "
                         f"{image.mode}), which RGB conversion clips at 255; convert it to 8-bit RGB first")


def _to_rgb(image: Image.Image | np.ndarray) -> Image.Image:
    """RGB PIL image; transparency is composited onto white, as transformers' convert_to_rgb does."""
    size = image.size if isinstance(image, Image.Image) else getattr(image, "shape", (1, 1))[:2]
    if 0 in size:
        raise InputError(f"an image has no pixels (size {tuple(size)})")
    if isinstance(image, Image.Image):
        check_bit_depth(image)
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
        return image.convert("RGB")
    is_hwc_uint8 = isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3
    if not is_hwc_uint8 or image.shape[-1] not in (1, 3, 4):
        desc = f"{image.dtype} array of shape {image.shape}" if isinstance(image, np.ndarray) else type(image).__name__
        raise InputError(f"expected a PIL image or a [H, W, C] uint8 array with C in (1, 3, 4), got {desc}")
    if image.shape[-1] == 1:
        image = np.repeat(image, 3, axis=-1)
    elif image.shape[-1] == 4:
        alpha = image[..., 3:4] / 255  # float64, as in transformers
        image = np.round(alpha * image[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(image), mode="RGB")


def expand2square(image: Image.Image, fill: tuple[int, int, int]) -> Image.Image:
    """Pad to a square of the longer side with colour `fill`, the image centred (an odd pixel of padding
    goes below / right), as LLaVA's mm_utils.expand2square."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    out = Image.new(image.mode, (side, side), fill)
    out.paste(image, ((side - width) // 2, (side - height) // 2))
    return out


def _resize(image: Image.Image, shortest_edge: int, resample: int) -> Image.Image:
    w, h = image.size
    short, long = min(w, h), max(w, h)
    new_long = int(shortest_edge * long / short)  # truncation, as torchvision / transformers
    size = (shortest_edge, new_long) if w <= h else (new_long, shortest_edge)  # PIL (width, height)
    return image.resize(size, resample=resample)


def _center_crop(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, C] -> [height, width, C]; a side shorter than the crop is centred in zeros."""
    for axis, size in ((0, height), (1, width)):
        n = x.shape[axis]
        if n >= size:
            start = (n - size) // 2
            x = x[start : start + size] if axis == 0 else x[:, start : start + size]
        else:
            pad = [(0, 0)] * 3
            before = -(-(size - n) // 2)  # ceil
            pad[axis] = (before, size - n - before)
            x = np.pad(x, pad)
    return x


def preprocess_images(
    images: Sequence[Image.Image | np.ndarray] | Image.Image | np.ndarray,
    config: CLIPImageProcessorConfig = CLIPImageProcessorConfig(),
) -> np.ndarray:
    """PIL images or [H, W, C] uint8 arrays -> pixel_values [N, 3, H, W] float32, as HF's CLIP processor."""
    if isinstance(images, (Image.Image, np.ndarray)):
        images = [images]
    if not images:
        raise ValueError("preprocess_images needs at least one image")
    out = []
    for image in images:
        pil = _to_rgb(image)
        if config.image_aspect_ratio == "pad":  # fill: the mean colour, as LLaVA's process_images
            pil = expand2square(pil, tuple(int(m * 255) for m in config.image_mean))
        if config.do_resize:
            pil = _resize(pil, config.shortest_edge, config.resample)
        x = np.asarray(pil)  # [H, W, 3] uint8
        if config.do_center_crop:
            x = _center_crop(x, config.crop_height, config.crop_width)
        if config.do_rescale:  # in float64, then float32, as transformers does
            x = (x.astype(np.float64) * config.rescale_factor).astype(np.float32)
        else:
            x = x.astype(np.float32)
        if config.do_normalize:
            x = (x - np.asarray(config.image_mean, np.float32)) / np.asarray(config.image_std, np.float32)
        out.append(x.transpose(2, 0, 1))  # [3, H, W]
    if len({x.shape for x in out}) > 1:
        shapes = sorted({x.shape for x in out})
        raise ValueError(f"images differ in size after preprocessing ({shapes}); enable resize and center crop")
    return np.stack(out)
