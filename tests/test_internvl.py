"""HF-format InternVL against transformers' InternVLForConditionalGeneration (tiny, random).

Tiles are 56 px in 7 px patches: an 8 x 8 grid, pixel-shuffled to 4 x 4 = 16 tokens per tile.
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
from method_variants import DEFAULTS, build
from lookm_jax.convert.tables import CheckpointError
from lookm_jax.models.config import ConfigError
from lookm_jax.models.internvl import InternVLConfig, internvl_image_features
from lookm_jax.models.internvl_processing import InternVLImageProcessorConfig, preprocess_tiles
from tests.conftest import with_field, word_tokenizer

FP32_TOL = 1e-4  # max abs logit difference (logits are O(50) here)
TILE, PATCH, PER_TILE = 56, 7, 16
WORDS = ["what", "is", "this", "a", "cat", "dog", "[UNK]"]
IMG_START, IMG_END, IMAGE_TOKEN = 7, 8, 9  # ids of <img>, </img>, <IMG_CONTEXT> in the tiny tokenizer
SPECIALS = ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
VOCAB = 96
NEW_TOKENS = 6  # generation and every method: "full" reuses the greedy test's compiled programs
IMAGENET = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}


def tiny_tokenizer():
    tok = word_tokenizer(WORDS, SPECIALS)
    assert [tok.token_to_id(s) for s in SPECIALS[:3]] == [IMG_START, IMG_END, IMAGE_TOKEN]
    return tok


def tiny_internvl(folder, *, norm="layer_norm", qk_norm=False, text="qwen2", tie=True, text_tie=False,
                  feature_layer=-1, attention_bias=True, seed=0):
    """Build, save (with a tokenizer) and return a tiny random InternVLForConditionalGeneration."""
    from transformers import InternVLConfig as HFInternVLConfig, InternVLForConditionalGeneration

    torch.manual_seed(seed)
    text_config = dict(model_type=text, vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=text_tie,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    vision_config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         image_size=TILE, patch_size=PATCH, norm_type=norm, use_qk_norm=qk_norm,
                         attention_bias=attention_bias)
    config = HFInternVLConfig(text_config=text_config, vision_config=vision_config, image_token_id=IMAGE_TOKEN,
                              image_seq_length=PER_TILE, vision_feature_layer=feature_layer, tie_word_embeddings=tie)
    model = InternVLForConditionalGeneration(config).eval()
    # Default init leaves unit norms, 0.1 layer scales, zero biases/embeddings and a 0.02-wide head and
    # projector (logits and features near 0): widen them so the tolerances below are strict.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight") or "lambda" in name:
                p.uniform_(0.5, 1.5)
            elif "embed" in name or "cls_token" in name or "lm_head" in name:
                p.normal_(0, 1.0)
            elif "multi_modal_projector.linear" in name and name.endswith("weight"):
                p.normal_(0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(str(folder))
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    return model


def hf_logits(model, ids, pixels):
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids, dtype=torch.long), pixel_values=torch.as_tensor(pixels))
    return out.logits.numpy()


def prompt_ids(tiles: list[int]) -> np.ndarray:
    """[1, L]: words, then each image as <img> + tiles * 16 placeholders + </img>, then words."""
    ids = [0, 1]
    for n in tiles:
        ids += [IMG_START] + [IMAGE_TOKEN] * (n * PER_TILE) + [IMG_END, 2]
    return np.asarray([ids + [3, 4]], np.int32)


CASES = {  # rms_norm without qk-norm is the generation tests' model
    "layer_norm_1tile": dict(norm="layer_norm", qk_norm=False, tiles=[1]),
    "rms_norm_qk_1tile+2tiles_layer-2": dict(norm="rms_norm", qk_norm=True, feature_layer=-2, tiles=[1, 2]),
    "layer_norm_qk_2tiles_llama_untied_nobias": dict(norm="layer_norm", qk_norm=True, text="llama", tie=False,
                                                     text_tie=True, attention_bias=False, tiles=[2]),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_and_image_features_match_hf(case, tmp_path):
    spec = dict(CASES[case])
    tiles = spec.pop("tiles")
    hf = tiny_internvl(tmp_path, **spec)
    model = lookm_jax.load(str(tmp_path))
    assert isinstance(model.config, InternVLConfig) and model.config.image_seq_length == PER_TILE
    assert ("lm_head" in model.params["text"]) == (not spec.get("tie", True))  # the top-level flag decides
    pixels, other_pixels = np.random.default_rng(0).standard_normal((2, sum(tiles), 3, TILE, TILE), np.float32)

    feats = np.asarray(jax.jit(internvl_image_features, static_argnums=0)(model.config, model.params, pixels))
    with torch.no_grad():
        ref_feats = hf.model.get_image_features(pixel_values=torch.as_tensor(pixels)).pooler_output.numpy()
    chex.assert_shape(feats, (sum(tiles), PER_TILE, 48))
    np.testing.assert_allclose(feats, ref_feats, atol=5e-6 * np.abs(ref_feats).max(), rtol=0)  # features are O(20)

    ids = prompt_ids(tiles)
    ours = model.logits(ids, pixels)
    ref = hf_logits(hf, ids, pixels)
    assert ours.shape == ref.shape and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, atol=FP32_TOL, rtol=0)
    # The tiles matter: other pixels move the logits by far more than the tolerance.
    assert np.abs(model.logits(ids, other_pixels) - ours).max() > 1000 * FP32_TOL


def test_qwen2_text_only_matches_hf(tmp_path):
    """A plain Qwen2ForCausalLM folder: the Llama decoder with q/k/v biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2)).eval()
    with torch.no_grad():  # biases are zero and embeddings/head 0.02-wide at init: widen them for signal
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "embed" in name or "lm_head" in name:
                p.normal_(0, 1.0)
    hf.save_pretrained(str(tmp_path))
    model = lookm_jax.load(str(tmp_path))
    assert model.text_config.qkv_bias and not model.is_multimodal
    chex.assert_shape([lp["b_qkv"] for lp in model.params["text"]["layers"]], [(2, 4 + 2, 8)] * 2)  # [Hkv, G + 2, D]
    ids = np.random.default_rng(0).integers(0, VOCAB, (1, 40))
    with torch.no_grad():
        ref = hf(input_ids=torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(model.logits(ids), ref, atol=FP32_TOL, rtol=0)


# ---- preprocessing and prompt expansion against HF's image processor and InternVLProcessor ----------

def _images(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


# (height, width): 1 tile; 3 x 1 and 1 x 3 grids; a square at the area tie (2 x 2); odd shapes.
SIZES = [(30, 31), (40, 100), (90, 30), (56, 56), (57, 200), (300, 41), (13, 29), (120, 119)]


def test_tiles_equal_hf_image_processor():
    from transformers import GotOcr2ImageProcessorPil

    hf = GotOcr2ImageProcessorPil(size={"height": TILE, "width": TILE}, max_patches=6, **IMAGENET)
    config = InternVLImageProcessorConfig.from_hf_dict(json.loads(hf.to_json_string()))
    assert (config.tile_size, config.max_tiles, config.image_mean) == (TILE, 6, tuple(IMAGENET["image_mean"]))
    images = _images(SIZES)
    want = hf(images=images, crop_to_patches=True, return_tensors="np")  # what InternVLProcessor passes
    pixels, tiles = preprocess_tiles(images, config)
    assert tiles == want["num_patches"].tolist() and 1 in tiles and max(tiles) > 2
    chex.assert_shape(pixels, (sum(tiles), 3, TILE, TILE))
    np.testing.assert_array_equal(pixels, want["pixel_values"])  # bit-equal


def test_preprocessor_config_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="do_pad_to_square"):
        InternVLImageProcessorConfig.from_hf_dict({"image_processor_type": "GotOcr2ImageProcessor",
                                                   "do_pad_to_square": True})
    with pytest.raises(ValueError, match="size"):
        InternVLImageProcessorConfig.from_hf_dict({"image_processor_type": "GotOcr2ImageProcessor",
                                                   "size": {"height": 448, "width": 224}})
    with pytest.raises(ValueError, match="CLIPImageProcessor"):
        InternVLImageProcessorConfig.from_hf_dict({"image_processor_type": "CLIPImageProcessor"})


def _hf_processor():
    from transformers import GotOcr2ImageProcessorPil, InternVLProcessor, PreTrainedTokenizerFast

    class ImagesOnly(InternVLProcessor):  # the video processor needs torchvision, which is not installed
        def check_argument_for_proper_class(self, name, arg):
            return None if name == "video_processor" else super().check_argument_for_proper_class(name, arg)

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer(), extra_special_tokens={
        "start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>"})
    image_processor = GotOcr2ImageProcessorPil(size={"height": TILE, "width": TILE}, max_patches=4, **IMAGENET)
    return ImagesOnly(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=PER_TILE)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_internvl")
    return tiny_internvl(folder, norm="rms_norm", qk_norm=False), lookm_jax.load(str(folder))


@pytest.fixture(scope="module")
def chat(tiny):
    """One prompt, two images (1 tile; 2 x 1 tiles + thumbnail), through HF's processor and through ours."""
    images = _images([(30, 31), (40, 100)], seed=1)
    want = _hf_processor()(images=images, text="<IMG_CONTEXT>\n<IMG_CONTEXT>\nwhat is this", return_tensors="np")
    pixels, tiles = preprocess_tiles(images, InternVLImageProcessorConfig(tile_size=TILE, max_tiles=4))
    ids = tiny[1].encode_chat("what is this", num_images=2, image_tiles=tiles)
    return want, ids, pixels, tiles


def test_encode_chat_and_tiles_equal_hf_processor(chat):
    want, ids, pixels, tiles = chat
    assert tiles == [1, 3]
    np.testing.assert_array_equal(ids, want["input_ids"])
    np.testing.assert_array_equal(pixels, want["pixel_values"])
    assert (ids == IMAGE_TOKEN).sum() == 4 * PER_TILE and (ids == IMG_START).sum() == 2


def test_encode_chat_needs_one_tile_count_per_image(tiny):
    model = tiny[1]
    with pytest.raises(ValueError, match="2 <image> marker"):
        model.encode_chat("what", num_images=2, image_tiles=[1])
    with pytest.raises(ValueError, match="1 <image> marker"):
        model.encode_chat("what", num_images=1)
    assert IMAGE_TOKEN not in model.encode_chat("what is this")


def test_greedy_generation_matches_hf(tiny, chat):
    hf, model = tiny
    want, ids, pixels, _ = chat
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.as_tensor(want["input_ids"]), pixel_values=torch.as_tensor(pixels),
                          attention_mask=torch.as_tensor(want["attention_mask"]), max_new_tokens=NEW_TOKENS,
                          do_sample=False).numpy()[:, ids.shape[1]:]
    np.testing.assert_array_equal(model.generate(ids, pixels, max_new_tokens=NEW_TOKENS), ref)


def test_a_question_asked_after_the_tiled_context_equals_run(tiny, chat):
    """`ask` after `prefill_context` (two images, 1 and 3 tiles) equals `run` on the whole prompt:
    tokens, and the first token's logits against the full forward (1e-5)."""
    model = tiny[1]
    _, ids, pixels, _ = chat
    context, question = ids[:, :-3], ids[:, -3:]
    answer = model.ask(model.prefill_context(context, pixels), question, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(answer.tokens, model.run(ids, pixels, max_new_tokens=NEW_TOKENS).tokens)
    np.testing.assert_allclose(answer.logits, model.logits(ids, pixels)[:, -1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", [name for name, _ in DEFAULTS])
def test_every_method_runs_with_modality_counts_from_the_splice(tiny, chat, name):
    model = tiny[1]
    _, ids, pixels, tiles = chat
    length = ids.shape[1]
    n_image = sum(tiles) * PER_TILE
    method = build(name, {}, budget=0.5)
    result = model.run(ids, pixels, max_new_tokens=NEW_TOKENS, method=method)
    assert result.image_tokens[0] == n_image and result.prompt_lengths[0] == length
    kept = length if name == "full" else sum(method.bucket_slots(length))  # the method's own M + N of this prompt
    assert result.kept_image_tokens[0] + result.kept_text_tokens[0] == kept
    if name in ("full", "lookm"):  # full keeps everything; LOOK-M's text prior keeps every text token
        assert result.kept_text_tokens[0] == length - n_image
    assert (result.cache_bytes < result.full_cache_bytes) == (name != "full")
    chex.assert_shape(result.tokens, (1, NEW_TOKENS))


# ---- config handling ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_config_dict(tmp_path_factory):
    folder = tmp_path_factory.mktemp("config_only")
    from transformers import InternVLConfig as HFInternVLConfig

    HFInternVLConfig(text_config={"model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": 48,
                                  "intermediate_size": 80, "num_hidden_layers": 1, "num_attention_heads": 4,
                                  "num_key_value_heads": 2},
                     vision_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
                                    "image_size": TILE, "patch_size": PATCH},
                     image_token_id=IMAGE_TOKEN, image_seq_length=PER_TILE).save_pretrained(str(folder))
    return json.loads((folder / "config.json").read_text())


REFUSED = [
    ("mystery_field", 1, "mystery_field"),
    ("vision_config.use_mean_pooling", False, "use_mean_pooling"),
    ("vision_config.hidden_act", "relu", "hidden_act"),
    ("vision_config.norm_type", "batch_norm", "norm_type"),
    ("vision_config.image_size", [56, 28], "image_size"),
    ("vision_feature_select_strategy", "full", "vision_feature_select_strategy"),
    ("vision_feature_layer", [-1, -2], "vision_feature_layer"),
    ("downsample_ratio", 0.3, "downsample_ratio"),
    ("image_seq_length", 256, "image_seq_length"),
    ("text_config.use_sliding_window", True, "use_sliding_window"),
    ("text_config.new_knob", 3, "new_knob"),
]


def test_parsed_config(hf_config_dict):
    cfg = InternVLConfig.from_hf(hf_config_dict)
    assert cfg.image_token_id == IMAGE_TOKEN and cfg.shuffle == 2 and cfg.vision.grid == TILE // PATCH
    assert cfg.text.qkv_bias and cfg.text.tie_word_embeddings  # qwen2; HF's top-level default ties
    assert cfg.pixel_shape == (3, TILE, TILE) and cfg.image_seq_length == PER_TILE


@pytest.mark.parametrize("path,value,named", REFUSED, ids=[r[0] for r in REFUSED])
def test_unsupported_config_refused_naming_the_field(hf_config_dict, path, value, named):
    with pytest.raises(ConfigError, match=named):
        InternVLConfig.from_hf(with_field(hf_config_dict, path, value))


def test_load_refuses_unsupported_config_folder(tmp_path, hf_config_dict):
    (tmp_path / "config.json").write_text(json.dumps(with_field(hf_config_dict, "vision_config.use_qk_norm_v2", True)))
    with pytest.raises(ConfigError, match="use_qk_norm_v2"):
        lookm_jax.load(str(tmp_path))


def test_legacy_image_token_index_alone_does_not_set_the_image_token(hf_config_dict):
    from transformers import InternVLConfig as HFInternVLConfig

    legacy = {k: v for k, v in hf_config_dict.items() if k != "image_token_id"} | {"image_token_index": 5}
    hf = HFInternVLConfig(**{k: v for k, v in legacy.items() if k not in ("model_type", "transformers_version")})
    cfg = InternVLConfig.from_hf(legacy)
    assert cfg.image_token_id == hf.image_token_id != 5


def test_key_layouts_and_converted_round_trip_give_the_same_params(tiny, tmp_path):
    """Hub files (language_model.model.*, vision_tower.*) and transformers 5.x names (model.language_model.*,
    model.vision_tower.*, model.multi_modal_projector.*) convert alike; `save` + `load` keeps everything."""
    import shutil

    from safetensors.numpy import load_file, save_file

    model = tiny[1]
    source = model.manifest["source"]
    renames = {"language_model.model.": "model.language_model.", "vision_tower.": "model.vision_tower.",
               "multi_modal_projector.": "model.multi_modal_projector."}
    tensors = load_file(f"{source}/model.safetensors")
    assert all(any(k.startswith(old) for old in renames) for k in tensors)  # what save_pretrained writes
    renamed = {next(new + k[len(old):] for old, new in renames.items() if k.startswith(old)): v
               for k, v in tensors.items()}
    (tmp_path / "v5").mkdir()
    shutil.copy(f"{source}/config.json", tmp_path / "v5")
    save_file(renamed, str(tmp_path / "v5" / "model.safetensors"), metadata={"format": "pt"})
    chex.assert_trees_all_equal(lookm_jax.load(str(tmp_path / "v5")).params, model.params)

    model.save(str(tmp_path / "converted"))
    again = lookm_jax.load(str(tmp_path / "converted"))
    assert again.config == model.config
    chex.assert_trees_all_equal(again.params, model.params)


def test_checkpoint_missing_a_tower_tensor_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    tiny_internvl(tmp_path, norm="layer_norm", qk_norm=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    dropped = next(k for k in tensors if k.endswith("layer.1.attention.k_norm.weight"))
    save_file({k: v for k, v in tensors.items() if k != dropped}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="k_norm"):
        lookm_jax.load(str(tmp_path))


def test_cli_generate_tiles_images_from_the_checkpoint_preprocessor(tmp_path, capsys):
    """`lookm generate --model DIR --image ...` on an InternVL folder: tiles from its own preprocessor_config."""
    from lookm_jax.cli import main

    tiny_internvl(tmp_path, norm="rms_norm", qk_norm=False)
    _hf_processor().image_processor.save_pretrained(tmp_path)
    paths = []
    for i, image in enumerate(_images([(30, 31), (40, 100)], seed=1)):
        paths.append(str(tmp_path / f"image{i}.png"))
        image.save(paths[-1])
    argv = ["generate", "--model", str(tmp_path), "--prompt", "what is this", "--max-new-tokens", "2"]
    assert main(argv + [arg for p in paths for arg in ("--image", p)]) == 0
    out = capsys.readouterr().out
    assert f"({4 * PER_TILE} image," in out, out  # tiles [1, 3] x 16 tokens, as the HF processor makes them
