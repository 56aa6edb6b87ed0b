"""Qwen2-VL (transformers `Qwen2VLForConditionalGeneration`): a ViT over dynamic-resolution images,
a 2 x 2 patch merger, and a Qwen2 decoder with M-RoPE.

An image of h x w patches (its grid, from `qwen2_vl_processing.smart_resize`) is h*w flattened
patches of C x T x p x p pixels (T = temporal_patch_size: a picture is repeated T times), ordered
so that each m x m merge window (m = spatial_merge_size) is m*m consecutive patches. The tower
embeds them (a bias-free Conv3d as one matrix), rotates q/k by 2-D RoPE (each patch's row and
column) and attends within each image only; the merger LayerNorms every patch, concatenates each
window's m*m patches and maps them by Linear -> GELU -> Linear to one token: h*w / m^2 tokens.

M-RoPE: every prompt token has three positions (time, height, width). Text advances all three by
one; an image's tokens share the time position s (the text position where the image starts) and
take height s + row, width s + column (in merged units), and the text after it resumes at
s + max(rows, cols). A row's first new token is at max position + 1, which is the cache's
`next_position`; decoded tokens are text, whose three positions are equal: plain RoPE.

Params: {"text": llama params, "vision": ..., "projector": ...}; vision (blocks stacked on N):
    patch_embed [C*T*p*p, Hv]; layers: norm1_w/norm1_b, norm2_w/norm2_b [N, Hv], w_qkv [N, Hv, 3*Hv],
    b_qkv [N, 3*Hv], wo [N, Hv, Hv], bo [N, Hv], fc1_w [N, Hv, I], fc1_b [N, I], fc2_w [N, I, Hv],
    fc2_b [N, Hv]. projector (the merger): norm_w/norm_b [Hv], w1 [m*m*Hv, m*m*Hv], b1 [m*m*Hv],
    w2 [m*m*Hv, H], b2 [H].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax.errors import InputError
from lookm_jax.models.config import ConfigError, LlamaConfig, _check_fields, _require
from lookm_jax.models.layers import gelu_exact, layer_norm, linear, quick_gelu
from lookm_jax.models.llama import apply_rope, attend

NORM_EPS = 1e-6  # the tower's and the merger's LayerNorms (HF hard-codes it)
VISION_ROPE_THETA = 10000.0  # HF's axial RoPE of the tower (its config carries no theta)
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
IMAGE_MARKER = "<image>"  # what a prompt writes where an image goes (as for the other architectures)
_ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": gelu_exact}
# Defaults of HF's Qwen2VLTextConfig (Qwen2-VL-72B's sizes): a config omitting a field means these.
_TEXT_DEFAULTS = {"vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
                  "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 32768,
                  "rms_norm_eps": 1e-5, "bos_token_id": 151643, "eos_token_id": 151645}
_TEXT_FIELDS = set(_TEXT_DEFAULTS) | {
    "hidden_act", "rope_parameters", "rope_scaling", "rope_theta", "use_sliding_window", "sliding_window",
    "max_window_layers", "tie_word_embeddings", "head_dim"}
# Token ids transformers 4.5x saved into text_config too; the decoder reads none of them.
_TEXT_IGNORED = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                 "vision_token_id")


@dataclasses.dataclass(frozen=True)
class Qwen2VLVisionConfig:
    depth: int = 32
    embed_dim: int = 1280
    hidden_size: int = 3584  # the merger's output: the decoder's width
    mlp_ratio: float = 4
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    hidden_act: str = "quick_gelu"
    OUTPUT_FIELD = "hidden_size"  # the config field of the merger's output width

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def output_size(self) -> int:
        return self.hidden_size

    @property
    def mlp_dim(self) -> int:
        return int(self.embed_dim * self.mlp_ratio)

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch: C x T x p x p."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "vision_config") -> "Qwen2VLVisionConfig":
        _require(d.get("model_type", "qwen2_vl_vision") in ("qwen2_vl_vision", "qwen2_vl"), where, "model_type",
                 d.get("model_type"), "'qwen2_vl_vision'")
        handled = {"depth", "embed_dim", "hidden_size", "mlp_ratio", "num_heads", "in_channels", "in_chans",
                   "patch_size", "spatial_patch_size", "spatial_merge_size", "temporal_patch_size", "hidden_act",
                   "rope_parameters"}
        _check_fields(d, handled, where)
        rope = d.get("rope_parameters") or {}
        _require(rope.get("rope_type", "axial") == "axial" and float(rope.get("rope_theta", VISION_ROPE_THETA))
                 == VISION_ROPE_THETA and set(rope) <= {"rope_type", "rope_theta"}, where, "rope_parameters", rope,
                 f"axial RoPE with theta {VISION_ROPE_THETA:g}")
        act = d.get("hidden_act", "quick_gelu")
        _require(act in _ACTIVATIONS, where, "hidden_act", act, str(sorted(_ACTIVATIONS)))
        patch = d.get("patch_size", 14)
        _require(d.get("spatial_patch_size", patch) == patch, where, "spatial_patch_size",
                 d.get("spatial_patch_size"), f"patch_size ({patch})")
        for name in ("patch_size", "temporal_patch_size"):
            _require(isinstance(d.get(name, 1), int), where, name, d.get(name), "one int")
        cfg = cls(depth=int(d.get("depth", 32)), embed_dim=int(d.get("embed_dim", 1280)),
                  hidden_size=int(d.get("hidden_size", 3584)), mlp_ratio=float(d.get("mlp_ratio", 4)),
                  num_heads=int(d.get("num_heads", 16)), in_channels=int(d.get("in_channels", d.get("in_chans", 3))),
                  patch_size=int(patch), spatial_merge_size=int(d.get("spatial_merge_size", 2)),
                  temporal_patch_size=int(d.get("temporal_patch_size", 2)), hidden_act=act)
        _require(cfg.num_heads >= 1 and cfg.embed_dim % (4 * cfg.num_heads) == 0, where, "num_heads", cfg.num_heads,
                 f"a divisor of embed_dim={cfg.embed_dim} leaving a head width divisible by 4 (2-D RoPE)")
        for name in ("depth", "patch_size", "spatial_merge_size", "temporal_patch_size", "hidden_size"):
            _require(getattr(cfg, name) >= 1, where, name, getattr(cfg, name), ">= 1")
        return cfg


@flax.struct.dataclass
class Pixels:
    """Qwen2-VL's pixel_values: what HF passes as (pixel_values, image_grid_thw).

    patches [P, C*T*p*p] (every image's patches, in merge-window order, images one after another)
    and grid [n_images, 3] int32 (t, h, w in patches; t = 1 for pictures). Both are arrays, so one
    compiled program serves every image size of the same total patch and image counts.
    """
    patches: jax.Array
    grid: jax.Array

    @property
    def shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The static shapes a compiled program depends on."""
        return self.patches.shape, self.grid.shape


@dataclasses.dataclass(frozen=True)
class Qwen2VLConfig:
    text: LlamaConfig
    vision: Qwen2VLVisionConfig
    image_token_id: int = 151655
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    @property
    def merge(self) -> int:
        return self.vision.spatial_merge_size

    def image_tokens(self, grid: Sequence[int]) -> int:
        """Placeholder tokens of an image of grid (t, h, w) patches: t*h*w / m^2."""
        t, h, w = grid
        return t * h * w // self.merge**2

    def expand_image_markers(self, text: str, grids: Sequence[Sequence[int]]) -> str:
        """Each IMAGE_MARKER in `text`, in order, becomes <|vision_start|> + <|image_pad|> x tokens +
        <|vision_end|>, as HF's chat template and Qwen2VLProcessor write an image."""
        pieces = text.split(IMAGE_MARKER)
        if len(pieces) - 1 != len(grids):
            raise InputError(f"the prompt has {len(pieces) - 1} {IMAGE_MARKER} marker(s) but grids for "
                             f"{len(grids)} image(s) were given (`preprocess_images` returns them)")
        out = [pieces[0]]
        for grid, piece in zip(grids, pieces[1:]):
            out += [VISION_START, IMAGE_PAD * self.image_tokens(grid), VISION_END, piece]
        return "".join(out)

    def check_pixels(self, dtype, ids: np.ndarray, valid: np.ndarray, pixels) -> Pixels:
        """Host-side check of `Pixels` against the prompt: shapes, finite values, one image grid per
        run of placeholders (in reading order) whose token count equals the run's length."""
        if not isinstance(pixels, Pixels):
            raise InputError(f"Qwen2-VL takes pixel_values as qwen2_vl.Pixels(patches, grid) "
                             f"(`model.preprocess_images` returns them), got {type(pixels).__name__}")
        patches, grid = np.asarray(pixels.patches), np.asarray(pixels.grid)
        v = self.vision
        if patches.ndim != 2 or patches.shape[1] != v.patch_dim or grid.ndim != 2 or grid.shape[1] != 3:
            raise InputError(f"Pixels need patches [P, {v.patch_dim}] and grid [images, 3], got {patches.shape} "
                             f"and {grid.shape}")
        if patches.dtype.kind != "f" or not np.isfinite(patches).all():
            raise InputError(f"Pixels.patches must be finite floats, got dtype {patches.dtype}")
        if (grid.dtype.kind not in "iu" or (grid[:, 0] != 1).any() or (grid[:, 1:] < 1).any()
                or (grid[:, 1:] % self.merge).any()):
            raise InputError(f"Pixels.grid rows must be (1, h, w) with h, w positive multiples of "
                             f"{self.merge} (pictures; videos are not supported), got {grid.tolist()}")
        if grid.prod(1).sum() != patches.shape[0]:
            raise InputError(f"the grid describes {int(grid.prod(1).sum())} patches, Pixels.patches holds "
                             f"{patches.shape[0]}")
        runs = placeholder_runs(ids == self.image_token_id, valid)
        want = [self.image_tokens(g) for g in grid.tolist()]
        if runs != want:
            raise InputError(f"the prompt's image placeholder runs have {runs} tokens; the grids need {want} "
                             "(one run per image, in order)")
        return Pixels(jnp.asarray(patches, dtype), jnp.asarray(grid, jnp.int32))

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "Qwen2VLConfig":
        """A Qwen2-VL config.json: transformers 5's (text_config nested) or the hub's flat one."""
        return cls._from_hf(d, "qwen2_vl", Qwen2VLVisionConfig.from_hf)

    @classmethod
    def _from_hf(cls, d: dict[str, Any], model_type: str, parse_vision: Callable[[dict], Any]):
        """The decoder and token ids of a Qwen2-VL-family config (shared by Qwen2.5-VL), the tower
        by `parse_vision`. With text_config nested, the decoder is read from it alone, as HF does:
        the flat copies of its fields that transformers 4.5x saved beside it are not read."""
        where = f"{model_type} config"
        nested = "text_config" in d
        handled = {"text_config", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
                   "vision_end_token_id", "vision_token_id", "tie_word_embeddings"}
        _check_fields(d, handled | _TEXT_FIELDS, where)
        text = dict(d["text_config"] or {}) if nested else {k: d[k] for k in _TEXT_FIELDS if k in d}
        text_where = f"{where}.text_config" if nested else where
        text_type = text.pop("model_type", f"{model_type}_text")
        _require(text_type in (f"{model_type}_text", model_type), text_where, "model_type", text_type,
                 f"'{model_type}_text'")
        for name in _TEXT_IGNORED:  # saved into text_config by transformers 4.5x; its decoder reads none
            text.pop(name, None)
        text = {**_TEXT_DEFAULTS, **text, "model_type": "qwen2"}
        # HF's attention takes head_dim = hidden_size / heads, whatever a config says.
        heads = text["num_attention_heads"]  # 0 or fewer: refused by LlamaConfig, naming the field
        text["head_dim"] = text["hidden_size"] // heads if isinstance(heads, int) and heads > 0 else 0
        text["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", False) or text.get("tie_word_embeddings"))
        scaling = dict(text.pop("rope_scaling", None) or {})  # the hub's older spelling
        if "type" in scaling:
            scaling.setdefault("rope_type", scaling.pop("type"))
        rope = {**scaling, **(text.pop("rope_parameters", None) or {})}
        section = rope.pop("mrope_section", [16, 24, 24])
        _require(rope.get("rope_type", "default") in ("default", "mrope"), text_where, "rope_type",
                 rope.get("rope_type"), "'default' / 'mrope' (M-RoPE)")
        rope["rope_type"] = "default"
        rope.setdefault("rope_theta", text.pop("rope_theta", 1000000.0))
        text.pop("rope_theta", None)
        llama = LlamaConfig.from_hf({**text, "rope_parameters": rope}, text_where)
        _require(isinstance(section, (list, tuple)) and len(section) == 3 and all(
            isinstance(s, int) and s >= 0 for s in section) and sum(section) == llama.head_dim // 2, text_where,
                 "mrope_section", section, f"3 ints summing to head_dim / 2 = {llama.head_dim // 2}")
        llama = dataclasses.replace(llama, rope=dataclasses.replace(llama.rope, mrope_section=tuple(section)))
        vision = parse_vision(d.get("vision_config") or {})
        _require(vision.output_size == llama.hidden_size, where, f"vision_config.{vision.OUTPUT_FIELD}",
                 vision.output_size, f"the decoder's hidden_size ({llama.hidden_size})")
        ids = {name: d.get(name, default) for name, default in (("image_token_id", 151655),
                                                                ("vision_start_token_id", 151652),
                                                                ("vision_end_token_id", 151653))}
        bad = {name: v for name, v in ids.items() if not (isinstance(v, int) and 0 <= v < llama.vocab_size)}
        if bad:
            raise ConfigError(f"{where}: token ids {bad} outside the vocabulary [0, {llama.vocab_size})")
        return cls(text=llama, vision=vision, **ids)


def placeholder_runs(is_image: np.ndarray, valid: np.ndarray) -> list[int]:
    """Lengths of the runs of real placeholder tokens, in reading order (rows, then positions)."""
    runs = []
    for row in (is_image & valid):
        edges = np.flatnonzero(np.diff(np.concatenate([[0], row.astype(np.int8), [0]])))
        runs += (edges[1::2] - edges[::2]).tolist()
    return runs


# ---- the tower ------------------------------------------------------------------------------------

def patch_layout(grid: jax.Array, num_patches: int, merge: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """grid [n, 3] (t = 1, h, w) -> each of the P (static) patches' (image, row, column) [P] int32, for
    patches in merge-window order (HF's `get_vision_position_ids`)."""
    counts = grid.prod(-1)  # [n]
    ends = jnp.cumsum(counts)
    p = jnp.arange(num_patches)
    image = jnp.minimum(jnp.searchsorted(ends, p, side="right"), grid.shape[0] - 1)
    offset = p - (ends - counts)[image]
    window, inner = offset // merge**2, offset % merge**2
    windows_per_row = grid[image, 2] // merge
    row = window // windows_per_row * merge + inner // merge
    col = window % windows_per_row * merge + inner % merge
    return image, row, col


def vision_rope(cfg, row: jax.Array, col: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Patch rows/columns [P] -> fp32 cos, sin [1, 1, P, Dv]: the first Dv/4 frequencies turn with
    the row, the next Dv/4 with the column, repeated for the rotate-half pair."""
    quarter = cfg.head_dim // 2
    inv_freq = 1.0 / VISION_ROPE_THETA ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter)
    angles = jnp.concatenate([row[:, None] * inv_freq, col[:, None] * inv_freq], axis=-1).astype(jnp.float32)
    angles = jnp.concatenate([angles, angles], axis=-1)[None, None]
    return jnp.cos(angles), jnp.sin(angles)


def vision_attention(num_heads: int, lp: dict, x: jax.Array, cos: jax.Array, sin: jax.Array,
                     mask: jax.Array) -> jax.Array:
    """The tower's attention over normed patches x [P, Hv] (fused qkv with bias, 2-D RoPE on q/k in
    fp32, output projection with bias); mask [1, 1, 1, P, P]: which patches each patch sees.
    Shared by Qwen2-VL and Qwen2.5-VL."""
    p = x.shape[0]
    qkv = linear(x, lp["w_qkv"], lp["b_qkv"]).reshape(p, 3, num_heads, -1).transpose(1, 2, 0, 3)  # [3, heads, P, Dv]
    q, k = (apply_rope(t[None].astype(jnp.float32), cos, sin).astype(x.dtype) for t in qkv[:2])  # [1, heads, P, Dv]
    attn = attend(q, k, qkv[2][None], mask)[0]  # [heads, P, Dv]
    return linear(attn.transpose(1, 0, 2).reshape(p, -1), lp["wo"], lp["bo"])


def _block(cfg: Qwen2VLVisionConfig, lp: dict, h: jax.Array, cos: jax.Array, sin: jax.Array,
           same_image: jax.Array) -> jax.Array:
    """One pre-norm ViT block over all patches h [P, Hv]; attention only within an image."""
    h = h + vision_attention(cfg.num_heads, lp, layer_norm(h, lp["norm1_w"], lp["norm1_b"], NORM_EPS), cos, sin,
                             same_image)
    x = layer_norm(h, lp["norm2_w"], lp["norm2_b"], NORM_EPS)
    act = _ACTIVATIONS[cfg.hidden_act]
    return h + linear(act(linear(x, lp["fc1_w"], lp["fc1_b"])), lp["fc2_w"], lp["fc2_b"])


def image_features(cfg: Qwen2VLConfig, params: dict, pixels: Pixels) -> jax.Array:
    """Pixels (P patches) -> merged features [P / m^2, H_text], every image's tokens in order."""
    v, vp = cfg.vision, params["vision"]
    patches = pixels.patches.astype(vp["patch_embed"].dtype)
    image, row, col = patch_layout(pixels.grid, patches.shape[0], v.spatial_merge_size)
    cos, sin = vision_rope(v, row, col)
    same_image = (image[:, None] == image[None, :])[None, None, None]  # [1, 1, 1, P, P]
    h = patches @ vp["patch_embed"]  # [P, Hv]
    h, _ = jax.lax.scan(lambda h, lp: (_block(v, lp, h, cos, sin, same_image), None), h, vp["layers"])
    p = params["projector"]
    x = layer_norm(h, p["norm_w"], p["norm_b"], NORM_EPS).reshape(-1, v.spatial_merge_size**2 * v.embed_dim)
    return linear(gelu_exact(linear(x, p["w1"], p["b1"])), p["w2"], p["b2"])


# ---- M-RoPE positions -----------------------------------------------------------------------------

def mrope_positions(cfg: Qwen2VLConfig, input_ids: jax.Array, valid: jax.Array,
                    pixels: Pixels | None) -> tuple[jax.Array, jax.Array]:
    """HF's `get_rope_index` for right-padded rows, in jit (static shapes; grid values dynamic).

    input_ids/valid [B, L]; each run of image placeholders is one image, taking the grids in
    reading order. Returns (positions [3, B, L] int32 (padding: 0), next_position [B] int32 = each
    row's max position + 1, where its first new token goes).
    """
    is_image = (input_ids == cfg.image_token_id) & valid
    grid = jnp.ones((1, 3), jnp.int32) if pixels is None else pixels.grid  # no images: no run reads it
    starts = is_image & ~jnp.pad(is_image[:, :-1], ((0, 0), (1, 0)))  # [B, L] first token of each image
    image = jnp.maximum(jnp.cumsum(starts.reshape(-1)).reshape(starts.shape) - 1, 0)  # [B, L] latest image
    rows, cols = grid[image, 1] // cfg.merge, grid[image, 2] // cfg.merge  # [B, L] that image's token grid
    text_before = jnp.cumsum(valid & ~is_image, axis=1) - (valid & ~is_image)  # exclusive
    extents = jnp.cumsum(jnp.where(starts, jnp.maximum(rows, cols), 0), axis=1)  # inclusive, this row's images
    index = jnp.arange(input_ids.shape[1])
    offset = index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)  # within the current image
    start = text_before + extents - jnp.maximum(rows, cols)  # an image token's time position
    text = text_before + extents
    positions = jnp.stack([jnp.where(is_image, start, text),
                           jnp.where(is_image, start + offset // cols, text),
                           jnp.where(is_image, start + offset % cols, text)])
    positions = jnp.where(valid, positions, 0).astype(jnp.int32)
    return positions, (positions.max(axis=(0, 2)) + 1).astype(jnp.int32)

