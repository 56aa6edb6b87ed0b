"""Original-layout LLaVA-1.5 (liuhaotian `llava-v1.5-7b`: flat config with mm_* keys, `model.mm_projector.{0,2}`,
`model.vision_tower.vision_tower.vision_model.*`, -200 placeholders, pad-to-square) against the same weights
in llava-hf layout."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file, save_file

import lookm_jax
from conftest import IMAGE_TOKEN, image_ids, tiny_llava
from lookm_jax import get_method
from lookm_jax.convert.hf import parse_config
from lookm_jax.convert.original_llava import image_processor
from lookm_jax.models.config import ConfigError, LlavaConfig
from lookm_jax.models.image_processing import CLIP_MEAN, CLIPImageProcessorConfig, preprocess_images
from original_layout import IMAGE_TOKEN_INDEX

# llava-hf (hub) tensor names -> the original LLaVA repo's names for the same tensors.
TO_ORIGINAL = [(r"^language_model\.model\.", "model."), (r"^language_model\.lm_head\.", "lm_head."),
               (r"^vision_tower\.", "model.vision_tower.vision_tower.vision_model."),
               (r"^multi_modal_projector\.linear_1\.", "model.mm_projector.0."),
               (r"^multi_modal_projector\.linear_2\.", "model.mm_projector.2.")]
WORDS = ["[UNK]"] + [f"w{i}" for i in range(1, IMAGE_TOKEN)]  # ids 0..249; "<image>" is 250 in the hf folder


def _original_name(name: str) -> str:
    for pattern, repl in TO_ORIGINAL:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    raise AssertionError(f"unexpected llava-hf tensor {name}")


def _tokenizer(with_image_token: bool):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if with_image_token:
        tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    return tok


def _original_config(hf_config: dict, tower_dir) -> dict:
    """liuhaotian/llava-v1.5-7b's config.json shape: the Llama fields flat, plus LLaVA's mm_* and training keys."""
    text = {k: v for k, v in hf_config["text_config"].items() if k != "model_type"}
    return {**text, "model_type": "llava", "architectures": ["LlavaLlamaForCausalLM"], "torch_dtype": "float16",
            "mm_vision_tower": str(tower_dir), "mm_hidden_size": 32, "mm_projector_type": "mlp2x_gelu",
            "mm_vision_select_layer": -2, "mm_vision_select_feature": "patch", "mm_patch_merge_type": "flat",
            "image_aspect_ratio": "pad", "mm_use_im_start_end": False, "mm_use_im_patch_token": False,
            "mm_projector_lr": None, "freeze_mm_mlp_adapter": False, "tune_mm_mlp_adapter": False,
            "unfreeze_mm_vision_tower": False, "use_mm_proj": True, "tokenizer_model_max_length": 2048,
            "tokenizer_padding_side": "right", "max_length": 4096, "image_grid_pinpoints": None}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(llava-hf model, original-layout model) of the same tiny random weights, each with a tokenizer."""
    root = tmp_path_factory.mktemp("llava_layouts")
    hf = tiny_llava(root / "hf", kv_heads=2)
    _tokenizer(True).save(str(root / "hf" / "tokenizer.json"))
    hf.config.vision_config.save_pretrained(str(root / "clip_tower"))
    (root / "original").mkdir()
    tensors = load_file(str(root / "hf" / "model.safetensors"))
    save_file({_original_name(k): v for k, v in tensors.items()}, str(root / "original" / "model.safetensors"))
    with open(root / "hf" / "config.json") as f:
        config = _original_config(json.load(f), root / "clip_tower")
    with open(root / "original" / "config.json", "w") as f:
        json.dump(config, f)
    _tokenizer(False).save(str(root / "original" / "tokenizer.json"))
    return lookm_jax.load(str(root / "hf")), lookm_jax.load(str(root / "original"))


def test_both_layouts_give_identical_logits(pair):
    hf_model, original = pair
    assert isinstance(original.config, LlavaConfig)
    assert original.config.image_token_id == IMAGE_TOKEN_INDEX
    assert original.config.text == hf_model.config.text and original.config.vision == hf_model.config.vision
    ids = image_ids(25, [3, 17, "img", 9, "img", 40, 41])[None]
    pixels = np.random.default_rng(0).standard_normal((2, 3, 30, 30)).astype(np.float32)
    expected = hf_model.logits(ids, pixels)
    np.testing.assert_array_equal(original.logits(np.where(ids == IMAGE_TOKEN, IMAGE_TOKEN_INDEX, ids), pixels),
                                  expected)


def test_encode_chat_splits_at_image_markers_and_lookm_generates(pair):
    """Without an <image> token, the text is split at the markers (LLaVA's tokenizer_image_token): the same
    stream as the llava-hf tokenizer's, with -200 placeholders; lookm at budget 0.5 runs on it."""
    hf_model, original = pair
    prompt = "w5 w6 <image> w7 w8 w9 w10"
    ids = original.encode_chat(prompt, num_images=2)  # one before the text, one at the marker
    expected = hf_model.encode_chat(prompt, num_images=2)
    np.testing.assert_array_equal(ids, np.where(expected == IMAGE_TOKEN, IMAGE_TOKEN_INDEX, expected))
    assert (ids == IMAGE_TOKEN_INDEX).sum() == 50 and ids.shape == (1, 56)
    pixels = np.random.default_rng(1).standard_normal((2, 3, 30, 30)).astype(np.float32)
    result = original.run(ids, pixels, max_new_tokens=3, method=get_method("lookm", budget=0.5))
    # L = 56: 14 recent (the 4 trailing text tokens, then image) + 14 important (the 2 other text tokens first).
    assert int(result.image_tokens[0]) == 50
    assert (result.kept_text_tokens[0], result.kept_image_tokens[0]) == (6.0, 22.0)


def test_released_config_names_the_clip_tower():
    """liuhaotian/llava-v1.5-7b names openai/clip-vit-large-patch14-336: 576 tokens, pad with the CLIP mean."""
    config = {"model_type": "llava", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000, "rms_norm_eps": 1e-5,
              "rope_scaling": None, "mm_vision_tower": "openai/clip-vit-large-patch14-336", "mm_hidden_size": 1024,
              "mm_projector_type": "mlp2x_gelu", "mm_vision_select_layer": -2, "image_aspect_ratio": "pad"}
    cfg = parse_config(config)
    v = cfg.vision
    assert (v.hidden_size, v.num_layers, v.num_heads, v.image_size, v.patch_size) == (1024, 24, 16, 336, 14)
    assert (cfg.image_seq_length, cfg.feature_layers, cfg.vision_feature_select_strategy) == (576, (-2,), "default")
    processor = CLIPImageProcessorConfig.from_hf_dict(image_processor(cfg, config, None))
    assert processor == CLIPImageProcessorConfig(image_aspect_ratio="pad")
    assert tuple(int(m * 255) for m in CLIP_MEAN) == (122, 116, 104)


@pytest.mark.parametrize("size", [(70, 40), (40, 70), (50, 50)])
def test_pad_to_square_matches_llava_process_images(size):
    """LLaVA's process_images for image_aspect_ratio 'pad': expand2square with the mean colour, then HF's CLIP
    processor (reference written here with PIL calls, not our helper)."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    image = Image.fromarray(np.random.default_rng(2).integers(0, 256, (size[1], size[0], 3), np.uint8))
    side = max(size)
    square = Image.new("RGB", (side, side), (122, 116, 104))
    square.paste(image, ((side - size[0]) // 2, (side - size[1]) // 2))
    llava_15 = CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    expected = llava_15(square, return_tensors="np")["pixel_values"]
    ours = preprocess_images(image, CLIPImageProcessorConfig(image_aspect_ratio="pad"))
    np.testing.assert_array_equal(ours, expected)


def _flat_config(**overrides) -> dict:
    config = {"model_type": "llava", "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": 251, "mm_vision_tower": "openai/clip-vit-large-patch14-336",
              "mm_projector_type": "mlp2x_gelu"}
    return {**config, **overrides}


@pytest.mark.parametrize("field,value", [("mm_projector_type", "linear"), ("mm_projector_type", "mlp3x_gelu"),
                                         ("mm_use_im_start_end", True), ("mm_patch_merge_type", "spatial_unpad"),
                                         ("image_aspect_ratio", "anyres"), ("mm_vision_select_feature", "cls"),
                                         ("mm_vision_select_layer", -30), ("mm_hidden_size", 768),
                                         ("mm_vision_tower", "google/siglip-so400m-patch14-384"),
                                         ("s2_scales", "336,672")])
def test_unsupported_fields_are_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=field):
        parse_config(_flat_config(**{field: value}))


def test_llava_config_of_neither_layout_is_refused():
    with pytest.raises(ConfigError, match="text_config.*mm_vision_tower"):
        parse_config({"model_type": "llava", "hidden_size": 48})
