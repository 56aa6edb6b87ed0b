"""LLaVA-NeXT against transformers' LlavaNextForConditionalGeneration (tiny, random).

Tiles are 48 px, the tower's patches 8 px: 6 x 6 features per tile. Pinpoints 48 x 96, 96 x 48,
96 x 96, 144 x 48 and 48 x 144. The pictures: 20 x 90 (a 1 x 2 grid whose 6 x 12 feature map loses
two rows of padding above and two below: 36 + 2 x 13 tokens), 120 x 20 (3 x 1, a column either side
cut: 36 + 18 x 5) and 70 x 75 (2 x 2, nothing cut: 36 + 12 x 13), in a batch of two ragged rows. The
decoder has 6 query and 2 KV heads (GQA, 3 per group); the tower 3 heads.
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
from lookm_jax.models.llava_next import AnyresPixels, LlavaNextConfig
from lookm_jax.models.llava_next_processing import LlavaNextImageProcessorConfig, preprocess_anyres
from tests.conftest import published_config, with_field, word_tokenizer

FP32_TOL = 1e-5  # max abs logit difference, relative to the logits' scale (as test_qwen2_vl)
WORDS = ["what", "is", "this", "a", "cat", "dog", "[UNK]"]
IMAGE_TOKEN = 7  # "<image>", the first added token
VOCAB = 48
NEW_TOKENS = 6
TILE, PATCH = 48, 8
PINPOINTS = [[48, 96], [96, 48], [96, 96], [144, 48], [48, 144]]
SIZES = [(20, 90), (120, 20), (70, 75)]  # (height, width)
TOKENS = [36 + 2 * 13, 36 + 18 * 5, 36 + 12 * 13]


def tiny_tokenizer():
    tok = word_tokenizer(WORDS, ["<image>"])
    assert tok.token_to_id("<image>") == IMAGE_TOKEN
    return tok


def hf_image_processor():
    from transformers import LlavaNextImageProcessorPil

    return LlavaNextImageProcessorPil(size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE},
                                      image_grid_pinpoints=PINPOINTS)


def tiny_llava_next(folder, seed=0):
    """Build, save (with a tokenizer and a preprocessor config) and return a tiny random
    LlavaNextForConditionalGeneration."""
    from transformers import LlavaNextConfig as HFConfig, LlavaNextForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(model_type="llama", vocab_size=VOCAB, hidden_size=96, intermediate_size=112, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-6, bos_token_id=None,
                eos_token_id=None, pad_token_id=None)
    vision = dict(model_type="clip_vision_model", hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=3, image_size=TILE, patch_size=PATCH, projection_dim=16)
    config = HFConfig(text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN,
                      image_grid_pinpoints=PINPOINTS, vision_feature_layer=-2,
                      vision_feature_select_strategy="default")
    model = LlavaNextForConditionalGeneration(config).eval()
    with torch.no_grad():  # default init leaves unit norms, zero biases and a 0.02-wide head: widen them
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            elif "embed_tokens" in name or "lm_head" in name or "image_newline" in name:
                p.normal_(0, 1.0)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "vision_tower" in name and name.endswith("weight"):
                p.normal_(0, 0.1)
        model.lm_head.weight[IMAGE_TOKEN] = 0  # never generates the placeholder
    model.save_pretrained(str(folder))
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    hf_image_processor().save_pretrained(str(folder))
    return model


def _images(sizes=SIZES, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llava_next")
    return tiny_llava_next(folder), lookm_jax.load(str(folder))


@pytest.fixture(scope="module")
def batch(tiny):
    """Two right-padded rows: [text, image 0, text, image 1, text] and [text, image 2, text...]: ragged,
    three images of different grids. -> (ids [2, L], mask [2, L], AnyresPixels)."""
    pixels, tokens = tiny[1].preprocess_images(_images())
    assert tokens == TOKENS
    return (*ragged_rows(tokens), pixels)


def ragged_rows(tokens):
    """The batch's two rows around images of `tokens` placeholders each, right-padded: (ids, mask)."""
    def image(n):
        return [IMAGE_TOKEN] * tokens[n]

    rows = [[0, 1] + image(0) + [2, 3] + image(1) + [4, 5, 2], [3] + image(2) + [0, 1, 2, 3, 4, 5, 0, 1]]
    length = max(map(len, rows))
    ids = np.asarray([r + [0] * (length - len(r)) for r in rows], np.int32)
    mask = np.asarray([[1] * len(r) + [0] * (length - len(r)) for r in rows], np.int32)
    return ids, mask


def _hf_pixels(pixels, images):
    """Our tiles of `images` (indices) as HF's pixel_values [n, most tiles, C, S, S] (zero-padded) and
    image_sizes [n, 2]."""
    tiles, sizes, layout = (np.asarray(a) for a in (pixels.tiles, pixels.sizes, pixels.layout))
    counts = 1 + layout[:, 1] * layout[:, 2]
    per_image = [tiles[layout[i, 0]:layout[i, 0] + counts[i]] for i in images]
    out = np.zeros((len(images), max(map(len, per_image)), *tiles.shape[1:]), np.float32)
    for i, t in enumerate(per_image):
        out[i, :len(t)] = t
    return torch.as_tensor(out), torch.as_tensor(sizes[list(images)].astype(np.int64))


def _hf_inputs(ids, mask, pixels, images):
    pixel_values, image_sizes = _hf_pixels(pixels, images)
    return dict(input_ids=torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask),
                pixel_values=pixel_values, image_sizes=image_sizes)


def _row_inputs(batch, row):
    """Row `row` alone, unpadded, with its own images: HF's inputs."""
    ids, mask, pixels = batch
    length = int(mask[row].sum())
    return _hf_inputs(ids[row:row + 1, :length], mask[row:row + 1, :length], pixels, [[0, 1], [2]][row])


# ---- anyres layout, preprocessing and prompt expansion against HF ----------------------------------

def test_unpadded_window_equals_hf_unpad_image(tiny):
    """Our kept window of each grid's feature map against HF's `unpad_image` on a map of indices, and
    the grid against `get_anyres_image_grid_shape`, over many aspect ratios."""
    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

    cfg = tiny[1].config
    sizes = SIZES + [(h, w) for h in (7, 33, 48, 61, 100, 150) for w in (9, 40, 96, 130, 400)]
    cut = set()
    for h, w in sizes:
        _, tile_rows, tile_cols, top, rows, left, cols = cfg.image_layout(h, w)
        assert (tile_rows, tile_cols) == tuple(get_anyres_image_grid_shape((h, w), PINPOINTS, TILE))
        side = cfg.side
        index = torch.arange(tile_rows * side * tile_cols * side).reshape(1, tile_rows * side, tile_cols * side)
        want = unpad_image(index, torch.as_tensor([h, w])).numpy()[0]
        np.testing.assert_array_equal(want, index.numpy()[0, top:top + rows, left:left + cols])
        cut.add((top > 0, left > 0))
    assert cut == {(False, False), (True, False), (False, True)}


def test_tiles_and_prompt_equal_hf_processor(tiny):
    from transformers import LlavaNextProcessor, PreTrainedTokenizerFast

    images = _images(seed=1)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer())
    hf = LlavaNextProcessor(image_processor=hf_image_processor(), tokenizer=tokenizer, patch_size=PATCH,
                            vision_feature_select_strategy="default", num_additional_image_tokens=1)
    want = hf(images=images, text="<image>\n<image>\n<image>\nwhat is this", return_tensors="np")
    pixels, tokens = tiny[1].preprocess_images(images)
    ids = tiny[1].encode_chat("what is this", num_images=3, image_tiles=tokens)
    np.testing.assert_array_equal(ids, want["input_ids"])
    assert tokens == TOKENS and (ids == IMAGE_TOKEN).sum() == sum(TOKENS)
    hf_pixels, hf_sizes = _hf_pixels(pixels, [0, 1, 2])
    np.testing.assert_array_equal(hf_sizes.numpy(), want["image_sizes"])
    chex.assert_shape(pixels.tiles, (3 + 2 + 3 + 4, 3, TILE, TILE))
    np.testing.assert_array_equal(hf_pixels.numpy(), want["pixel_values"])  # bit-equal, padding included


def test_preprocessor_config_reads_hf_and_refuses_what_it_cannot_do():
    config = LlavaNextImageProcessorConfig.from_hf_dict(json.loads(hf_image_processor().to_json_string()))
    assert config.tile_size == TILE and config.image_grid_pinpoints == tuple(map(tuple, PINPOINTS))
    base = {"image_processor_type": "LlavaNextImageProcessor"}
    for extra, named in (({"crop_size": {"height": 300, "width": 300}}, "crop_size"), ({"mystery": 1}, "mystery"),
                         ({"size": {"height": 336, "width": 336}}, "size"),
                         ({"do_center_crop": False}, "do_center_crop"),
                         ({"image_grid_pinpoints": [[336, 500]]}, "pinpoints")):
        with pytest.raises(ValueError, match=named):
            LlavaNextImageProcessorConfig.from_hf_dict({**base, **extra})
    tiles, sizes = preprocess_anyres(_images([(5, 300)]), config)
    assert sizes.tolist() == [[5, 300]] and tiles.shape == (1 + 3, 3, TILE, TILE)


def test_pixels_that_do_not_fit_the_prompt_are_refused(tiny, batch):
    model = tiny[1]
    ids, mask, pixels = batch
    with pytest.raises(InputError, match="placeholder tokens, in order"):
        model.logits(ids, AnyresPixels(pixels.tiles, pixels.sizes[[1, 0, 2]], model.config.layout(
            np.asarray(pixels.sizes)[[1, 0, 2]])), attention_mask=mask)
    with pytest.raises(InputError, match="tiles"):
        model.logits(ids, AnyresPixels(pixels.tiles[:-1], pixels.sizes, pixels.layout), attention_mask=mask)
    with pytest.raises(InputError, match="layout"):
        model.logits(ids, AnyresPixels(pixels.tiles, pixels.sizes, np.zeros_like(pixels.layout)), attention_mask=mask)
    with pytest.raises(InputError, match="AnyresPixels"):
        model.logits(ids, pixels.tiles, attention_mask=mask)


# ---- the packed features and the logits ---------------------------------------------------------

def test_packed_features_match_hf(tiny, batch):
    from lookm_jax.models.llava import llava_next_image_features

    hf, model = tiny
    _, _, pixels = batch
    ours = jax.jit(llava_next_image_features, static_argnums=0)(model.config, model.params, pixels)
    pixel_values, image_sizes = _hf_pixels(pixels, [0, 1, 2])
    with torch.no_grad():
        ref = torch.cat(hf.model.get_image_features(pixel_values, image_sizes).pooler_output).numpy()
    chex.assert_shape(ours, (1, 12 * 36 + (12 - 3) * 6, 96))
    assert ref.shape == (sum(TOKENS), 96)
    np.testing.assert_allclose(ours[0, :len(ref)], ref, atol=5e-6 * np.abs(ref).max(), rtol=0)


@pytest.fixture(scope="module")
def batch_inputs(batch):
    """The whole batch as HF's inputs."""
    ids, mask, pixels = batch
    return _hf_inputs(ids, mask, pixels, [0, 1, 2])


def test_logits_match_hf(tiny, batch, batch_inputs):
    """(tests/test_llava_onevision.py runs it on its own model and `batch_inputs`.)"""
    hf, model = tiny
    ids, mask, pixels = batch
    with torch.no_grad():
        ref = hf(**batch_inputs).logits.numpy()
    ours = model.logits(ids, pixels, attention_mask=mask)
    assert ours.shape == ref.shape and ours.dtype == np.float32
    valid = mask.astype(bool)
    scale = np.abs(ref[valid]).max()
    np.testing.assert_allclose(ours[valid], ref[valid], atol=FP32_TOL * scale, rtol=0)
    other = AnyresPixels(np.random.default_rng(5).standard_normal(pixels.tiles.shape).astype(np.float32),
                         pixels.sizes, pixels.layout)
    assert np.abs(model.logits(ids, other, attention_mask=mask)[valid] - ours[valid]).max() > 1000 * FP32_TOL * scale


# ---- generation: full cache against HF's generate, compressed cache against a masked reference -----
# (tests/test_llava_onevision.py runs these four on its own model with its own `row_inputs` and
# `image_tokens`)

@pytest.fixture(scope="module")
def row_inputs():
    return _row_inputs


@pytest.fixture(scope="module")
def image_tokens():
    """The image tokens of each row of `batch`, newlines included."""
    return [TOKENS[0] + TOKENS[1], TOKENS[2]]


def test_greedy_generation_matches_hf(tiny, batch, row_inputs):
    """Our batch of two ragged rows against HF's generate on each row alone."""
    hf, model = tiny
    ids, mask, pixels = batch
    ours = model.generate(ids, pixels, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    for row in range(2):
        inputs = row_inputs(batch, row)
        with torch.no_grad():
            ref = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False).numpy()
        np.testing.assert_array_equal(ours[row], ref[0, inputs["input_ids"].shape[1]:])


def test_compressed_decode_equals_hf_attending_to_the_kept_slots(tiny, batch, row_inputs):
    """StreamingLLM keeps the same slots in every layer and head, so HF can run the reference: one
    forward over prompt + generated tokens, the new tokens' queries masked off the evicted prompt keys."""
    from lookm_jax import generate as gen, inputs

    hf, model = tiny
    ids, mask, pixels = batch
    method = lookm_jax.get_method("streamingllm", budget=0.4)
    prompt = inputs.prepare(model, ids, pixels, mask, NEW_TOKENS, [method])
    key = jax.random.key(0)
    first, cache, _ = gen.prefill(model.config, model.params, prompt.ids, prompt.valid, prompt.pixel_values, key,
                                  method=method, max_new_tokens=NEW_TOKENS, sampling=gen.Sampling())
    kept = np.asarray(cache.positions)[..., :method.capacity(prompt.ids.shape[1])]
    tokens, _, _ = gen.decode(model.text_config, model.params["text"], first, cache, key, max_new_tokens=NEW_TOKENS,
                              sampling=gen.Sampling(), eos_ids=())
    tokens = np.asarray(tokens)
    for row in range(2):
        hf_inputs = row_inputs(batch, row)
        length = hf_inputs["input_ids"].shape[1]
        slots = kept[:, row]
        assert (slots == slots[:1, :1]).all()  # one kept set for every layer and head
        keep = np.zeros(length, bool)
        keep[slots[0, 0][slots[0, 0] >= 0]] = True
        image = hf_inputs["input_ids"].numpy()[0] == IMAGE_TOKEN
        assert 0 < keep.sum() < length and (image & ~keep).any()  # image tokens were evicted
        new = torch.as_tensor(np.array(tokens[row:row + 1, :-1]), dtype=torch.long)
        total = length + new.shape[1]
        allowed = np.tril(np.ones((total, total), bool))
        allowed[length:, :length] &= keep  # generated tokens see the kept prompt slots only
        attention = torch.where(torch.as_tensor(allowed), 0.0, torch.finfo(torch.float32).min)[None, None]
        with torch.no_grad():
            images = {k: v for k, v in hf_inputs.items() if k not in ("input_ids", "attention_mask")}
            logits = hf(input_ids=torch.cat([hf_inputs["input_ids"], new], 1), attention_mask=attention,
                        position_ids=torch.arange(total)[None], **images).logits
        np.testing.assert_array_equal(tokens[row], logits[0, length - 1:].argmax(-1).numpy())


def test_every_method_runs_on_ragged_rows_with_every_image_token_marked(tiny, batch, image_tokens):
    """Every method from one shared prefill; the full cache's run counts the image tokens it marked
    (newlines included)."""
    from lookm_jax.sweep import generate_methods
    from method_variants import DEFAULTS, build

    model = tiny[1]
    ids, mask, pixels = batch
    full = model.run(ids, pixels, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(full.image_tokens, image_tokens)
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
    ids, mask, pixels = batch
    method = lookm_jax.get_method("lookm", budget=0.5)
    prompt = inputs.prepare(model, ids, pixels, mask, NEW_TOKENS, [method])
    args = (model.config, model.params, prompt.ids, prompt.valid, prompt.pixel_values, jax.random.key(0))
    static = dict(method=method, max_new_tokens=NEW_TOKENS, sampling=gen.Sampling())
    platforms = ("cuda", "tpu")
    assert jax.export.export(gen.prefill, platforms=platforms)(*args, **static).platforms == platforms
    first, cache, _ = jax.eval_shape(functools.partial(gen.prefill, args[0], **static), *args[1:])
    exported = jax.export.export(gen.decode, platforms=platforms)(
        model.text_config, model.params["text"], first, cache, args[-1], max_new_tokens=NEW_TOKENS,
        sampling=gen.Sampling(), eos_ids=model.text_config.eos_token_ids)
    assert exported.platforms == platforms


# ---- config handling, conversion ---------------------------------------------------------------------

# LLaVA-NeXT-7B's config.json as published (one copy, in bench/sizes.py, for the size table and these tests).
HUB_7B = published_config("LLaVA-NeXT-7B")


def test_hub_config_parses_as_hf_reads_it():
    from transformers import LlavaNextConfig as HFConfig

    cfg = LlavaNextConfig.from_hf(HUB_7B)
    hf = HFConfig(**{k: v for k, v in HUB_7B.items() if k not in ("model_type", "transformers_version")})
    assert cfg.image_grid_pinpoints == tuple(map(tuple, hf.image_grid_pinpoints))
    assert (cfg.text.hidden_size, cfg.text.num_layers, cfg.text.vocab_size, cfg.vision.image_size, cfg.side) == (
        hf.text_config.hidden_size, hf.text_config.num_hidden_layers, hf.text_config.vocab_size,
        hf.vision_config.image_size, 24)
    assert cfg.image_token_id == hf.image_token_id and cfg.image_tokens(672, 672) == 576 + 48 * 49


REFUSED = [
    ("mystery_field", 1, "mystery_field"),
    ("vision_feature_select_strategy", "full", "vision_feature_select_strategy"),
    ("image_grid_pinpoints", [[336, 500]], "image_grid_pinpoints"),
    ("image_grid_pinpoints", "anyres", "image_grid_pinpoints"),
    ("use_image_newline_parameter", False, "use_image_newline_parameter"),
    ("projector_hidden_act", "relu", "projector_hidden_act"),
    ("text_config.model_type", "mistral", "model_type"),
]


@pytest.mark.parametrize("path,value,named", REFUSED, ids=[r[0] + "=" + str(r[1]) for r in REFUSED])
def test_unsupported_config_refused_naming_the_field(path, value, named):
    with pytest.raises(ConfigError, match=named):
        LlavaNextConfig.from_hf(with_field(HUB_7B, path, value))


def test_hub_key_layout_and_converted_round_trip_give_the_same_params(tiny, tmp_path):
    """What save_pretrained writes (vision_tower.*, image_newline, language_model.model.*) and
    transformers 5's module names (model.vision_tower.vision_model.*, model.image_newline,
    model.language_model.*) convert alike; `lookm convert` + `load` keeps config, preprocessor
    settings and params; a missing newline is refused by name."""
    from safetensors.numpy import load_file

    model = tiny[1]
    assert isinstance(model.config, LlavaNextConfig) and model.params["projector"]["newline"].shape == (96,)
    source = model.manifest["source"]
    tensors = load_file(f"{source}/model.safetensors")
    assert "image_newline" in tensors

    v5 = {module_name(k): v for k, v in tensors.items()}
    assert "model.image_newline" in v5 and "model.multi_modal_projector.linear_1.weight" in v5
    check_layout_round_trip(model, tmp_path, v5, {k: v for k, v in tensors.items() if k != "image_newline"},
                            "image_newline")


def module_name(key: str) -> str:
    """A name save_pretrained writes -> transformers 5's module name for it."""
    for old, new in (("vision_tower.", "model.vision_tower.vision_model."), ("language_model.model.",
                     "model.language_model."), ("language_model.lm_head.", "lm_head."), ("", "model.")):
        if key.startswith(old):
            return new + key[len(old):]


def check_layout_round_trip(model, tmp_path, renamed: dict, broken: dict, missing: str) -> None:
    """The model's checkpoint folder re-saved with `renamed` tensors loads to the same params; with
    `broken` ones (lacking `missing`) it is refused naming it; `lookm convert` of the renamed folder +
    `load` keeps config, preprocessor settings and params."""
    import shutil

    from safetensors.numpy import save_file

    from lookm_jax.cli import main
    from lookm_jax.convert.tables import CheckpointError

    source = model.manifest["source"]
    for name, kept in (("renamed", renamed), ("broken", broken)):
        (tmp_path / name).mkdir()
        for file in ("config.json", "tokenizer.json", "preprocessor_config.json"):
            shutil.copy(f"{source}/{file}", tmp_path / name)
        save_file(kept, str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
    chex.assert_trees_all_equal(lookm_jax.load(str(tmp_path / "renamed")).params, model.params)
    with pytest.raises(CheckpointError, match=missing):
        lookm_jax.load(str(tmp_path / "broken"))
    assert main(["convert", str(tmp_path / "renamed"), str(tmp_path / "converted")]) == 0
    again = lookm_jax.load(str(tmp_path / "converted"))
    assert again.config == model.config and again.manifest["image_processor"] == model.manifest["image_processor"]
    chex.assert_trees_all_equal(again.params, model.params)
