"""Qwen2-VL against transformers' Qwen2VLForConditionalGeneration (tiny, random).

Patches are 4 px, merged 2 x 2: an image resized to H x W pixels (multiples of 8) has H/4 x W/4
patches and H*W / 64 tokens. The decoder has 6 query and 2 KV heads (GQA, 3 per group) of width 16
(M-RoPE sections 4 + 2 + 2); the tower 3 heads of width 12.
"""

from __future__ import annotations

import json

import chex
import jax
import numpy as np
import pytest
import torch
from PIL import Image

import lookm_jax
from lookm_jax.errors import InputError
from lookm_jax.models.config import ConfigError
from lookm_jax.models.qwen2_vl import Pixels, Qwen2VLConfig, mrope_positions
from lookm_jax.models.qwen2_vl_processing import Qwen2VLImageProcessorConfig, preprocess_patches

FP32_TOL = 1e-5  # max abs logit difference, relative to the logits' scale
WORDS = ["what", "is", "this", "a", "cat", "dog", "[UNK]"]
SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
START, END, IMAGE_TOKEN = 7, 8, 9
VOCAB = 96
NEW_TOKENS = 6
PROCESSOR = dict(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8 * 4, max_pixels=48 * 48)
# (height, width) of the test pictures: each a different grid after smart_resize.
SIZES = [(30, 45), (40, 24), (17, 60)]


def tiny_tokenizer():
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    assert [tok.token_to_id(s) for s in SPECIALS[:3]] == [START, END, IMAGE_TOKEN]
    return tok


def tiny_qwen2_vl(folder, seed=0):
    """Build, save (with a tokenizer and a preprocessor config) and return a tiny random
    Qwen2VLForConditionalGeneration."""
    from transformers import Qwen2VLConfig as HFConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=112, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "mrope_section": [4, 2, 2]})
    vision = dict(depth=2, embed_dim=36, hidden_size=96, mlp_ratio=2, num_heads=3, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = HFConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                      vision_start_token_id=START, vision_end_token_id=END, video_token_id=10)
    model = Qwen2VLForConditionalGeneration(config).eval()
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
    model.save_pretrained(str(folder))
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    hf_image_processor().save_pretrained(str(folder))
    return model


def hf_image_processor():
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**PROCESSOR)


def _images(sizes=SIZES, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_qwen2_vl")
    return tiny_qwen2_vl(folder), lookm_jax.load(str(folder))


@pytest.fixture(scope="module")
def batch():
    """Two right-padded rows: [text, image 0, text, image 1, text] and [text, image 2, text, text...]:
    ragged, three images of different sizes. -> (ids [2, L], mask [2, L], patches, grid [3, 3])."""
    patches, grid = preprocess_patches(_images(), Qwen2VLImageProcessorConfig(**PROCESSOR))
    tokens = [int(t * h * w) // 4 for t, h, w in grid]
    assert len(set(tokens)) == 3

    def image(n):
        return [START] + [IMAGE_TOKEN] * tokens[n] + [END]

    rows = [[0, 1] + image(0) + [2, 3] + image(1) + [4, 5, 2],
            [3] + image(2) + [0, 1, 2, 3, 4, 5, 0, 1]]
    length = max(map(len, rows))
    ids = np.asarray([r + [0] * (length - len(r)) for r in rows], np.int32)
    mask = np.asarray([[1] * len(r) + [0] * (length - len(r)) for r in rows], np.int32)
    assert mask[0].sum() != mask[1].sum()
    return ids, mask, patches, grid


def _hf_inputs(ids, mask, patches, grid):
    return dict(input_ids=torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask),
                pixel_values=torch.as_tensor(patches), image_grid_thw=torch.as_tensor(grid),
                mm_token_type_ids=torch.as_tensor((ids == IMAGE_TOKEN).astype(np.int32)))


def test_mrope_positions_equal_hf_get_rope_index(tiny, batch):
    hf, model = tiny
    ids, mask, patches, grid = batch
    inputs = _hf_inputs(ids, mask, patches, grid)
    want, deltas = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                           image_grid_thw=inputs["image_grid_thw"], attention_mask=inputs["attention_mask"])
    pixels = Pixels(patches, grid.astype(np.int32))
    positions, next_position = jax.jit(mrope_positions, static_argnums=0)(model.config, ids, mask.astype(bool), pixels)
    valid = mask.astype(bool)
    np.testing.assert_array_equal(np.asarray(positions)[:, valid], want.numpy()[:, valid])
    np.testing.assert_array_equal(next_position, mask.sum(1) + deltas.numpy()[:, 0])  # max position + 1 = L + delta
    assert (np.asarray(next_position) < mask.sum(1)).all()  # images take fewer positions than tokens


def test_logits_match_hf(tiny, batch):
    hf, model = tiny
    ids, mask, patches, grid = batch
    with torch.no_grad():
        ref = hf(**_hf_inputs(ids, mask, patches, grid)).logits.numpy()
    ours = model.logits(ids, Pixels(patches, grid), attention_mask=mask)
    assert ours.shape == ref.shape and ours.dtype == np.float32
    valid = mask.astype(bool)
    scale = np.abs(ref[valid]).max()
    np.testing.assert_allclose(ours[valid], ref[valid], atol=FP32_TOL * scale, rtol=0)
    # The pictures matter: other pixels move the logits by far more than the tolerance.
    other = Pixels(np.random.default_rng(5).standard_normal(patches.shape).astype(np.float32), grid)
    assert np.abs(model.logits(ids, other, attention_mask=mask)[valid] - ours[valid]).max() > 1000 * FP32_TOL * scale


def test_image_features_match_hf(tiny, batch):
    from lookm_jax.models.qwen2_vl import image_features

    hf, model = tiny
    _, _, patches, grid = batch
    feats = jax.jit(image_features, static_argnums=0)(model.config, model.params, Pixels(patches, grid.astype(np.int32)))
    with torch.no_grad():
        ref = hf.model.get_image_features(torch.as_tensor(patches), torch.as_tensor(grid)).pooler_output
    ref = torch.cat(ref).numpy()
    chex.assert_shape(feats, (patches.shape[0] // 4, 96))
    np.testing.assert_allclose(feats, ref, atol=5e-6 * np.abs(ref).max(), rtol=0)
