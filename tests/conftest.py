"""Shared fixtures: tiny random HF PyTorch models built from configs (never a hub id)."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Most of the suite's time is XLA:CPU compiling (68% of three demo-model files' time, measured): LLVM at -O0
# compiles ~1.5x faster. Its float32 rounds differently (the demo's logits within 1.5e-3 of -O3's, at magnitudes
# up to 37; the same argmax), inside every test's unchanged tolerance. Benchmarks and users keep XLA's default;
# a caller's own setting of the flag wins.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import numpy as np
import pytest

IMAGE_TOKEN = 250  # last id of the tiny vocab


def tiny_llava(folder, *, heads=4, kv_heads=2, feature_layer=-2, strategy="default", layers=2,
               vision_layers=3, tie=False, seed=0, **text_overrides):
    """Build, save and return a tiny random `LlavaForConditionalGeneration` (eval mode, fp32)."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    text = LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, vocab_size=IMAGE_TOKEN + 1, rope_theta=1000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None, **text_overrides)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=56, num_hidden_layers=vision_layers,
                              num_attention_heads=4, image_size=30, patch_size=6)  # 25 patches
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN,
                         vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy)
    model = LlavaForConditionalGeneration(config).eval()
    # Random init leaves small norms/embeddings; widen them so the test sees real signal.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            elif "embed" in name:
                p.normal_(0, 1.0)
    model.save_pretrained(str(folder))
    return model


def image_ids(n_tokens_per_image: int, segments: list) -> np.ndarray:
    """segments: ints (text token ids) and the string 'img' -> a flat id list with expanded images."""
    out = []
    for s in segments:
        out.extend([IMAGE_TOKEN] * n_tokens_per_image if s == "img" else [s])
    return np.asarray(out, np.int32)


def word_tokenizer(words: list[str], specials: list[str]):
    """A tiny whitespace word-level tokenizer: `words` take ids 0.., then the `specials` (added tokens);
    "[UNK]" must be one of the words."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


def published_config(name: str) -> dict:
    """A deep copy of a real checkpoint's config.json as published, from `bench/sizes.py`'s CONFIGS (the
    one copy the size table and the config tests share), e.g. "Qwen2-VL-7B"."""
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import sizes  # bench/ is not a package

    return json.loads(json.dumps(sizes.CONFIGS[name]))


def with_field(config: dict, path: str, value) -> dict:
    """A deep copy of a config dict with the field at dotted `path` ("vision_config.x") set to `value`."""
    config = json.loads(json.dumps(config))
    *parents, leaf = path.split(".")
    target = config
    for key in parents:
        target = target[key]
    target[leaf] = value
    return config


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs():
    """After each test file, drop jax's caches of compiled programs. XLA:CPU maps every compiled kernel
    into memory on its own pages (3 mappings each), and one pytest worker runs half the suite: kept for
    the whole session, the programs reached Linux's limit of 65530 mappings a process
    (vm.max_map_count), where the next compile crashed (measured: 32k mappings after three files)."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session", autouse=True)
def lookm_cache(tmp_path_factory):
    """Every test (and subprocess it starts) caches converted models in one temporary folder per
    session, never in the user's ~/.cache/lookm_jax: the demo model is converted once per session."""
    path = tmp_path_factory.mktemp("lookm_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOOKM_CACHE", str(path))
        yield path


@pytest.fixture(scope="session")
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def tiny_llava_folder(tmp_path_factory) -> str:
    """A tiny random LLaVA checkpoint folder (4 query / 2 KV heads), built once per session."""
    folder = tmp_path_factory.mktemp("tiny_llava")
    tiny_llava(folder, kv_heads=2)
    return str(folder)


@pytest.fixture(scope="session")
def hf_smollm2_gguf():
    """transformers' own GGUF loader on the real SmolLM2 file: {"config": dict, "tensors": {name: torch
    tensor}}. Dequantising takes ~25 s here, so test_gguf and test_smollm2 share one read."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from lookm_jax.convert.gguf import smollm2_gguf_path

    path = smollm2_gguf_path()
    config = load_gguf_checkpoint(path, return_tensors=False)["config"]
    # The loader maps names from a model's state_dict (names and layer count only): a meta-device model.
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_dict(config))
    return load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)


@pytest.fixture(scope="module")
def demo():
    """The embedded demo model (`load_default`), built once per session into the temporary LOOKM_CACHE."""
    import lookm_jax

    return lookm_jax.load_default()


@pytest.fixture(scope="module")
def tiny(tiny_llava_folder):
    """That tiny LLaVA loaded by lookm_jax (a fresh Model, so compile counts start at 0, per module)."""
    import lookm_jax

    return lookm_jax.load(tiny_llava_folder)


@pytest.fixture(scope="module")
def tiny_prompt(tiny):
    """Two images of 25 tokens and 9 text tokens: L = 59 in the 64-token bucket."""
    ids = image_ids(tiny.config.image_seq_length, [3, 4, "img", 5, 6, 7, "img", 8, 9, 10, 11])
    pixels = np.random.default_rng(0).standard_normal((2, 3, 30, 30)).astype(np.float32)
    return ids[None], pixels


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tiny):
    """The tiny LLaVA with a word-level tokenizer over the haystack's words (digits one by one)."""
    import dataclasses

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from lookm_jax.eval import needle

    words = sorted({w for part in needle._SUBJECTS + needle._VERBS + needle._OBJECTS + needle._PLACES
                    + needle._TIMES + needle.NEEDLE_WORDS for w in part.lower().split()}
                   | set("The What special magic number for is . ? Answer with the only".split())
                   | set("0123456789"))
    vocab = {"[UNK]": 0} | {w: i + 1 for i, w in enumerate(words)} | {"<image>": IMAGE_TOKEN}
    assert len(vocab) < IMAGE_TOKEN
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                       pre_tokenizers.Digits(individual_digits=True)])
    tokenizer.decoder = decoders.WordPiece()  # joins tokens with spaces
    tokenizer.add_special_tokens(["<image>"])
    return dataclasses.replace(tiny, tokenizer=tokenizer, _compiled={})
