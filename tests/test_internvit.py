"""InternVL-Chat-ViT-6B-Vicuna (LLaVA-1.5 layout with an InternViT-6B tower; no transformers class): a
PyTorch reference written from the model's facts, tiny checkpoints with the exact original key names,
round-tripped through `lookm_jax.load`."""

from __future__ import annotations

import json

import chex
import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lookm_jax
from lookm_jax import get_method
from lookm_jax.convert.hf import parse_config
from lookm_jax.convert.original_llava import internvit_llava_params
from lookm_jax.convert.tables import ShapesOnly, accepted_shapes
from lookm_jax.models import internvit
from lookm_jax.models.config import ConfigError, LlamaConfig
from lookm_jax.models.image_processing import IMAGENET_MEAN, CLIPImageProcessorConfig
from original_layout import IMAGE_TOKEN_INDEX, expand, prefixed, reference_logits, save_checkpoint, tiny_llama, widen

TOL = 1e-5
# Tiny tower pretrained at 252 px in 84 px patches (3 x 3 position grid), run at InternVL's 336 px (4 x 4).
TOWER = {"model_type": "intern_vit_6b", "architectures": ["InternVisionModel"], "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 5, "num_attention_heads": 4, "image_size": 252,
         "patch_size": 84, "num_channels": 3, "layer_norm_eps": 1e-6, "qkv_bias": False, "qk_normalization": True,
         "hidden_act": "gelu", "norm_type": "rms_norm", "use_flash_attn": False, "drop_path_rate": 0.0,
         "initializer_factor": 0.1, "initializer_range": 1e-10, "dropout": 0.0, "attention_dropout": 0.0}


# ---- the reference: InternVisionModel as the facts describe it ------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        width, self.heads, self.qk_norm = c["hidden_size"], c["num_attention_heads"], c["qk_normalization"]
        self.qkv = nn.Linear(width, 3 * width, bias=c["qkv_bias"])  # fused [Q | K | V]
        if self.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(width, c["layer_norm_eps"]), RMSNorm(width, c["layer_norm_eps"])
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        if self.qk_norm:  # over the full width, before the head split
            q = self.q_norm(q.transpose(1, 2).flatten(-2)).view(b, n, self.heads, -1).transpose(1, 2)
            k = self.k_norm(k.transpose(1, 2).flatten(-2)).view(b, n, self.heads, -1).transpose(1, 2)
        attn = ((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class Layer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        width = c["hidden_size"]
        self.attn = Attention(c)
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(width, c["intermediate_size"]), nn.Linear(c["intermediate_size"], width)
        self.norm1, self.norm2 = RMSNorm(width, c["layer_norm_eps"]), RMSNorm(width, c["layer_norm_eps"])
        self.ls1, self.ls2 = nn.Parameter(torch.ones(width)), nn.Parameter(torch.ones(width))

    def forward(self, h):
        h = h + self.attn(self.norm1(h)) * self.ls1
        return h + self.mlp.fc2(F.gelu(self.mlp.fc1(self.norm2(h)))) * self.ls2


class InternViT(nn.Module):
    """State-dict names as InternVisionModel's: embeddings.{class_embedding, position_embedding,
    patch_embedding.*}, encoder.layers.{i}.*."""

    def __init__(self, c: dict):
        super().__init__()
        width, self.grid0 = c["hidden_size"], c["image_size"] // c["patch_size"]
        self.embeddings = nn.Module()
        self.embeddings.class_embedding = nn.Parameter(torch.randn(1, 1, width))
        self.embeddings.patch_embedding = nn.Conv2d(3, width, c["patch_size"], c["patch_size"])
        self.embeddings.position_embedding = nn.Parameter(torch.randn(1, self.grid0**2 + 1, width))
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))

    def forward(self, pixels) -> list[torch.Tensor]:
        e = self.embeddings
        x = e.patch_embedding(pixels)
        b, width, gh, gw = x.shape
        pos = e.position_embedding[:, 1:].reshape(1, self.grid0, self.grid0, width).permute(0, 3, 1, 2)
        pos = F.interpolate(pos.float(), size=(gh, gw), mode="bicubic", align_corners=False)
        pos = torch.cat([e.position_embedding[:, :1], pos.reshape(1, width, gh * gw).permute(0, 2, 1)], dim=1)
        h = torch.cat([e.class_embedding.expand(b, 1, -1), x.flatten(2).transpose(1, 2)], dim=1) + pos
        states = [h]
        for layer in self.encoder.layers:
            h = layer(h)
            states.append(h)
        return states


def _tower(config: dict, seed: int) -> InternViT:
    torch.manual_seed(seed)
    tower = InternViT(config).eval()
    widen(tower)
    return tower


# ---- tests ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("g0,g", [(16, 24), (4, 8), (5, 3), (6, 6)])
def test_position_interpolation_matches_torch_bicubic(g0, g):
    grid = torch.randn(1, 8, g0, g0)
    expected = F.interpolate(grid, size=(g, g), mode="bicubic", align_corners=False)[0].permute(1, 2, 0)
    cfg = internvit.InternViTConfig.from_hf({**TOWER, "patch_size": 1, "image_size": g0}, image_size=g)
    pos = np.concatenate([np.ones((1, 8), np.float32), grid[0].permute(1, 2, 0).reshape(g0 * g0, 8).numpy()])
    ours = np.asarray(internvit.position_embeddings(cfg, pos))
    chex.assert_shape(ours, (g * g + 1, 8))
    np.testing.assert_array_equal(ours[0], 1.0)  # the CLS row is not interpolated
    np.testing.assert_allclose(ours[1:], expected.reshape(g * g, 8).numpy(), atol=TOL, rtol=0)


def test_tower_variant_with_resized_position_embeddings_matches_reference():
    """qkv bias on, q/k norm off (the released tower is the opposite: see test_config_manifest_and_features),
    and position embeddings already resized to the 336 px grid (InternVL's resize_pos_embeddings): used as is."""
    config = {**TOWER, "qk_normalization": False, "qkv_bias": True}
    tower = _tower({**config, "image_size": 336}, seed=3)
    cfg = internvit.InternViTLlavaConfig(text=LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=80,
                                                          num_layers=2, num_heads=4, num_kv_heads=2, head_dim=12),
                                         vision=internvit.InternViTConfig.from_hf(config, image_size=336),
                                         image_token_id=IMAGE_TOKEN_INDEX)
    rng = np.random.default_rng(0)
    tensors = {"vision." + k: v.detach().numpy() for k, v in tower.state_dict().items()}
    tensors.update({"projector.linear_1.weight": rng.standard_normal((48, 32)),
                    "projector.linear_1.bias": rng.standard_normal(48),
                    "projector.linear_2.weight": rng.standard_normal((48, 48)),
                    "projector.linear_2.bias": rng.standard_normal(48)})
    params = internvit_llava_params(cfg, tensors, np.float32)
    assert not tensors  # every tensor is mapped
    expected = internvit_llava_params(cfg, ShapesOnly(), np.float32)  # what a converted folder's check accepts
    assert params["vision"]["pos_embed"].shape in accepted_shapes(expected["vision"]["pos_embed"])
    pixels = rng.standard_normal((2, 3, 336, 336)).astype(np.float32)
    ours = np.asarray(jax.jit(internvit.hidden_states, static_argnums=(0, 3))(cfg.vision, params["vision"], pixels, 5))
    with torch.no_grad():
        ref = torch.stack(tower(torch.as_tensor(pixels))).numpy()
    chex.assert_shape(ours, (6, 2, 17, 32))
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


def _config(tower_dir, text: dict) -> dict:
    """An InternVL-Chat-ViT-6B-Vicuna config.json: LLaVA-1.5's original layout with an InternViT tower."""
    return {**text, "model_type": "llava", "architectures": ["LlavaLlamaForCausalLM"],
            "mm_vision_tower": str(tower_dir), "mm_projector_type": "mlp2x_gelu", "mm_hidden_size": 32,
            "mm_vision_select_layer": -4, "mm_vision_select_feature": "patch", "image_aspect_ratio": "pad",
            "mm_use_im_start_end": False, "mm_use_im_patch_token": False, "tune_mm_mlp_adapter": False,
            "freeze_mm_mlp_adapter": False, "use_mm_proj": True, "tokenizer_model_max_length": 2048,
            "tokenizer_padding_side": "right"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(lookm model, reference LM, tower, projector) of a tiny InternVL-Chat-ViT-6B-Vicuna checkpoint."""
    root = tmp_path_factory.mktemp("internvit_llava")
    lm, text = tiny_llama(seed=4, rms_norm_eps=1e-5)
    tower = _tower(TOWER, seed=5)
    (root / "intern_vit_6b_tiny").mkdir()
    with open(root / "intern_vit_6b_tiny" / "config.json", "w") as f:
        json.dump(TOWER, f)
    torch.manual_seed(6)
    projector = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 48)).eval()
    tensors = {**lm.state_dict(), **prefixed("model.vision_tower.vision_tower.", tower.state_dict()),
               **prefixed("model.mm_projector.", projector.state_dict())}
    save_checkpoint(root / "ckpt", tensors, _config(root / "intern_vit_6b_tiny", text))
    return lookm_jax.load(str(root / "ckpt")), lm, tower, projector


def _reference_features(tower, projector, pixels):
    with torch.no_grad():
        return projector(tower(torch.as_tensor(pixels))[-4][:, 1:])


def test_config_manifest_and_features(tiny):
    model, _, tower, projector = tiny
    cfg = model.config
    assert isinstance(cfg, internvit.InternViTLlavaConfig)
    assert (cfg.image_token_id, cfg.image_seq_length, cfg.pixel_shape) == (IMAGE_TOKEN_INDEX, 16, (3, 336, 336))
    assert (cfg.vision.pretrain_grid, cfg.vision_feature_layer) == (3, -4)
    processor = CLIPImageProcessorConfig.from_hf_dict(model.manifest["image_processor"])
    assert (processor.crop_height, processor.image_mean, processor.image_aspect_ratio) == (336, IMAGENET_MEAN, "pad")
    pixels = np.random.default_rng(1).standard_normal((2, 3, 336, 336)).astype(np.float32)
    ours = np.asarray(jax.jit(internvit.image_features, static_argnums=0)(cfg, model.params, pixels))
    ref = _reference_features(tower, projector, pixels).numpy()
    chex.assert_shape(ours, (2, 16, 48))
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


def test_logits_match_reference_and_survive_save(tiny, tmp_path):
    model, lm, tower, projector = tiny
    ids = [1, 7, IMAGE_TOKEN_INDEX, 9, 10, 11]
    pixels = np.random.default_rng(2).standard_normal((1, 3, 336, 336)).astype(np.float32)
    ref = reference_logits(lm, ids, _reference_features(tower, projector, pixels))
    ours = model.logits(expand(ids, 16), pixels)[0]
    assert ours.shape == ref.shape == (5 + 16, 64)
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)
    model.save(str(tmp_path / "converted"))  # the tower config travels in the manifest
    np.testing.assert_array_equal(lookm_jax.load(str(tmp_path / "converted")).logits(expand(ids, 16), pixels)[0], ours)


def test_lookm_generates_with_text_prior_from_the_splice(tiny):
    """L = 6 text + 16 image; budget 0.5 keeps 5 recent + 5 important: all text and 4 image tokens."""
    model, *_ = tiny
    ids = expand([1, 7, IMAGE_TOKEN_INDEX, 9, 10, 11, 12], 16)
    pixels = np.random.default_rng(3).standard_normal((1, 3, 336, 336)).astype(np.float32)
    result = model.run(ids, pixels, max_new_tokens=3, method=get_method("lookm", budget=0.5))
    assert int(result.image_tokens[0]) == 16 and int(result.prompt_lengths[0]) == 22
    assert (result.kept_text_tokens[0], result.kept_image_tokens[0]) == (6.0, 4.0)
    chex.assert_shape(result.tokens, (1, 3))


@pytest.mark.parametrize("field,value", [("norm_type", "layer_norm"), ("hidden_act", "relu"),
                                         ("use_mask_token", True)])
def test_unsupported_tower_fields_are_refused_by_name(field, value):
    _, text = tiny_llama()
    config = {**_config("intern_vit_6b_not_a_folder", text), "vision_config": {**TOWER, field: value}}
    with pytest.raises(ConfigError, match=field):
        parse_config(config)


def test_known_tower_name_gives_the_real_internvit_6b():
    """The released config names its tower by a path like ./pretrained/intern_vit_6b_224px."""
    _, text = tiny_llama()
    cfg = parse_config({**_config("./pretrained/intern_vit_6b_224px", text), "mm_hidden_size": 3200})
    v = cfg.vision
    assert (v.hidden_size, v.num_layers, v.num_heads, v.pretrain_grid, v.image_size) == (3200, 48, 25, 16, 336)
    assert cfg.image_seq_length == 576
