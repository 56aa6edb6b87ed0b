"""LLaVA-OneVision against transformers' LlavaOnevisionForConditionalGeneration (tiny, random).

Tiles are 30 px, SigLIP's patches 7 px: 4 x 4 features per tile, the last 2 pixels of each side
unread (as 384 / 14 leaves 6); vision_aspect_ratio "anyres_max_9". Pinpoints up to 120 x 120 (a 4 x 4
grid). The batch: row 0 a two-image prompt (20 x 50 and 45 x 30:
each one padded square tile, 16 + 1 tokens, as HF's processor and model treat every image of a
multi-image prompt), row 1 a single 100 x 127 picture (4 x 4 grid, a 16 x 16 feature map, two rows
cut above and two below: 12 x 16 = 192 features > 9 tiles' 144 by sqrt(192 / 144) = 1.15 > 1.1, so
bilinearly downsampled to 10 x 13, then 10 newlines: 16 + 10 x 14 tokens). The decoder is a Qwen2
(q/k/v biases) with 6 query and 2 KV heads (GQA, 3 per group); the tower has 3 heads.
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
from lookm_jax.models.llava_next import AnyresPixels, concat_pixels, pack_features
from lookm_jax.models.llava_next_processing import LlavaNextImageProcessorConfig, preprocess_anyres
from lookm_jax.models.llava_onevision import LlavaOnevisionConfig
from tests import test_llava_next as next_tests
from tests.conftest import published_config, with_field, word_tokenizer

FP32_TOL = 1e-5  # max abs logit difference, relative to the logits' scale (as test_llava_next)
WORDS = ["what", "is", "this", "a", "cat", "dog", "[UNK]"]
IMAGE_TOKEN, VIDEO_TOKEN = 7, 8  # "<image>", "<video>": the added tokens
VOCAB = 48
NEW_TOKENS = 6
TILE, PATCH, SIDE = 30, 7, 4
PINPOINTS = [[30, 60], [60, 30], [60, 60], [30, 90], [90, 30], [120, 120]]
ROW0, ROW1 = [(20, 50), (45, 30)], [(100, 127)]  # (height, width)
TOKENS = [SIDE**2 + 1, SIDE**2 + 1, SIDE**2 + 10 * 14]


def tiny_tokenizer():
    tok = word_tokenizer(WORDS, ["<image>", "<video>"])
    assert tok.token_to_id("<image>") == IMAGE_TOKEN
    return tok


def hf_image_processor():
    from transformers import LlavaOnevisionImageProcessorPil

    return LlavaOnevisionImageProcessorPil(size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS,
                                           image_mean=[0.5] * 3, image_std=[0.5] * 3)


def tiny_onevision(folder, seed=0):
    """Build, save (with a tokenizer and a preprocessor config) and return a tiny random
    LlavaOnevisionForConditionalGeneration."""
    from transformers import LlavaOnevisionConfig as HFConfig, LlavaOnevisionForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=96, intermediate_size=112, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-6, bos_token_id=None,
                eos_token_id=None, pad_token_id=None)
    vision = dict(model_type="siglip_vision_model", hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=3, image_size=TILE, patch_size=PATCH, vision_use_head=False)
    config = HFConfig(text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN,
                      video_token_index=VIDEO_TOKEN, image_grid_pinpoints=PINPOINTS, vision_feature_layer=-1,
                      vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9")
    model = LlavaOnevisionForConditionalGeneration(config).eval()
    with torch.no_grad():  # default init leaves unit norms, zero biases and a 0.02-wide head: widen them
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            elif "embed_tokens" in name or "lm_head" in name or "image_newline" in name:
                p.normal_(0, 1.0)
            elif name.endswith("bias") or "position_embedding" in name:
                p.normal_(0, 0.1)
            elif "vision_tower" in name and name.endswith("weight"):
                p.normal_(0, 0.1)
        model.lm_head.weight[IMAGE_TOKEN] = 0  # never generates the placeholders
        model.lm_head.weight[VIDEO_TOKEN] = 0
    model.save_pretrained(str(folder))
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    hf_image_processor().save_pretrained(str(folder))
    return model


def _images(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def hf_processor(image_processor=None, num_image_tokens=SIDE**2):
    from transformers import LlavaOnevisionProcessor, PreTrainedTokenizerFast

    class ImagesOnly(LlavaOnevisionProcessor):  # the video processor needs torchvision, which is not installed
        def check_argument_for_proper_class(self, name, arg):
            return None if name == "video_processor" else super().check_argument_for_proper_class(name, arg)

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer())
    tokenizer.pad_token = "[UNK]"  # the batch's rows are right-padded
    return ImagesOnly(image_processor=image_processor or hf_image_processor(), tokenizer=tokenizer,
                      num_image_tokens=num_image_tokens, vision_feature_select_strategy="full")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llava_onevision")
    return tiny_onevision(folder), lookm_jax.load(str(folder))


@pytest.fixture(scope="module")
def batch(tiny):
    """Two right-padded rows: [text, image 0, text, image 1, text] (a two-image prompt) and [text,
    image 2, text...] (one picture, downsampled): ragged. -> (ids [2, L], mask [2, L], AnyresPixels)."""
    model = tiny[1]
    first, tokens0 = model.preprocess_images(_images(ROW0))
    second, tokens1 = model.preprocess_images(_images(ROW1, seed=1))
    assert tokens0 + tokens1 == TOKENS
    return (*next_tests.ragged_rows(TOKENS), concat_pixels([first, second]))


_hf_pixels = next_tests._hf_pixels  # our tiles as HF's pixel_values and image_sizes


def _hf_inputs(ids, mask, pixels, images, batch_num_images):
    """LLaVA-NeXT's HF inputs, with each prompt's image count (HF tiles a one-picture prompt's only)."""
    return {**next_tests._hf_inputs(ids, mask, pixels, images), "batch_num_images": torch.as_tensor(batch_num_images)}


def _row_inputs(batch, row):
    """Row `row` alone, unpadded, with its own images: HF's inputs."""
    ids, mask, pixels = batch
    length = int(mask[row].sum())
    return _hf_inputs(ids[row:row + 1, :length], mask[row:row + 1, :length], pixels, [[0, 1], [2]][row],
                      [[2], [1]][row])


# ---- anyres_max layout, preprocessing and prompt expansion against HF ------------------------------

def test_placeholder_counts_equal_hf_processor_over_many_sizes(tiny):
    """Our count (unpad window, anyres_max downsampling, newlines) against HF's processor, over sizes
    that downsample and sizes that do not; a multi-image prompt's image is s*s + 1."""
    cfg = tiny[1].config
    processor = hf_processor()
    sizes = ROW0 + ROW1 + [(h, w) for h in (7, 33, 64, 90, 128, 300) for w in (9, 40, 64, 100, 127, 500)]
    want = processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    assert [cfg.image_tokens(h, w) for h, w in sizes] == want
    downsampled = [(h, w) for h, w in sizes if cfg.image_row(h, w)[7:] != cfg.image_row(h, w)[4:7:2]]
    assert (100, 127) in downsampled and len(downsampled) < len(sizes) - 10
    assert cfg.image_tokens(20, 50, patched=False) == SIDE**2 + 1


def test_packing_equals_hf_pack_image_features_over_many_sizes(tiny):
    """Random tile features packed by us and by HF's pack_image_features (unpad, anyres_max bilinear
    downsampling, newlines) for 39 sizes, 7 of them downsampled, 2 so flat that no feature row is
    left: no tower involved."""
    from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

    hf, model = tiny
    cfg = model.config
    sizes = ROW0 + ROW1 + [(h, w) for h in (7, 33, 64, 90, 128, 300) for w in (9, 40, 64, 100, 127, 500)]
    layout = cfg.layout(sizes)
    assert (layout[:, 7] < layout[:, 4]).sum() == 7 and (layout[:, 4] == 0).sum() == 2
    tiles = int((1 + layout[:, 1] * layout[:, 2]).sum())
    features = np.random.default_rng(6).standard_normal((tiles, SIDE**2, 96)).astype(np.float32)
    newline = np.random.default_rng(7).standard_normal(96).astype(np.float32)
    pixels = AnyresPixels(np.zeros((tiles, 3, TILE, TILE), np.float32), np.asarray(sizes, np.int32), layout)
    ours = jax.jit(pack_features, static_argnums=0)(cfg, features, newline, pixels)[0]
    per_image = np.split(features, np.cumsum(1 + layout[:, 1] * layout[:, 2])[:-1])
    with torch.no_grad():
        ref, lens = LlavaOnevisionModel.pack_image_features(
            hf.model, [torch.as_tensor(f) for f in per_image], torch.as_tensor(sizes), torch.as_tensor(newline))
    ref = torch.cat(ref).numpy()
    assert lens.tolist() == [cfg.row_tokens(r) for r in layout]
    np.testing.assert_allclose(ours[:len(ref)], ref, atol=1e-6 * np.abs(ref).max(), rtol=0)


def test_tiles_and_prompt_equal_hf_processor(tiny):
    """A batch of a two-image prompt and a one-image prompt through HF's processor (batch_num_images
    [2, 1]) and through `preprocess_images` per prompt + `encode_chat`: bit-equal pixels, equal ids."""
    model = tiny[1]
    images = [_images(ROW0, seed=2), _images(ROW1, seed=3)]
    texts = ["<image>\n<image>\nwhat is this", "<image>\nwhat is this"]
    want = hf_processor()(images=images, text=texts, return_tensors="np", padding=True)
    assert want["batch_num_images"].tolist() == [2, 1]
    parts = [model.preprocess_images(row) for row in images]
    for n, ((_, tokens), text) in enumerate(zip(parts, texts)):
        ids = model.encode_chat("what is this", num_images=len(images[n]), image_tiles=tokens)
        row = want["input_ids"][n][want["attention_mask"][n].astype(bool)]
        np.testing.assert_array_equal(ids[0], row)
    pixels = concat_pixels([p for p, _ in parts])
    chex.assert_shape(pixels.tiles, (1 + 1 + 17, 3, TILE, TILE))
    hf_pixels, hf_sizes = _hf_pixels(pixels, [0, 1, 2])
    np.testing.assert_array_equal(hf_sizes.numpy(), want["image_sizes"])
    np.testing.assert_array_equal(hf_pixels.numpy(), want["pixel_values"])  # bit-equal, padding included


def test_preprocessor_config_reads_hf_and_refuses_what_it_cannot_do():
    config = LlavaNextImageProcessorConfig.from_hf_dict(json.loads(hf_image_processor().to_json_string()))
    assert config.tile_size == TILE and config.image_mean == (0.5,) * 3
    base = {"image_processor_type": "LlavaOnevisionImageProcessor"}
    for extra, named in (({"size": {"height": 32, "width": 48}}, "size"), ({"mystery": 1}, "mystery"),
                         ({"do_pad": "yes"}, "do_pad")):
        with pytest.raises(ValueError, match=named):
            LlavaNextImageProcessorConfig.from_hf_dict({**base, **extra})
    tiles, sizes = preprocess_anyres(_images([(5, 300), (40, 7)]), config, patched=False)
    assert sizes.tolist() == [[5, 300], [40, 7]] and tiles.shape == (2, 3, TILE, TILE)


def test_pixels_that_do_not_fit_the_prompt_are_refused(tiny, batch):
    model = tiny[1]
    ids, mask, pixels = batch
    patched = model.config.layout(np.asarray(pixels.sizes))  # every image tiled: other tiles and counts
    with pytest.raises(InputError, match="tiles"):
        model.logits(ids, AnyresPixels(pixels.tiles, pixels.sizes, patched), attention_mask=mask)
    with pytest.raises(InputError, match="layout"):
        model.logits(ids, AnyresPixels(pixels.tiles, pixels.sizes, np.zeros_like(pixels.layout)), attention_mask=mask)
    with pytest.raises(InputError, match="placeholder tokens, in order"):
        model.logits(ids[::-1], pixels, attention_mask=mask[::-1])


# ---- SigLIP features, packing with downsampling, logits ------------------------------------------

def test_packed_features_match_hf_single_and_multi_image(tiny, batch):
    """The batch's features (batch_num_images [2, 1]) and, through HF's single-image path
    (batch_num_images None: every image tiled), five pictures whose grids are cut and downsampled,
    cut, downsampled, or neither."""
    from lookm_jax.models.llava import llava_next_image_features

    hf, model = tiny
    features = jax.jit(llava_next_image_features, static_argnums=0)
    _, _, pixels = batch
    ours = features(model.config, model.params, pixels)
    pixel_values, image_sizes = _hf_pixels(pixels, [0, 1, 2])
    with torch.no_grad():
        ref = torch.cat(hf.model.get_image_features(pixel_values, image_sizes,
                                                    batch_num_images=torch.as_tensor([2, 1])).pooler_output).numpy()
    chex.assert_shape(ours, (1, model.config.buffer_rows(19, 3), 96))
    assert ref.shape == (sum(TOKENS), 96)
    np.testing.assert_allclose(ours[0, :len(ref)], ref, atol=5e-6 * np.abs(ref).max(), rtol=0)

    sizes = [(100, 127), (14, 50), (127, 100), (60, 62), (20, 70)]
    settings = LlavaNextImageProcessorConfig.from_hf_dict(json.loads(hf_image_processor().to_json_string()))
    tiles, sizes = preprocess_anyres(_images(sizes, seed=4), settings)
    tiled = AnyresPixels(tiles, sizes.astype(np.int32), model.config.layout(sizes))
    ours = features(model.config, model.params, tiled)
    with torch.no_grad():
        ref = torch.cat(hf.model.get_image_features(*_hf_pixels(tiled, range(len(sizes)))).pooler_output).numpy()
    layout = np.asarray(tiled.layout)
    cut = (layout[:, 4] < SIDE * layout[:, 1]) | (layout[:, 6] < SIDE * layout[:, 2])
    small = layout[:, 7] < layout[:, 4]  # downsampled
    assert small.tolist() == [True, False, True, True, False] and cut.tolist() == [True, True, True, False, False]
    assert ref.shape[0] == sum(model.config.row_tokens(r) for r in layout)
    np.testing.assert_allclose(ours[0, :len(ref)], ref, atol=5e-6 * np.abs(ref).max(), rtol=0)


@pytest.fixture(scope="module")
def batch_inputs(batch):
    """The whole batch as HF's inputs: row 0 a two-picture prompt, row 1 a one-picture prompt."""
    ids, mask, pixels = batch
    return _hf_inputs(ids, mask, pixels, [0, 1, 2], [2, 1])


test_logits_match_hf = next_tests.test_logits_match_hf  # logits to FP32_TOL of HF's; other pixels change them


# ---- generation: full cache against HF's generate, compressed cache against a masked reference -----
# LLaVA-NeXT's tests, collected here with this module's `tiny`, `batch`, `row_inputs` (HF's inputs carry
# batch_num_images) and `image_tokens`: greedy tokens equal to HF's generate per row; a StreamingLLM
# cache's decode equal to HF attending to the same kept slots; every method from one shared prefill,
# with every image token marked; prefill and decode exported for cuda and tpu.

@pytest.fixture(scope="module")
def row_inputs():
    return _row_inputs


@pytest.fixture(scope="module")
def image_tokens():
    return [TOKENS[0] + TOKENS[1], TOKENS[2]]


# The shared tests read these from their own module:
assert (next_tests.IMAGE_TOKEN, next_tests.NEW_TOKENS, next_tests.FP32_TOL) == (IMAGE_TOKEN, NEW_TOKENS, FP32_TOL)
test_greedy_generation_matches_hf = next_tests.test_greedy_generation_matches_hf
test_compressed_decode_equals_hf_attending_to_the_kept_slots = (
    next_tests.test_compressed_decode_equals_hf_attending_to_the_kept_slots)
test_every_method_runs_on_ragged_rows_with_every_image_token_marked = (
    next_tests.test_every_method_runs_on_ragged_rows_with_every_image_token_marked)
test_prefill_and_decode_export_for_gpu_and_tpu = next_tests.test_prefill_and_decode_export_for_gpu_and_tpu


# ---- config handling, conversion ---------------------------------------------------------------------

# LLaVA-OneVision-7B's config.json as published (one copy, in bench/sizes.py, for the size table and these tests).
HUB_7B = published_config("LLaVA-OneVision-7B")


def test_hub_config_parses_as_hf_reads_it():
    from transformers import LlavaOnevisionConfig as HFConfig

    cfg = LlavaOnevisionConfig.from_hf(HUB_7B)
    hf = HFConfig(**{k: v for k, v in HUB_7B.items() if k not in ("model_type", "transformers_version")})
    assert cfg.image_grid_pinpoints == tuple(map(tuple, hf.image_grid_pinpoints))
    assert (cfg.text.hidden_size, cfg.text.num_layers, cfg.text.num_kv_heads, cfg.text.vocab_size, cfg.text.qkv_bias,
            cfg.vision.image_size, cfg.side, cfg.max_num_patches) == (
        hf.text_config.hidden_size, hf.text_config.num_hidden_layers, hf.text_config.num_key_value_heads,
        hf.text_config.vocab_size, True, hf.vision_config.image_size, 27, 9)
    assert cfg.image_token_id == hf.image_token_id and cfg.vision_feature_layer == hf.vision_feature_layer
    # 672 x 672: a 2 x 2 grid of 384 px tiles (768 x 768), 54 x 54 features, under 9 tiles' (no downsampling)
    assert cfg.image_row(672, 672)[1:] == (2, 2, 0, 54, 0, 54, 54, 54)
    from transformers import LlavaOnevisionImageProcessorPil

    processor = hf_processor(LlavaOnevisionImageProcessorPil(), num_image_tokens=729)
    sizes = [(672, 672), (1080, 1920), (3000, 400), (384, 384)]  # HF's default pinpoints: some downsample
    assert [cfg.image_tokens(h, w) for h, w in sizes] == processor._get_num_multimodal_tokens(
        image_sizes=sizes)["num_image_tokens"]
    assert cfg.image_tokens(672, 672) == 729 + 54 * 55


REFUSED = [
    ("mystery_field", 1, "mystery_field"),
    ("vision_feature_select_strategy", "default", "vision_feature_select_strategy"),
    ("vision_aspect_ratio", "anyres", "vision_aspect_ratio"),
    ("vision_aspect_ratio", "anyres_max_0", "vision_aspect_ratio"),
    ("image_grid_pinpoints", [[384, 500]], "image_grid_pinpoints"),
    ("use_image_newline_parameter", False, "use_image_newline_parameter"),
    ("projector_hidden_act", "relu", "projector_hidden_act"),
    ("video_token_index", "x", "video_token_index"),
    ("text_config.use_sliding_window", True, "use_sliding_window"),
    ("text_config.model_type", "mistral", "model_type"),
    ("vision_config.model_type", "clip_vision_model", "model_type"),
    ("vision_config.hidden_act", "gelu", "hidden_act"),
    ("vision_config.mystery", 2, "mystery"),
]


@pytest.mark.parametrize("path,value,named", REFUSED, ids=[r[0] + "=" + str(r[1]) for r in REFUSED])
def test_unsupported_config_refused_naming_the_field(path, value, named):
    with pytest.raises(ConfigError, match=named):
        LlavaOnevisionConfig.from_hf(with_field(HUB_7B, path, value))


def test_hub_key_layout_and_converted_round_trip_give_the_same_params(tiny, tmp_path):
    """What save_pretrained writes and transformers' module names (model.vision_tower.vision_model.*,
    model.image_newline, model.language_model.*) convert alike, a pooling head's tensors (vision_use_head)
    are dropped; `lookm convert` + `load` keeps config, preprocessor settings and params; a missing
    patch bias is refused by name."""
    from safetensors.numpy import load_file

    model = tiny[1]
    assert isinstance(model.config, LlavaOnevisionConfig) and model.params["projector"]["newline"].shape == (96,)
    assert model.params["vision"]["pos_embed"].shape == (SIDE**2, 48) and "class_embed" not in model.params["vision"]
    source = model.manifest["source"]
    tensors = load_file(f"{source}/model.safetensors")

    renamed = {next_tests.module_name(k): v for k, v in tensors.items()}
    assert "model.image_newline" in renamed and "model.multi_modal_projector.linear_1.weight" in renamed
    renamed["model.vision_tower.vision_model.head.probe"] = np.zeros((1, 1, 48), np.float32)
    bias = [k for k in renamed if k.endswith("patch_embedding.bias")]
    assert len(bias) == 1
    next_tests.check_layout_round_trip(model, tmp_path, renamed, {k: v for k, v in renamed.items() if k != bias[0]},
                                       "patch_embedding.bias")
