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
from tests.conftest import published_config, with_field, word_tokenizer

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
    tok = word_tokenizer(WORDS, SPECIALS)
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
        model.lm_head.weight[START:] = 0  # never generates an image placeholder (HF would splice features there)
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
    return make_batch()


def make_batch():
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


def test_mrope_positions_of_text_alone_are_plain_positions(tiny):
    ids = np.arange(12, dtype=np.int32).reshape(2, 6) % 7
    valid = np.arange(6)[None] < np.asarray([[6], [4]])
    positions, next_position = jax.jit(mrope_positions, static_argnums=0)(tiny[1].config, ids, valid, None)
    np.testing.assert_array_equal(positions, np.where(valid, np.arange(6), 0)[None].repeat(3, 0))
    np.testing.assert_array_equal(next_position, [6, 4])


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


# ---- preprocessing and prompt expansion against HF's image processor and Qwen2VLProcessor ----------

def test_patches_equal_hf_image_processor():
    hf = hf_image_processor()
    config = Qwen2VLImageProcessorConfig.from_hf_dict(json.loads(hf.to_json_string()))
    assert (config.patch_size, config.min_pixels, config.max_pixels) == (4, PROCESSOR["min_pixels"],
                                                                         PROCESSOR["max_pixels"])
    # below min_pixels, above max_pixels, within, elongated, odd sizes
    sizes = SIZES + [(5, 7), (200, 90), (33, 9), (8, 8), (63, 65)]
    images = _images(sizes, seed=2)
    want = hf(images=images, return_tensors="np")
    patches, grid = preprocess_patches(images, config)
    np.testing.assert_array_equal(grid, want["image_grid_thw"])
    assert len({tuple(g) for g in grid.tolist()}) == len(sizes)
    chex.assert_shape(patches, (int(grid.prod(1).sum()), 3 * 2 * 4 * 4))
    np.testing.assert_array_equal(patches, want["pixel_values"])  # bit-equal


def test_preprocessor_config_refuses_what_it_cannot_do():
    base = {"image_processor_type": "Qwen2VLImageProcessor"}
    for extra, named in (({"do_center_crop": True}, "do_center_crop"), ({"size": {"height": 8}}, "size"),
                         ({"mystery": 1}, "mystery"), ({"min_pixels": 100, "max_pixels": 50}, "min_pixels")):
        with pytest.raises(ValueError, match=named):
            Qwen2VLImageProcessorConfig.from_hf_dict({**base, **extra})
    with pytest.raises(ValueError, match="CLIPImageProcessor"):
        Qwen2VLImageProcessorConfig.from_hf_dict({"image_processor_type": "CLIPImageProcessor"})
    # Qwen2-VL-7B-Instruct's own file (min_pixels / max_pixels keys) reads as written.
    config = Qwen2VLImageProcessorConfig.from_hf_dict({**base, "min_pixels": 3136, "max_pixels": 12845056,
                                                      "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2})
    assert (config.max_pixels, config.factor) == (12845056, 28)


def _hf_processor():
    from transformers import PreTrainedTokenizerFast, Qwen2VLProcessor

    class ImagesOnly(Qwen2VLProcessor):  # the video processor needs torchvision, which is not installed
        def check_argument_for_proper_class(self, name, arg):
            return None if name == "video_processor" else super().check_argument_for_proper_class(name, arg)

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer())
    return ImagesOnly(image_processor=hf_image_processor(), tokenizer=tokenizer)


@pytest.fixture(scope="module")
def chat(tiny):
    """One prompt, two pictures of different sizes, through HF's processor and through ours."""
    images = _images(SIZES[:2], seed=1)
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    want = _hf_processor()(images=images, text=f"{image}\n{image}\nwhat is this", return_tensors="np")
    pixels, grids = tiny[1].preprocess_images(images)
    ids = tiny[1].encode_chat("what is this", num_images=2, image_tiles=grids)
    return want, ids, pixels, grids


def test_preprocess_images_and_encode_chat_equal_hf_processor(chat):
    want, ids, pixels, grids = chat
    assert isinstance(pixels, Pixels) and grids == [tuple(g) for g in want["image_grid_thw"].tolist()]
    np.testing.assert_array_equal(ids, want["input_ids"])
    np.testing.assert_array_equal(pixels.patches, want["pixel_values"])
    np.testing.assert_array_equal(pixels.grid, want["image_grid_thw"])
    assert (ids == IMAGE_TOKEN).sum() == sum(t * h * w // 4 for t, h, w in grids) and (ids == START).sum() == 2


def test_encode_chat_needs_one_grid_per_image(tiny):
    model = tiny[1]
    with pytest.raises(InputError, match="2 <image> marker"):
        model.encode_chat("what", num_images=2, image_tiles=[(1, 4, 4)])
    assert IMAGE_TOKEN not in model.encode_chat("what is this")


def test_pixels_that_do_not_fit_the_prompt_are_refused(tiny, batch):
    model = tiny[1]
    ids, mask, patches, grid = batch
    swapped = grid[[1, 0, 2]]  # same patch count, runs in the wrong order
    with pytest.raises(InputError, match="placeholder runs"):
        model.logits(ids, Pixels(patches, swapped), attention_mask=mask)
    with pytest.raises(InputError, match="grid describes"):
        model.logits(ids, Pixels(patches[:-4], grid), attention_mask=mask)
    with pytest.raises(InputError, match="qwen2_vl.Pixels"):
        model.logits(ids, patches, attention_mask=mask)
    video = grid.copy()
    video[0, 0] = 2
    with pytest.raises(InputError, match="videos"):
        model.logits(ids, Pixels(patches, video), attention_mask=mask)


# ---- generation: full cache against HF's generate, compressed cache against a masked reference -----

def _row_inputs(batch, row):
    """Row `row` of the batch alone, unpadded, with its own images: HF's inputs."""
    ids, mask, patches, grid = batch
    first = [0, 2][row]
    images = slice(first, first + [2, 1][row])
    offsets = np.concatenate([[0], np.cumsum(grid.prod(1))])
    length = int(mask[row].sum())
    return _hf_inputs(ids[row:row + 1, :length], mask[row:row + 1, :length],
                      patches[offsets[images.start]:offsets[images.stop]], grid[images])


def test_greedy_generation_matches_hf(tiny, batch):
    """Our batch of two ragged rows against HF's generate on each row alone (its own positions)."""
    hf, model = tiny
    ids, mask, patches, grid = batch
    ours = model.generate(ids, Pixels(patches, grid), attention_mask=mask, max_new_tokens=NEW_TOKENS)
    for row in range(2):
        inputs = _row_inputs(batch, row)
        with torch.no_grad():
            ref = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False).numpy()
        np.testing.assert_array_equal(ours[row], ref[0, inputs["input_ids"].shape[1]:])


def test_decode_step_logits_match_hf_at_the_next_mrope_position(tiny, batch):
    """One decode step on the full cache against HF's forward over prompt + that token (which puts it
    at max position + 1): logits to the parity tolerance, so the step's RoPE position is exact."""
    from lookm_jax import generate as gen, inputs
    from lookm_jax.models import llama

    hf, model = tiny
    ids, mask, patches, grid = batch
    method = lookm_jax.get_method("full")
    prompt = inputs.prepare(model, ids, Pixels(patches, grid), mask, 2, [method])
    first, cache, _ = gen.prefill(model.config, model.params, prompt.ids, prompt.valid, prompt.pixel_values,
                                  jax.random.key(0), method=method, max_new_tokens=2, sampling=gen.Sampling())
    text = model.params["text"]
    h, _ = jax.jit(llama.decode_step, static_argnums=0)(model.text_config, text,
                                                        llama.embed_tokens(text, first[:, None])[:, 0], cache)
    ours = np.asarray(llama.lm_logits(text, h))  # [B, V]
    for row in range(2):
        inputs_row = _row_inputs(batch, row)
        token = torch.as_tensor(np.array(first[row:row + 1, None]), dtype=torch.long)
        with torch.no_grad():
            ref = hf(**{**inputs_row, "input_ids": torch.cat([inputs_row["input_ids"], token], 1),
                        "attention_mask": torch.ones(1, inputs_row["input_ids"].shape[1] + 1, dtype=torch.long),
                        "mm_token_type_ids": torch.cat([inputs_row["mm_token_type_ids"],
                                                        torch.zeros_like(token, dtype=torch.int32)], 1)}).logits
        ref = ref[0, -1].numpy()
        np.testing.assert_allclose(ours[row], ref, atol=FP32_TOL * np.abs(ref).max(), rtol=0)


def _compressed_run(model, batch, method):
    """Prefill + compress + decode as Model.run does -> (tokens [B, T], the cache's prompt slots'
    positions [N, B, Hkv, P], its next positions [B])."""
    from lookm_jax import generate as gen, inputs

    ids, mask, patches, grid = batch
    prompt = inputs.prepare(model, ids, Pixels(patches, grid), mask, NEW_TOKENS, [method])
    key = jax.random.key(0)
    first, cache, _ = gen.prefill(model.config, model.params, prompt.ids, prompt.valid, prompt.pixel_values, key,
                                  method=method, max_new_tokens=NEW_TOKENS, sampling=gen.Sampling())
    kept = np.asarray(cache.positions)[..., :method.capacity(prompt.ids.shape[1])]
    next_position = np.asarray(cache.next_position)
    tokens, _, _ = gen.decode(model.text_config, model.params["text"], first, cache, key, max_new_tokens=NEW_TOKENS,
                              sampling=gen.Sampling(), eos_ids=())
    return np.asarray(tokens), kept, next_position


def test_compressed_decode_equals_hf_attending_to_the_kept_slots(tiny, batch):
    """StreamingLLM keeps the same slots in every layer and head, so HF can run the reference: one
    forward over prompt + generated tokens, the new tokens' queries masked off the evicted prompt
    keys, every position given explicitly (the prompt's M-RoPE rows, then max + 1, + 2, ...)."""
    hf, model = tiny
    method = lookm_jax.get_method("streamingllm", budget=0.4)
    tokens, kept, next_position = _compressed_run(model, batch, method)
    for row in range(2):
        inputs = _row_inputs(batch, row)
        length = inputs["input_ids"].shape[1]
        slots = kept[:, row]
        assert (slots == slots[:1, :1]).all()  # one kept set for every layer and head
        keep = np.zeros(length, bool)
        keep[slots[0, 0][slots[0, 0] >= 0]] = True
        image = inputs["mm_token_type_ids"].numpy()[0].astype(bool)
        assert 0 < keep.sum() < length and (image & ~keep).any()  # image tokens were evicted
        prompt_positions, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                          image_grid_thw=inputs["image_grid_thw"])
        assert next_position[row] == length + int(delta[0, 0])
        new = torch.as_tensor(np.array(tokens[row:row + 1, :-1]), dtype=torch.long)
        total = length + new.shape[1]
        positions = torch.cat([prompt_positions, next_position[row] + torch.arange(new.shape[1]).expand(3, 1, -1)], 2)
        allowed = np.tril(np.ones((total, total), bool))
        allowed[length:, :length] &= keep  # generated tokens see the kept prompt slots only
        mask = torch.where(torch.as_tensor(allowed), 0.0, torch.finfo(torch.float32).min)[None, None]
        with torch.no_grad():
            logits = hf(input_ids=torch.cat([inputs["input_ids"], new], 1), pixel_values=inputs["pixel_values"],
                        image_grid_thw=inputs["image_grid_thw"], position_ids=positions, attention_mask=mask,
                        mm_token_type_ids=torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(new)], 1)).logits
        np.testing.assert_array_equal(tokens[row], logits[0, length - 1:].argmax(-1).numpy())


def test_every_method_runs_on_ragged_rows_with_every_image_token_marked(tiny, batch):
    """Every method from one shared prefill (`sweep.generate_methods`, whose cache carries the
    prefill's next M-RoPE positions); the full cache's run counts the image tokens it marked."""
    from lookm_jax.sweep import generate_methods
    from method_variants import DEFAULTS, build

    model = tiny[1]
    ids, mask, patches, grid = batch
    pixels = Pixels(patches, grid)
    full = model.run(ids, pixels, attention_mask=mask, max_new_tokens=NEW_TOKENS)  # compiled by the greedy test
    np.testing.assert_array_equal(full.image_tokens, ((ids == IMAGE_TOKEN) & mask.astype(bool)).sum(1))
    np.testing.assert_array_equal(full.kept_image_tokens, full.image_tokens)
    # A budget that keeps every slot, merging nothing, decodes as the full cache does.
    methods = [build(name, {}, budget=0.5) for name, _ in DEFAULTS] + [
        lookm_jax.get_method("lookm", budget=1.0, merge=None)]
    tokens = dict(zip([name for name, _ in DEFAULTS] + ["keep_all"],
                      generate_methods(model, ids, pixels, mask, NEW_TOKENS, methods=methods)))
    chex.assert_shape(list(tokens.values()), [(2, NEW_TOKENS)] * len(methods))
    np.testing.assert_array_equal(tokens["full"], full.tokens)
    np.testing.assert_array_equal(tokens["keep_all"], full.tokens)


def test_prefill_and_decode_export_for_gpu_and_tpu(tiny, batch):
    import functools

    from lookm_jax import generate as gen, inputs

    model = tiny[1]
    ids, mask, patches, grid = batch
    method = lookm_jax.get_method("lookm", budget=0.5)
    prompt = inputs.prepare(model, ids, Pixels(patches, grid), mask, NEW_TOKENS, [method])
    args = (model.config, model.params, prompt.ids, prompt.valid, prompt.pixel_values, jax.random.key(0))
    static = dict(method=method, max_new_tokens=NEW_TOKENS, sampling=gen.Sampling())
    platforms = ("cuda", "tpu")
    assert jax.export.export(gen.prefill, platforms=platforms)(*args, **static).platforms == platforms
    first, cache, _ = jax.eval_shape(functools.partial(gen.prefill, args[0], **static), *args[1:])
    exported = jax.export.export(gen.decode, platforms=platforms)(
        model.text_config, model.params["text"], first, cache, args[-1], max_new_tokens=NEW_TOKENS,
        sampling=gen.Sampling(), eos_ids=model.text_config.eos_token_ids)
    assert exported.platforms == platforms


# ---- config handling, checkpoint layouts, conversion ----------------------------------------------

# Qwen2-VL-7B's config.json as published (one copy, in bench/sizes.py, for the size table and these tests).
HUB_7B = published_config("Qwen2-VL-7B")


def test_hub_config_parses_as_hf_reads_it():
    from transformers import Qwen2VLConfig as HFConfig

    cfg = Qwen2VLConfig.from_hf(HUB_7B)
    hf = HFConfig(**{k: v for k, v in HUB_7B.items() if k not in ("model_type", "transformers_version")})
    text = hf.text_config
    assert (cfg.text.hidden_size, cfg.text.num_layers, cfg.text.num_heads, cfg.text.num_kv_heads, cfg.text.vocab_size,
            cfg.text.intermediate_size) == (text.hidden_size, text.num_hidden_layers, text.num_attention_heads,
                                            text.num_key_value_heads, text.vocab_size, text.intermediate_size)
    assert cfg.text.rope.theta == text.rope_parameters["rope_theta"] == 1e6 and cfg.text.rope.mrope_section == (16, 24, 24)
    assert cfg.text.qkv_bias and not cfg.text.tie_word_embeddings and cfg.text.head_dim == 128
    assert (cfg.vision.depth, cfg.vision.embed_dim, cfg.vision.in_channels) == (32, 1280, 3)
    assert (cfg.image_token_id, cfg.vision_start_token_id) == (hf.image_token_id, hf.vision_start_token_id)


REFUSED = [
    ("mystery_field", 1, "mystery_field"),
    ("use_sliding_window", True, "use_sliding_window"),
    ("rope_scaling", {"type": "mrope", "mrope_section": [16, 24, 20]}, "mrope_section"),
    ("rope_scaling", {"type": "yarn", "factor": 2.0}, "rope_type"),
    ("vision_config.hidden_act", "relu", "hidden_act"),
    ("vision_config.spatial_patch_size", 16, "spatial_patch_size"),
    ("vision_config.num_heads", 12, "num_heads"),
    ("vision_config.hidden_size", 4096, "hidden_size"),
    ("vision_config.window_size", 112, "window_size"),  # Qwen2.5-VL's windowed tower
    ("image_token_id", 10**6, "image_token_id"),
]


@pytest.mark.parametrize("path,value,named", REFUSED, ids=[r[0] + "=" + str(r[1]) for r in REFUSED])
def test_unsupported_config_refused_naming_the_field(path, value, named):
    with pytest.raises(ConfigError, match=named):
        Qwen2VLConfig.from_hf(with_field(HUB_7B, path, value))


def test_hub_key_layout_and_converted_round_trip_give_the_same_params(tiny, tmp_path):
    """Hub names (visual.*, model.layers.*: what save_pretrained writes) and transformers 5's module
    names (model.visual.*, model.language_model.*) convert alike; `lookm convert` + `load` keeps
    config, preprocessor settings and params."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from lookm_jax.cli import main

    model = tiny[1]
    source = model.manifest["source"]
    tensors = load_file(f"{source}/model.safetensors")
    assert all(k.startswith(("visual.", "model.layers.", "model.embed_tokens.", "model.norm.", "lm_head."))
               for k in tensors)
    renamed = {("model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1)
                if k.startswith("model.") else k): v for k, v in tensors.items()}
    (tmp_path / "v5").mkdir()
    for name in ("config.json", "tokenizer.json", "preprocessor_config.json"):
        shutil.copy(f"{source}/{name}", tmp_path / "v5")
    save_file(renamed, str(tmp_path / "v5" / "model.safetensors"), metadata={"format": "pt"})
    chex.assert_trees_all_equal(lookm_jax.load(str(tmp_path / "v5")).params, model.params)

    assert main(["convert", str(tmp_path / "v5"), str(tmp_path / "converted")]) == 0
    again = lookm_jax.load(str(tmp_path / "converted"))
    assert again.config == model.config and again.manifest["image_processor"] == model.manifest["image_processor"]
    chex.assert_trees_all_equal(again.params, model.params)


def test_checkpoint_missing_a_merger_tensor_is_refused(tiny, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    from lookm_jax.convert.tables import CheckpointError

    source = tiny[1].manifest["source"]
    shutil.copy(f"{source}/config.json", tmp_path)
    tensors = load_file(f"{source}/model.safetensors")
    save_file({k: v for k, v in tensors.items() if "merger.mlp.2.bias" not in k}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="merger.mlp.2.bias"):
        lookm_jax.load(str(tmp_path))


def test_cli_generate_preprocesses_with_the_checkpoint_processor(tiny, tmp_path, capsys):
    from lookm_jax.cli import main

    paths = []
    for i, image in enumerate(_images(SIZES[:2], seed=1)):
        paths.append(str(tmp_path / f"image{i}.png"))
        image.save(paths[-1])
    argv = ["generate", "--model", tiny[1].manifest["source"], "--prompt", "what is this", "--max-new-tokens", "2"]
    assert main(argv + [arg for p in paths for arg in ("--image", p)]) == 0
    tokens = sum(h * w // 4 for h, w in ((8, 12), (10, 6)))  # 32 x 48 and 40 x 24 pixels, 4 px patches
    assert f"({tokens} image," in capsys.readouterr().out


def test_attention_received_matches_hf_eager_attention(tiny, batch):
    """`lookm plot attention`'s statistic (A_s per layer) at Qwen2-VL's M-RoPE positions, against HF's
    eager attention probabilities (summed over queries, averaged over heads, float64)."""
    from lookm_jax.analysis import attention_received

    hf, model = tiny
    inputs = _row_inputs(batch, 0)
    pixels = Pixels(inputs["pixel_values"].numpy(), inputs["image_grid_thw"].numpy())
    ours = attention_received(model, inputs["input_ids"].numpy(), pixels)
    hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = hf(**inputs, output_attentions=True)
    finally:
        hf.set_attn_implementation("sdpa")
    ref = np.stack([a[0].double().numpy().sum(axis=1).mean(axis=0) for a in out.attentions])
    chex.assert_shape(ours, ref.shape)
    np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=2e-5)
