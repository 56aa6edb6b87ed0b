"""preprocess_images vs transformers' CLIP image processor (the PIL backend: no torchvision here)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
from PIL import Image
from transformers import AutoImageProcessor, CLIPImageProcessor
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from lookm_jax.models.image_processing import CLIPImageProcessorConfig, preprocess_images

LLAVA_15 = {  # llava-hf/llava-1.5-7b-hf preprocessor_config.json
    "crop_size": {"height": 336, "width": 336},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "CLIPImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "processor_class": "LlavaProcessor",
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"shortest_edge": 336},
}
SMALL = {**LLAVA_15, "size": {"shortest_edge": 30}, "crop_size": {"height": 28, "width": 28}}
CONFIGS = {
    "llava15": LLAVA_15,
    "small": SMALL,
    "crop_larger_than_resize": {**SMALL, "size": {"shortest_edge": 20}, "crop_size": {"height": 24, "width": 18}},
    "bilinear_legacy_ints": {**SMALL, "resample": 2, "size": 30, "crop_size": 28},
    "no_crop_no_rescale": {**SMALL, "do_center_crop": False, "do_rescale": False},
}


def _images():
    rng = np.random.default_rng(0)

    def noise(h, w, c):
        # smooth gradient + noise, so resampling filters see structure
        y, x = np.mgrid[0:h, 0:w]
        base = (x * 255 // max(w - 1, 1) + y * 128 // max(h - 1, 1))[..., None] % 256
        return ((base + rng.integers(0, 64, (h, w, c))) % 256).astype(np.uint8)

    palette = Image.fromarray(noise(45, 61, 3)).convert("P")
    palette.info["transparency"] = 0
    return {
        "odd_rgb": Image.fromarray(noise(333, 517, 3)),
        "portrait": Image.fromarray(noise(401, 257, 3)),
        "landscape": Image.fromarray(noise(120, 640, 3)),
        "small_square": Image.fromarray(noise(17, 17, 3)),
        "rgba": Image.fromarray(noise(203, 151, 4), mode="RGBA"),
        "grayscale": Image.fromarray(noise(99, 131, 1)[..., 0], mode="L"),
        "gray_alpha": Image.fromarray(noise(64, 80, 2), mode="LA"),
        "palette_transparency": palette,
        "array_rgb": noise(77, 133, 3),
        "array_rgba": noise(150, 90, 4),
        "array_gray": noise(61, 47, 1),
    }


IMAGES = _images()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request):
    d = CONFIGS[request.param]
    return CLIPImageProcessorConfig.from_hf_dict(d), CLIPImageProcessorPil(**d)


def test_default_user_class_is_the_pil_backend():
    # What a user gets from transformers 5.24 without torchvision, both ways.
    assert type(CLIPImageProcessor()) is CLIPImageProcessorPil
    assert CLIPImageProcessorConfig.from_hf_dict(LLAVA_15) == CLIPImageProcessorConfig()


def test_auto_image_processor_from_folder(tmp_path):
    import json

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(LLAVA_15))
    hf = AutoImageProcessor.from_pretrained(tmp_path)
    images = [IMAGES["odd_rgb"], IMAGES["rgba"]]
    expected = hf(images, return_tensors="np")["pixel_values"]
    np.testing.assert_array_equal(preprocess_images(images, CLIPImageProcessorConfig()), expected)


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_equals_hf_per_image(case, name):
    ours_cfg, hf = case
    image = IMAGES[name]
    kwargs = {"input_data_format": "channels_last"} if isinstance(image, np.ndarray) else {}
    expected = hf(image, return_tensors="np", **kwargs)["pixel_values"]
    got = preprocess_images([image], ours_cfg)
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(got, expected)  # in fact bit-exact: same ops in the same order


def test_batch_shape_and_single_image():
    batch = preprocess_images([IMAGES["portrait"], IMAGES["array_gray"], IMAGES["landscape"]])
    assert batch.shape == (3, 3, 336, 336) and batch.dtype == np.float32
    np.testing.assert_array_equal(preprocess_images(IMAGES["portrait"]), batch[:1])


@pytest.mark.parametrize(
    "d, match",
    [
        ({**LLAVA_15, "size": {"height": 336, "width": 336}}, "size"),
        ({**LLAVA_15, "crop_size": {"height": 336}}, "crop_size"),
        ({**LLAVA_15, "do_convert_rgb": False}, "do_convert_rgb"),
        ({**LLAVA_15, "image_processor_type": "SiglipImageProcessor"}, "image_processor_type"),
        ({**LLAVA_15, "do_pad": True}, "do_pad"),
        ({**LLAVA_15, "resample": 99}, "resample"),
        ({**LLAVA_15, "image_mean": [0.5, 0.5]}, "image_mean"),
        ({**LLAVA_15, "image_grid_pinpoints": [[336, 672]]}, "image_grid_pinpoints"),
    ],
)
def test_refuses_unsupported_config(d, match):
    with pytest.raises(ValueError, match=match):
        CLIPImageProcessorConfig.from_hf_dict(d)


@pytest.mark.parametrize(
    "bad", [np.zeros((8, 8), np.uint8), np.zeros((8, 8, 3), np.float32), np.zeros((8, 8, 2), np.uint8), "x.png"]
)
def test_refuses_bad_images(bad):
    with pytest.raises(ValueError, match="uint8"):
        preprocess_images([bad])
