"""MobileVLM-v2 (no transformers class): a PyTorch reference written from the model's facts, tiny checkpoints
with the exact original key names, round-tripped through `lookm_jax.load`."""

from __future__ import annotations

import json
import math

import chex
import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

import lookm_jax
from lookm_jax import get_method
from lookm_jax.convert.hf import parse_config
from lookm_jax.models import mobilevlm
from lookm_jax.models.config import ConfigError
from lookm_jax.models.image_processing import CLIP_MEAN, CLIP_STD, CLIPImageProcessorConfig, preprocess_images
from original_layout import IMAGE_TOKEN_INDEX, expand, prefixed, reference_logits, save_checkpoint, tiny_llama, widen

TOL = 1e-5
GRID = 8  # tiny tower: 48 px in 6 px patches -> 8 x 8 -> pooled 4 x 4 = 16 tokens


class LDPv2(nn.Module):
    """MobileVLM's LDPNetV2Projector, module names as in its checkpoints (mlp.mlp.*, peg.peg.*)."""

    def __init__(self, inc: int, ouc: int, pooled: int):
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.mlp = nn.Sequential(nn.Linear(inc, ouc), nn.GELU(), nn.Linear(ouc, ouc))
        self.peg = nn.Module()
        self.peg.peg = nn.Sequential(nn.Conv2d(ouc, ouc, 3, 1, 1, bias=True, groups=ouc))
        self.pooled = pooled

    def forward(self, x):  # [b, G*G, inc] -> [b, pooled^2, ouc]
        x = self.mlp.mlp(x)
        b, n, c = x.shape
        side = int(math.sqrt(n))
        x = F.adaptive_avg_pool2d(x.permute(0, 2, 1).reshape(b, c, side, side), (self.pooled, self.pooled))
        x = self.peg.peg(x) + x
        return x.flatten(2).transpose(1, 2)


def _ldp_params(ref: LDPv2) -> dict:
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    return {"w1": sd["mlp.mlp.0.weight"].T, "b1": sd["mlp.mlp.0.bias"], "w2": sd["mlp.mlp.2.weight"].T,
            "b2": sd["mlp.mlp.2.bias"], "peg_w": sd["peg.peg.0.weight"][:, 0].transpose(1, 2, 0),
            "peg_b": sd["peg.peg.0.bias"]}


def test_ldp_v2_matches_torch_on_the_real_24x24_grid():
    """576 patch features -> 144 tokens: 2x2/stride-2 pooling equals the original's adaptive pool to 12x12."""
    torch.manual_seed(0)
    ref = LDPv2(24, 40, 12).eval()
    with torch.no_grad():
        ref.peg.peg[0].weight.normal_(0, 0.5)
    x = torch.randn(2, 576, 24)
    with torch.no_grad():
        expected = ref(x).numpy()
    ours = np.asarray(mobilevlm.ldp_v2(_ldp_params(ref), x.numpy(), 24))
    chex.assert_shape(ours, (2, 144, 40))
    np.testing.assert_allclose(ours, expected, atol=TOL, rtol=0)


def _config(tower_dir, text: dict) -> dict:
    """A MobileVLM_V2 config.json: flat Llama fields, mm_* keys, training switches and stale lit-gpt keys."""
    return {**text, "model_type": "mobilevlm", "architectures": ["MobileLlamaForCausalLM"],
            "mm_vision_tower": str(tower_dir), "vision_tower_type": "clip", "mm_projector_type": "ldpnetv2",
            "mm_hidden_size": 32, "mm_vision_select_layer": -2, "mm_vision_select_feature": "patch",
            "image_aspect_ratio": "pad", "mm_use_im_start_end": False, "mm_use_im_patch_token": False,
            "mm_projector_lr": None, "tune_mm_mlp_adapter": False, "freeze_mm_mlp_adapter": False,
            "use_mm_proj": True, "image_grid_pinpoints": None, "max_sequence_length": 2048,
            "n_head": 999, "n_query_groups": 999, "norm_eps": 0.5}  # stale: must not be read


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(lookm model, reference LM, CLIP tower, LDPv2) of a tiny MobileVLM-v2 checkpoint."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    root = tmp_path_factory.mktemp("mobilevlm")
    lm, text = tiny_llama(seed=1)
    torch.manual_seed(2)
    tower_cfg = CLIPVisionConfig(hidden_size=32, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
                                 image_size=GRID * 6, patch_size=6)
    tower = CLIPVisionModel(tower_cfg).eval()
    widen(tower)
    tower_cfg.save_pretrained(str(root / "clip_tower"))
    projector = LDPv2(32, 48, GRID // 2).eval()
    tensors = {**lm.state_dict(), **prefixed("model.vision_tower.vision_tower.", tower.state_dict()),
               **prefixed("model.mm_projector.", projector.state_dict())}
    save_checkpoint(root / "ckpt", tensors, _config(root / "clip_tower", text))
    return lookm_jax.load(str(root / "ckpt")), lm, tower, projector


def _reference_features(tower, projector, pixels: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        states = tower(torch.as_tensor(pixels), output_hidden_states=True).hidden_states
        return projector(states[-2][:, 1:])


def test_config_and_features(tiny):
    model, _, tower, projector = tiny
    cfg = model.config
    assert isinstance(cfg, mobilevlm.MobileVLMConfig)
    assert (cfg.image_token_id, cfg.image_seq_length, cfg.pixel_shape) == (IMAGE_TOKEN_INDEX, 16, (3, 48, 48))
    assert (cfg.text.num_heads, cfg.text.num_kv_heads, cfg.text.rms_norm_eps) == (4, 2, 1e-6)  # HF names win
    pixels = np.random.default_rng(0).standard_normal((2, 3, 48, 48)).astype(np.float32)
    ours = np.asarray(jax.jit(mobilevlm.image_features, static_argnums=0)(cfg, model.params, pixels))
    chex.assert_shape(ours, (2, 16, 48))
    np.testing.assert_allclose(ours, _reference_features(tower, projector, pixels).numpy(), atol=TOL, rtol=0)


def test_logits_match_reference_with_minus_200_placeholders(tiny):
    model, lm, tower, projector = tiny
    ids = [1, 5, IMAGE_TOKEN_INDEX, 6, 7, IMAGE_TOKEN_INDEX, 8, 9]
    pixels = np.random.default_rng(1).standard_normal((2, 3, 48, 48)).astype(np.float32)
    ref = reference_logits(lm, ids, _reference_features(tower, projector, pixels))
    ours = model.logits(expand(ids, 16), pixels)[0]
    assert ours.shape == ref.shape == (6 + 2 * 16, 64)
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


def test_survives_save(tiny, tmp_path):
    model = tiny[0]
    model.save(str(tmp_path / "converted"))  # passes the converted folder's shape check
    again = lookm_jax.load(str(tmp_path / "converted"))
    assert again.config == model.config
    chex.assert_trees_all_equal(again.params, model.params)


def test_lookm_generates_with_text_prior_from_the_splice(tiny):
    """L = 7 text + 16 image; budget 0.5 keeps 5 recent + 5 important: all 7 text tokens win over image."""
    model, *_ = tiny
    ids = expand([1, 5, IMAGE_TOKEN_INDEX, 6, 7, 8, 9, 10], 16)
    pixels = np.random.default_rng(2).standard_normal((1, 3, 48, 48)).astype(np.float32)
    result = model.run(ids, pixels, max_new_tokens=3, method=get_method("lookm", budget=0.5))
    assert int(result.image_tokens[0]) == 16 and int(result.prompt_lengths[0]) == 23
    assert (result.kept_text_tokens[0], result.kept_image_tokens[0]) == (7.0, 3.0)
    assert result.cache_bytes < result.full_cache_bytes
    chex.assert_shape(result.tokens, (1, 3))


def test_preprocessing_pads_with_the_clip_mean_colour(tiny):
    model, *_ = tiny
    processor = CLIPImageProcessorConfig.from_hf_dict(model.manifest["image_processor"])
    assert processor.image_aspect_ratio == "pad" and processor.crop_height == 48
    wide = Image.new("RGB", (96, 48), (255, 0, 0))  # 2:1 -> padded to 96 x 96, image in the middle rows
    pixels = preprocess_images([wide], processor)
    fill = (np.asarray((122, 116, 104), np.float64) / 255 - CLIP_MEAN) / CLIP_STD
    np.testing.assert_allclose(pixels[0, :, 0, 0], fill, atol=1e-5)  # top band: the fill colour
    red = (np.asarray((1.0, 0, 0)) - CLIP_MEAN) / CLIP_STD
    np.testing.assert_allclose(pixels[0, :, 24, 24], red, atol=1e-5)  # centre: the image


def _tiny_config(tmp_path, **overrides) -> dict:
    from transformers import CLIPVisionConfig

    CLIPVisionConfig(hidden_size=32, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
                     image_size=48, patch_size=6).save_pretrained(str(tmp_path / "tower"))
    with open(tmp_path / "tower" / "config.json") as f:
        tower = json.load(f)
    _, text = tiny_llama()
    return {**_config(tmp_path / "tower", text), "vision_config": tower, **overrides}


@pytest.mark.parametrize("field,value", [("mm_projector_type", "ldpnet"), ("mm_vision_select_feature", "cls_patch"),
                                         ("mm_use_im_start_end", True), ("image_aspect_ratio", "anyres"),
                                         ("mm_hidden_size", 64), ("vision_tower_type", "siglip"),
                                         ("some_new_switch", 1)])
def test_unsupported_fields_are_refused_by_name(tmp_path, field, value):
    with pytest.raises(ConfigError, match=field):
        parse_config(_tiny_config(tmp_path, **{field: value}))
