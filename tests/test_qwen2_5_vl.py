"""Qwen2.5-VL against transformers' Qwen2_5_VLForConditionalGeneration (tiny, random).

The prompts, pictures, tokenizer and image processor are test_qwen2_vl's (Qwen2.5-VL preprocesses
as Qwen2-VL does): 4 px patches merged 2 x 2, three pictures of grids 8 x 12, 10 x 6 and 4 x 16
patches in a batch of two ragged rows. The decoder has 6 query and 2 KV heads (GQA, 3 per group);
the tower 3 blocks of 3 heads, window_size 16 px: windows of 2 x 2 merged tokens, so each picture
has several (6, 6 of them cut short, and 4), and block 1 alone attends to the whole image.
"""

from __future__ import annotations

import dataclasses
import json

import chex
import jax
import numpy as np
import pytest
import torch

import lookm_jax
from lookm_jax.models.config import ConfigError
from lookm_jax.models.qwen2_5_vl import Qwen2_5_VLConfig, image_features, window_layout
from lookm_jax.models.qwen2_vl import Pixels
from tests import test_qwen2_vl as qwen2_vl_tests
from tests.conftest import published_config, with_field
from tests.test_qwen2_vl import (END, IMAGE_TOKEN, SIZES, START, VOCAB, _images, hf_image_processor, make_batch,
                                 tiny_tokenizer)

FULL_BLOCKS = [1]


def tiny_qwen2_5_vl(folder, seed=0):
    """Build, save (with a tokenizer and a preprocessor config) and return a tiny random
    Qwen2_5_VLForConditionalGeneration."""
    from transformers import Qwen2_5_VLConfig as HFConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=112, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "mrope_section": [4, 2, 2]})
    vision = dict(depth=3, hidden_size=36, intermediate_size=40, num_heads=3, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=16, fullatt_block_indexes=FULL_BLOCKS, out_hidden_size=96)
    config = HFConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                      vision_start_token_id=START, vision_end_token_id=END, video_token_id=10)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # default init leaves unit norms, zero biases and a 0.02-wide head: widen them
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight") or "ln_q.weight" in name:
                p.uniform_(0.5, 1.5)
            elif "embed_tokens" in name or "lm_head" in name:
                p.normal_(0, 1.0)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "visual" in name and name.endswith("weight"):
                p.normal_(0, 0.15)
        model.lm_head.weight[START:] = 0  # never generates an image placeholder (HF would splice features there)
    model.save_pretrained(str(folder))
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    hf_image_processor().save_pretrained(str(folder))
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    return tiny_qwen2_5_vl(folder), lookm_jax.load(str(folder))


@pytest.fixture(scope="module")
def batch():
    return make_batch()


# Qwen2-VL's tests of everything downstream of the tower, collected here with this module's `tiny` and
# `batch` (Qwen2.5-VL's model, the same prompts): logits to FP32_TOL of HF's; a decode step's logits at
# the next M-RoPE position; greedy tokens equal to HF's generate per row; a StreamingLLM cache's decode
# equal to HF attending to the same kept slots at explicit positions; every method from one shared
# prefill, with every image token marked; prefill and decode exported for cuda and tpu.
test_logits_match_hf = qwen2_vl_tests.test_logits_match_hf
test_decode_step_logits_match_hf_at_the_next_mrope_position = (
    qwen2_vl_tests.test_decode_step_logits_match_hf_at_the_next_mrope_position)
test_greedy_generation_matches_hf = qwen2_vl_tests.test_greedy_generation_matches_hf
test_compressed_decode_equals_hf_attending_to_the_kept_slots = (
    qwen2_vl_tests.test_compressed_decode_equals_hf_attending_to_the_kept_slots)
test_every_method_runs_on_ragged_rows_with_every_image_token_marked = (
    qwen2_vl_tests.test_every_method_runs_on_ragged_rows_with_every_image_token_marked)
test_prefill_and_decode_export_for_gpu_and_tpu = qwen2_vl_tests.test_prefill_and_decode_export_for_gpu_and_tpu


# ---- the tower: windows, features -------------------------------------------------------------------

def test_windows_equal_hf_window_index(tiny, batch):
    """Our window of each patch against HF's `get_vision_window_index`: each window HF makes contiguous
    is exactly one of ours (one image, one window number), and no two share one; several per image."""
    from transformers.vision_utils import get_vision_window_index

    model = tiny[1]
    _, _, patches, grid = batch
    v = model.config.vision
    image, _, _, window = jax.jit(window_layout, static_argnums=(0, 2))(v, grid.astype(np.int32), patches.shape[0])
    order, bounds = get_vision_window_index(torch.as_tensor(grid), v.spatial_merge_size, v.window_size, v.patch_size)
    units = v.spatial_merge_size**2
    patch_order = (order.numpy()[:, None] * units + np.arange(units)).reshape(-1)  # HF's patch sequence
    ours = np.stack([np.asarray(image), np.asarray(window)], 1)[patch_order]  # [P, 2] in HF's order
    bounds = bounds.numpy()
    seen = set()
    for start, stop in zip(bounds[:-1], bounds[1:]):
        members = {tuple(m) for m in ours[start:stop].tolist()}
        assert len(members) == 1 and not members & seen
        seen |= members
    assert len(seen) == len(bounds) - 1 == 6 + 6 + 4
    assert np.diff(bounds).min() == units < np.diff(bounds).max()  # windows cut short at the edges


def test_image_features_match_hf(tiny, batch):
    hf, model = tiny
    _, _, patches, grid = batch
    pixels = Pixels(patches, grid.astype(np.int32))
    features = jax.jit(image_features, static_argnums=0)
    ours = features(model.config, model.params, pixels)
    with torch.no_grad():
        ref = torch.cat(hf.model.get_image_features(torch.as_tensor(patches), torch.as_tensor(grid)).pooler_output)
    ref = ref.numpy()
    chex.assert_shape(ours, (patches.shape[0] // 4, 96))
    np.testing.assert_allclose(ours, ref, atol=5e-6 * np.abs(ref).max(), rtol=0)
    # The windows matter: attending to the whole image in every block moves the features far more.
    whole = dataclasses.replace(model.config, vision=dataclasses.replace(model.config.vision,
                                                                         fullatt_block_indexes=(0, 1, 2)))
    assert np.abs(features(whole, model.params, pixels) - ref).max() > 1000 * 5e-6 * np.abs(ref).max()


# ---- preprocessing and prompt expansion against Qwen2_5_VLProcessor ---------------------------------

def _hf_processor():
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor

    class ImagesOnly(Qwen2_5_VLProcessor):  # the video processor needs torchvision, which is not installed
        def check_argument_for_proper_class(self, name, arg):
            return None if name == "video_processor" else super().check_argument_for_proper_class(name, arg)

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer())
    return ImagesOnly(image_processor=hf_image_processor(), tokenizer=tokenizer)


def test_preprocess_images_and_encode_chat_equal_hf_processor(tiny):
    images = _images(SIZES, seed=1)
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    want = _hf_processor()(images=images, text=f"{image}\n{image}\n{image}\nwhat is this", return_tensors="np")
    pixels, grids = tiny[1].preprocess_images(images)
    ids = tiny[1].encode_chat("what is this", num_images=3, image_tiles=grids)
    assert isinstance(pixels, Pixels) and grids == [tuple(g) for g in want["image_grid_thw"].tolist()]
    assert len(set(grids)) == 3
    np.testing.assert_array_equal(ids, want["input_ids"])
    np.testing.assert_array_equal(pixels.patches, want["pixel_values"])  # bit-equal
    np.testing.assert_array_equal(pixels.grid, want["image_grid_thw"])
    np.testing.assert_array_equal(ids == IMAGE_TOKEN, want["mm_token_type_ids"] == 1)


# ---- config handling, conversion ---------------------------------------------------------------------

# Qwen2.5-VL-7B's config.json as published (one copy, in bench/sizes.py, for the size table and these tests).
HUB_7B = published_config("Qwen2.5-VL-7B")
FLAT_7B = {k: v for k, v in HUB_7B.items() if k != "text_config"}  # the hub's first file: no text_config


@pytest.mark.parametrize("hub", [HUB_7B, FLAT_7B], ids=["resaved", "flat"])
def test_hub_config_parses_as_hf_reads_it(hub):
    from transformers import Qwen2_5_VLConfig as HFConfig

    cfg = Qwen2_5_VLConfig.from_hf(hub)
    hf = HFConfig(**{k: v for k, v in hub.items() if k not in ("model_type", "transformers_version")})
    text, vision = hf.text_config, hf.vision_config
    assert (cfg.text.hidden_size, cfg.text.num_layers, cfg.text.num_heads, cfg.text.num_kv_heads, cfg.text.vocab_size,
            cfg.text.intermediate_size) == (text.hidden_size, text.num_hidden_layers, text.num_attention_heads,
                                            text.num_key_value_heads, text.vocab_size, text.intermediate_size)
    assert cfg.text.rope.theta == text.rope_parameters["rope_theta"] == 1e6 and cfg.text.rope.mrope_section == (16, 24, 24)
    assert cfg.text.qkv_bias and not cfg.text.tie_word_embeddings and cfg.text.head_dim == 128
    assert (cfg.vision.depth, cfg.vision.hidden_size, cfg.vision.intermediate_size, cfg.vision.num_heads,
            cfg.vision.out_hidden_size, cfg.vision.window_size, list(cfg.vision.fullatt_block_indexes)) == (
        vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads, vision.out_hidden_size,
        vision.window_size, list(vision.fullatt_block_indexes))
    assert cfg.vision.window_tokens == 4 and (cfg.image_token_id, cfg.vision_start_token_id) == (
        hf.image_token_id, hf.vision_start_token_id)


REFUSED = [
    ("mystery_field", 1, "mystery_field"),
    ("text_config.mystery_field", 1, "mystery_field"),
    ("text_config.use_sliding_window", True, "use_sliding_window"),
    ("text_config.rope_scaling", {"type": "mrope", "mrope_section": [16, 24, 20]}, "mrope_section"),
    ("text_config.model_type", "qwen2_vl_text", "model_type"),
    ("vision_config.hidden_act", "gelu", "hidden_act"),
    ("vision_config.mlp_ratio", 4, "mlp_ratio"),  # Qwen2-VL's tower
    ("vision_config.window_size", 27, "window_size"),  # less than one merge window (28 px)
    ("vision_config.fullatt_block_indexes", [7, 32], "fullatt_block_indexes"),
    ("vision_config.in_chans", 1, "in_chans"),
    ("vision_config.num_heads", 12, "num_heads"),
    ("vision_config.out_hidden_size", 4096, "out_hidden_size"),
    ("vision_config.model_type", "qwen2_vl", "model_type"),
    ("image_token_id", 10**6, "image_token_id"),
]


@pytest.mark.parametrize("path,value,named", REFUSED, ids=[r[0] + "=" + str(r[1]) for r in REFUSED])
def test_unsupported_config_refused_naming_the_field(path, value, named):
    with pytest.raises(ConfigError, match=named):
        Qwen2_5_VLConfig.from_hf(with_field(HUB_7B, path, value))


def test_hub_key_layout_and_converted_round_trip_give_the_same_params(tiny, tmp_path):
    """Hub names (visual.*, model.layers.*: what save_pretrained writes) and transformers 5's module
    names (model.visual.*, model.language_model.*) convert alike; `lookm convert` + `load` keeps
    config, preprocessor settings and params; a missing tower tensor is refused by name."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from lookm_jax.cli import main
    from lookm_jax.convert.tables import CheckpointError

    model = tiny[1]
    assert isinstance(model.config, Qwen2_5_VLConfig) and model.config.vision.fullatt_block_indexes == (1,)
    source = model.manifest["source"]
    tensors = load_file(f"{source}/model.safetensors")
    assert all(k.startswith(("visual.", "model.layers.", "model.embed_tokens.", "model.norm.", "lm_head."))
               for k in tensors)
    renamed = {("model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1)
                if k.startswith("model.") else k): v for k, v in tensors.items()}
    broken = {k: v for k, v in tensors.items() if "mlp.up_proj.bias" not in k}
    for name, kept in (("v5", renamed), ("broken", broken)):
        (tmp_path / name).mkdir()
        for file in ("config.json", "tokenizer.json", "preprocessor_config.json"):
            shutil.copy(f"{source}/{file}", tmp_path / name)
        save_file(kept, str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
    chex.assert_trees_all_equal(lookm_jax.load(str(tmp_path / "v5")).params, model.params)
    with pytest.raises(CheckpointError, match="mlp.up_proj.bias"):
        lookm_jax.load(str(tmp_path / "broken"))

    assert main(["convert", str(tmp_path / "v5"), str(tmp_path / "converted")]) == 0
    again = lookm_jax.load(str(tmp_path / "converted"))
    assert again.config == model.config and again.manifest["image_processor"] == model.manifest["image_processor"]
    chex.assert_trees_all_equal(again.params, model.params)
    assert json.loads((tmp_path / "v5" / "config.json").read_text())["model_type"] == "qwen2_5_vl"
