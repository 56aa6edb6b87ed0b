"""Our JAX LLaVA against HF transformers' PyTorch LlavaForConditionalGeneration (tiny, random)."""

from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp
import torch

import lookm_jax
from conftest import image_ids, tiny_llava

FP32_TOL = 1e-4  # max abs logit difference; reached: ~1e-6
BF16_REL_TOL = 2e-2  # max abs difference / max abs logit


def hf_logits(model, ids, pixels, mask=None):
    kwargs = {} if pixels is None else {"pixel_values": torch.as_tensor(pixels)}
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids, dtype=torch.long),
                    attention_mask=None if mask is None else torch.as_tensor(mask), **kwargs)
    return out.logits.float().numpy()


CASES = {
    "mha_layer-2_default_1img": dict(heads=4, kv_heads=4, feature_layer=-2, strategy="default", images=1),
    "gqa_layer-1_full_3img": dict(heads=4, kv_heads=2, feature_layer=-1, strategy="full", images=3),
    "gqa1_layer0_default_3img": dict(heads=4, kv_heads=1, feature_layer=1, strategy="default", images=3),
    "layer_list_full_1img_tied": dict(heads=4, kv_heads=2, feature_layer=[-3, -1], strategy="full", images=1,
                                      tie=True),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf(case, tmp_path, rng):
    spec = dict(CASES[case])
    n_images = spec.pop("images")
    hf = tiny_llava(tmp_path, **spec)
    model = lookm_jax.load(str(tmp_path))
    per_image = model.config.image_seq_length
    segments = [3, 17]
    for _ in range(n_images):
        segments += ["img", 9]
    ids = image_ids(per_image, segments + [40, 41, 42])[None]
    pixels = rng.standard_normal((n_images, 3, 30, 30)).astype(np.float32)
    ours = model.logits(ids, pixels)
    ref = hf_logits(hf, ids, pixels)
    assert ours.shape == ref.shape and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, atol=FP32_TOL, rtol=0)


def test_batch_of_two_different_lengths(tmp_path, rng):
    hf = tiny_llava(tmp_path)
    model = lookm_jax.load(str(tmp_path))
    t = model.config.image_seq_length
    long_row = image_ids(t, [5, "img", 6, 7, 8, 9, 10])
    short_row = image_ids(t, [11, "img", 12])
    ids = np.zeros((2, len(long_row)), np.int32)
    mask = np.zeros_like(ids)
    ids[0], mask[0] = long_row, 1
    ids[1, : len(short_row)], mask[1, : len(short_row)] = short_row, 1  # right padding
    pixels = rng.standard_normal((2, 3, 30, 30)).astype(np.float32)
    ours = model.logits(ids, pixels, attention_mask=mask)
    ref = hf_logits(hf, ids, pixels, mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], atol=FP32_TOL, rtol=0)


def test_bf16_logits_close_to_hf(tmp_path, rng):
    hf = tiny_llava(tmp_path, kv_heads=2)
    model = lookm_jax.load(str(tmp_path)).astype(jnp.bfloat16)
    ids = image_ids(model.config.image_seq_length, [4, "img", 8, 15, 16])[None]
    pixels = rng.standard_normal((1, 3, 30, 30)).astype(np.float32)
    ours = model.logits(ids, pixels)
    ref = hf_logits(hf, ids, pixels)  # fp32 reference
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel <= BF16_REL_TOL, rel


def test_greedy_generation_matches_hf(tmp_path, rng):
    hf = tiny_llava(tmp_path, kv_heads=2)
    model = lookm_jax.load(str(tmp_path))
    ids = image_ids(model.config.image_seq_length, [4, "img", 8, 15, "img", 16])[None]
    pixels = rng.standard_normal((2, 3, 30, 30)).astype(np.float32)
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.as_tensor(ids, dtype=torch.long), pixel_values=torch.as_tensor(pixels),
                          max_new_tokens=12, do_sample=False).numpy()[:, ids.shape[1]:]
    np.testing.assert_array_equal(model.generate(ids, pixels, max_new_tokens=12), ref)


def test_text_only_llama_with_llama3_rope_scaling(tmp_path):
    """A plain LlamaForCausalLM folder with Llama-3 RoPE scaling and GQA, past the original context."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=97, max_position_embeddings=512,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 32})
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(str(tmp_path))
    model = lookm_jax.load(str(tmp_path))
    assert model.text_config.rope.factor == 8.0 and not model.is_multimodal
    ids = np.random.default_rng(0).integers(0, 97, (1, 300))
    np.testing.assert_allclose(model.logits(ids), hf_logits(hf, ids, None), atol=FP32_TOL, rtol=0)
