"""GGUF reader vs transformers' own GGUF loader on the real SmolLM2 file, plus tiny synthetic files."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers / huggingface_hub read it

import re

import gguf
import numpy as np
import pytest
from transformers import AutoTokenizer, LlamaConfig

from lookm_jax.convert.gguf import dequantize_q4_1, read_gguf, smollm2_gguf_path
from lookm_jax import loading
from lookm_jax.convert.tokenizer import apply_chat_template, special_tokens_of
from lookm_jax.errors import InputError

# ---------------------------------------------------------------- real file, module-scoped


@pytest.fixture(scope="module")
def path():
    return smollm2_gguf_path()


@pytest.fixture(scope="module")
def ckpt(path):
    return read_gguf(path)


@pytest.fixture(scope="module")
def hf_config(hf_smollm2_gguf):
    # Exactly what AutoConfig.from_pretrained(dir, gguf_file=name) builds for a llama GGUF in 5.24
    # (configuration_utils: load_gguf_checkpoint(...)["config"] -> from_dict); reused to save a 5 s re-read.
    assert hf_smollm2_gguf["config"]["model_type"] == "llama"
    return LlamaConfig.from_dict(hf_smollm2_gguf["config"])


@pytest.fixture(scope="module")
def hf_tok(path):
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.mark.slow
def test_tensors_equal_transformers_loader(ckpt, hf_smollm2_gguf):
    hf = hf_smollm2_gguf["tensors"]  # transformers 5.24 routes llama through this legacy loader
    assert set(ckpt.tensors) == set(hf)
    assert "lm_head.weight" not in ckpt.tensors  # tied: the file has no output.weight
    for name, ours in ckpt.tensors.items():
        assert ours.dtype == np.float32 and ours.flags.writeable, name
        np.testing.assert_array_equal(ours, hf[name].numpy(), err_msg=name)


def test_config_equals_transformers(ckpt, hf_config):
    # Fields transformers adds that are not LlamaConfig's (file name, unk id) or that it leaves unset.
    ignore = {"_name_or_path", "_model_name_or_path", "transformers_version", "architectures", "unk_token_id"}
    ours = LlamaConfig(**ckpt.config).to_dict()
    theirs = hf_config.to_dict()
    assert {k: v for k, v in ours.items() if k not in ignore} == {k: v for k, v in theirs.items() if k not in ignore}
    for key, value in ckpt.config.items():  # every field we emit is one transformers reads back unchanged
        if key != "architectures":
            assert getattr(hf_config, key) == value, key
    assert ckpt.config["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}


TEXTS = [
    "Hello, world!",
    "",
    " ",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\n  indented",
    "Unicode: café naïve Zürich — “quotes” 日本語 한국어 emoji 🤖👍🏽 \u200b zero-width",
    "digits 0 12 345 6789 3.14159 1e-5 -42 x2y3 v1.2.3",
    "def f(x):\n    return x**2  # square\n\nprint(f(3))",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>a/b<file_sep>x<jupyter_code>",
    "don't won't it's I'm we'll they've",
    "a" * 300,
]
# llama.cpp's "smollm" pre-tokenizer (and SmolLM2's tokenizer.json) isolates every digit before the GPT-2
# regex runs; transformers' GGUF tokenizer ignores "smollm" and differs when 2+ spaces precede a digit.
DIGITS_AFTER_SPACES = ["a  1", "x\n\n2", "    return 42", "table:\n  1  2  3", "Copyright:\n           1992-1993"]


def _digits_isolated_reference(hf_tok, text):
    """llama.cpp's "smollm" splitting: cut at every digit, then HF's GPT-2 regex + BPE on each piece."""
    pieces = [piece for piece in re.split(r"(\d)", text) if piece]
    return [i for piece in pieces for i in hf_tok(piece, add_special_tokens=False)["input_ids"]]


def test_tokenizer_matches_transformers(ckpt, hf_tok):
    for text in TEXTS:
        ids = ckpt.tokenizer.encode(text).ids
        assert ids == hf_tok(text, add_special_tokens=False)["input_ids"], text
        assert ids == hf_tok(text)["input_ids"], text  # HF adds no BOS either (add_bos_token false)
        for skip in (False, True):
            assert ckpt.tokenizer.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)
        assert ckpt.tokenizer.decode(ids, skip_special_tokens=False) == text  # byte-level BPE is lossless


def test_tokenizer_isolates_digits_like_llama_cpp(ckpt, hf_tok):
    for text in TEXTS + DIGITS_AFTER_SPACES:
        assert ckpt.tokenizer.encode(text).ids == _digits_isolated_reference(hf_tok, text), text
    assert ckpt.tokenizer.encode("a  1").tokens == ["a", "ĠĠ", "1"]


def test_special_tokens(ckpt, hf_tok):
    assert (ckpt.bos_token_id, ckpt.eos_token_id, ckpt.pad_token_id) == (
        hf_tok.bos_token_id,
        hf_tok.eos_token_id,
        hf_tok.pad_token_id,
    )
    assert ckpt.tokenizer.token_to_id("<|im_start|>") == 1 and ckpt.tokenizer.token_to_id("<|im_end|>") == 2
    ours = {i: t.content for i, t in ckpt.tokenizer.get_added_tokens_decoder().items() if t.special}
    assert ours == {i: t.content for i, t in hf_tok.added_tokens_decoder.items() if t.special}
    assert len(ours) == 17  # the file's control tokens: <|endoftext|>, <|im_start|>, ..., <empty_output>
    assert ckpt.tokenizer.get_vocab_size() == ckpt.config["vocab_size"] == len(hf_tok)


CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name 3 colours."}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Unicode é 日本 and\n  newlines"},
    ],
]


def test_chat_template_matches_transformers(ckpt, hf_tok):
    assert ckpt.chat_template == hf_tok.chat_template
    for chat in CHATS:
        for gen in (True, False):
            ours = apply_chat_template(ckpt.chat_template, chat, add_generation_prompt=gen)
            assert ours == hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    prompt = apply_chat_template(ckpt.chat_template, CHATS[0])
    assert prompt.endswith("<|im_start|>assistant\n")
    assert ckpt.tokenizer.encode(prompt).ids[0] == 1  # <|im_start|> stays one token


# Llama-2 / Mistral style: the template writes the special tokens itself.
BOS_EOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}"
                    "{{ eos_token }}{% else %}[INST] {{ m['content'] }} [/INST]{% endif %}{% endfor %}")


def test_chat_template_reads_the_special_tokens_transformers_passes(ckpt, hf_tok):
    tokens = loading._special_tokens(ckpt)
    assert tokens["bos_token"] == hf_tok.bos_token and tokens["eos_token"] == hf_tok.eos_token
    for chat in CHATS:
        ours = apply_chat_template(BOS_EOS_TEMPLATE, chat, special_tokens=tokens)
        assert ours == hf_tok.apply_chat_template(chat, chat_template=BOS_EOS_TEMPLATE, tokenize=False)
    # tokenizer_config.json names them as strings or as AddedToken objects
    config = {"bos_token": {"__type": "AddedToken", "content": "<s>"}, "eos_token": "</s>", "unk_token": None}
    assert special_tokens_of(config) == {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.mark.parametrize("template, message", [
    ("{{ bos_token + messages[0]['content'] }}", "the model's chat template failed: 'bos_token' is undefined"),
    ("{% for m in messages %}{{ m['content'] }", "the model's chat template failed: unexpected '}'"),
    ("{{ raise_exception('only user turns') }}", "the model's chat template failed: only user turns"),
])
def test_a_failing_chat_template_is_one_input_error(template, message):
    with pytest.raises(InputError) as error:
        apply_chat_template(template, CHATS[0])  # no special tokens given
    assert str(error.value) == message


def test_truncated_file_raises_value_error(path, tmp_path):
    data = open(path, "rb").read()
    for size in (len(data) // 2, 1000, 3):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ValueError, match=re.escape(str(cut))):
            read_gguf(cut)
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "missing.gguf")


def test_q4_1_dequant_equals_gguf():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(7, 20 * 5), dtype=np.uint8)  # random f16 scales: NaN/inf included
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_1)
    np.testing.assert_array_equal(dequantize_q4_1(blocks), expected)


# ---------------------------------------------------------------- tiny synthetic files

TINY = dict(hidden=16, heads=4, kv_heads=2, ffn=24, layers=2)


def _llama_cpp_permute(w, n_heads):
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half rows -> interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny(path, arch="llama", untied=False, extra_kv=(), pre="smollm"):
    """A tiny llama GGUF (F32 tensors, GQA) and the HF-layout tensors it encodes."""
    h, nh, nkv, ffn = TINY["hidden"], TINY["heads"], TINY["kv_heads"], TINY["ffn"]
    d = h // nh
    tokens, types = ["<|endoftext|>", "a", "b", "ab", "Ġ"], [3, 1, 1, 1, 1]
    rng = np.random.default_rng(1)
    hf, gg = {}, {}

    def add(hf_name, gguf_name, shape, heads=None):
        w = rng.standard_normal(shape).astype(np.float32)
        hf[hf_name] = w
        gg[gguf_name] = _llama_cpp_permute(w, heads) if heads else w

    add("model.embed_tokens.weight", "token_embd.weight", (len(tokens), h))
    add("model.norm.weight", "output_norm.weight", (h,))
    if untied:
        add("lm_head.weight", "output.weight", (len(tokens), h))
    for i in range(TINY["layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(p + "input_layernorm.weight", b + "attn_norm.weight", (h,))
        add(p + "self_attn.q_proj.weight", b + "attn_q.weight", (nh * d, h), heads=nh)
        add(p + "self_attn.k_proj.weight", b + "attn_k.weight", (nkv * d, h), heads=nkv)
        add(p + "self_attn.v_proj.weight", b + "attn_v.weight", (nkv * d, h))
        add(p + "self_attn.o_proj.weight", b + "attn_output.weight", (h, nh * d))
        add(p + "post_attention_layernorm.weight", b + "ffn_norm.weight", (h,))
        add(p + "mlp.gate_proj.weight", b + "ffn_gate.weight", (ffn, h))
        add(p + "mlp.up_proj.weight", b + "ffn_up.weight", (ffn, h))
        add(p + "mlp.down_proj.weight", b + "ffn_down.weight", (h, ffn))

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(128)
    w.add_embedding_length(h)
    w.add_block_count(TINY["layers"])
    w.add_feed_forward_length(ffn)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(500.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(0)
    for key, value in extra_kv:
        w.add_string(key, value) if isinstance(value, str) else w.add_uint32(key, value)
    for name, value in gg.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.mark.parametrize("untied", [False, True])
def test_tiny_roundtrip_unpermutes_q_k(tmp_path, untied):
    hf = _write_tiny(tmp_path / "tiny.gguf", untied=untied)
    ck = read_gguf(tmp_path / "tiny.gguf")
    assert set(ck.tensors) == set(hf)
    for name in hf:
        np.testing.assert_array_equal(ck.tensors[name], hf[name], err_msg=name)
    c = ck.config
    assert (c["num_key_value_heads"], c["head_dim"], c["tie_word_embeddings"]) == (2, 4, not untied)
    assert c["rope_parameters"]["rope_theta"] == 500.0 and c["vocab_size"] == 5
    assert (ck.eos_token_id, ck.bos_token_id, ck.chat_template) == (0, None, None)
    assert ck.tokenizer.encode("ab a<|endoftext|>").tokens == ["ab", "Ġ", "a", "<|endoftext|>"]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(arch="qwen2"), "general.architecture"),
        (dict(extra_kv=[("llama.rope.scaling.type", "linear")]), "llama.rope.scaling.type"),
        (dict(extra_kv=[("llama.expert_count", 8)]), "llama.expert_count"),
        (dict(extra_kv=[("llama.rope.dimension_count", 2)]), "llama.rope.dimension_count"),
        (dict(pre="qwen2"), "tokenizer.ggml.pre"),
    ],
)
def test_tiny_refuses_unsupported_metadata(tmp_path, kwargs, field):
    _write_tiny(tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(ValueError, match=re.escape(field)):
        read_gguf(tmp_path / "bad.gguf")
