"""Every bad input the Model API refuses: an `InputError` (a ValueError) naming the value and the range.

One test per row of issue 12's table (the CLI side is tests/test_cli.py), plus the pieces the
checks are built from. The tiny LLaVA: vocabulary 251 (id 250 is the image placeholder), 25
placeholders per image, context 2048.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lookm_jax
from conftest import IMAGE_TOKEN, image_ids
from lookm_jax import InputError, PromptTooLongError, checks, get_method, inputs
from lookm_jax.models.config import LlavaConfig


@pytest.fixture(scope="module")
def prompt(tiny):
    """One image of 25 tokens and 8 text tokens: L = 33."""
    ids = image_ids(tiny.config.image_seq_length, [3, 4, "img", 5, 6, 7, 8, 9, 10])
    pixels = np.random.default_rng(0).standard_normal((1, 3, 30, 30)).astype(np.float32)
    return ids[None], pixels


def test_unreadable_image_names_the_file(tiny, tmp_path):
    fake = tmp_path / "fake.png"
    fake.write_text("not an image")
    with pytest.raises(InputError, match=r"image \S*fake\.png is not a readable image \(UnidentifiedImageError"):
        tiny.preprocess_images([str(fake)])
    with pytest.raises(InputError, match=r"image \S*missing\.png not found$"):
        tiny.preprocess_images([str(tmp_path / "missing.png")])


def test_16_bit_and_float_images_are_refused_not_clipped(tiny, tmp_path):
    from PIL import Image

    ramp = np.linspace(0, 65535, 256).reshape(16, 16)
    deep = tmp_path / "deep.png"
    Image.fromarray(ramp.astype(np.uint16)).save(deep)  # mode I;16: RGB conversion would clip 99% to white
    with pytest.raises(InputError, match=r"image \S*deep\.png has 16/32-bit integer pixels \(PIL mode I;16\)"):
        tiny.preprocess_images([str(deep)])
    with pytest.raises(InputError, match=r"an image has float pixels \(PIL mode F\), .* convert it to 8-bit RGB"):
        tiny.preprocess_images([Image.fromarray(ramp.astype(np.float32))])
    tiny.preprocess_images([Image.fromarray((ramp / 257).astype(np.uint8))])  # the same ramp in 8 bits is taken


@pytest.mark.parametrize("name", ["lookm", "h2o"])
@pytest.mark.parametrize("budget", [0, 1.5, -1])
def test_budget_outside_0_1_is_refused_as_typed(name, budget):
    with pytest.raises(InputError, match=rf"budget must be a fraction in \(0, 1\], got {budget}$"):
        get_method(name, budget=budget)


def test_a_method_name_that_is_not_a_string_is_refused():
    with pytest.raises(InputError, match=r"unknown method \['lookm'\]; known: full, "):
        get_method(["lookm"])


def test_snapkv_voting_with_an_empty_recent_window_is_refused():
    with pytest.raises(InputError, match=r"window=None votes with the recent window \(W = M\), so it needs alpha_recent > 0, got 0.0$"):
        get_method("snapkv", alpha_recent=0.0, alpha_important=0.25, window=None)
    method = get_method("snapkv", alpha_recent=0.02, alpha_important=0.25, window=None)
    method.check_prompt_lengths(np.array([50, 60]))  # 1 recent voter each
    with pytest.raises(InputError, match=r"alpha_recent=0.02 keeps no recent slot of a 40-token prompt \(needs "
                                         r"alpha_recent >= 0.025\)$"):
        method.check_prompt_lengths(np.array([60, 40]))


@pytest.mark.parametrize("alphas", [(0.0, 0.0), (0.6, 0.6), (-0.5, 0.5), (0.1, float("nan"))])
def test_alphas_must_sum_to_a_fraction(alphas):
    with pytest.raises(InputError, match=rf"alpha_recent={alphas[0]!r} and alpha_important={alphas[1]!r}"):
        get_method("snapkv", alpha_recent=alphas[0], alpha_important=alphas[1])


@pytest.mark.parametrize("name, options, message", [
    ("snapkv", {"kernel_size": -1}, "odd kernel_size >= 1"),
    ("snapkv", {"window": True}, "window must be an int >= 1 or None, got True"),
    ("roco", {"std_weight": float("nan")}, "std_weight must be a finite number, got nan"),
    ("lookm", {"keep_all_text": True, "capacity_ratio": float("inf")}, r"capacity_ratio must be None or a fraction"),
    ("lookm", {"keep_all_text": True, "capacity_ratio": -1}, r"capacity_ratio must be None or a fraction"),
    ("lookm", {"text_prior": "yes"}, "text_prior must be True or False"),
    ("lookm", {"similarity_filter": 3, "merge": "averaged"}, "similarity_filter must be True or False"),
    ("lookm", {"n_sink": True}, "n_sink must be an int >= 0, got True"),
    ("h2o", {"block": True}, "block must be an int >= 1, got True"),
    ("h2o", {"budget": True}, r"budget must be a fraction in \(0, 1\], got True"),
])
def test_method_options_of_the_wrong_kind_are_refused(name, options, message):
    with pytest.raises(InputError, match=message):
        get_method(name, **options)


def test_budget_or_alpha_given_to_full_is_refused():
    with pytest.raises(InputError, match="method 'full' takes no budget"):
        get_method("full", budget=0.2)
    with pytest.raises(InputError, match="method 'full' takes no alpha_recent"):
        get_method("full", alpha_recent=0.1)
    with pytest.raises(InputError, match=r"method 'lookm' takes no windw \(its parameters: alpha_recent"):
        get_method("lookm", windw=3)


@pytest.mark.parametrize("name", ["lookm", "h2o", "snapkv", "streamingllm", "roco"])
def test_budget_keeping_no_slot_names_the_smallest_that_works(tiny, prompt, name):
    """floor(0.01 * 33) = 0 slots: refused with 2 / 33 rounded up; that budget runs."""
    with pytest.raises(InputError, match=r"keeps no slot of a 33-token prompt; the smallest budget that keeps one "
                                         r"is 0\.0607"):
        tiny.run(*prompt, max_new_tokens=2, method=get_method(name, budget=0.02))
    result = tiny.run(*prompt, max_new_tokens=2, method=get_method(name, budget=0.0607))
    assert result.kept_image_tokens[0] + result.kept_text_tokens[0] == 2


def test_context_length_is_checked_and_can_be_overridden(tiny, prompt):
    """prompt + max_new_tokens beyond max_position_embeddings: refused, unless ignore_context_limit."""
    assert tiny.text_config.max_position_embeddings == 2048
    with pytest.raises(InputError, match=r"33 tokens \+ max_new_tokens=100000 = 100033 positions exceed .* \(2048, "
                                         r"max_position_embeddings\).*ignore_context_limit=True"):
        tiny.run(*prompt, max_new_tokens=100000)
    short = dataclasses.replace(tiny, config=dataclasses.replace(
        tiny.config, text=dataclasses.replace(tiny.text_config, max_position_embeddings=34)), _compiled={})
    with pytest.raises(InputError, match="35 positions exceed"):
        short.run(*prompt, max_new_tokens=2)
    with pytest.raises(InputError, match="exceed"):
        short.logits(np.ones((1, 40), np.int32))
    assert short.run(*prompt, max_new_tokens=2, ignore_context_limit=True).tokens.shape == (1, 2)
    with pytest.raises(InputError, match=r"bucket 64 \+ max_new_tokens=2147483600 = 2147483664 cache slots exceed the "
                                         "2147483647 that int32 positions can number"):
        short.run(*prompt, max_new_tokens=2**31 - 48, ignore_context_limit=True)


def test_out_of_memory_is_one_line_naming_the_cache(tiny, prompt, monkeypatch):
    """XLA's RESOURCE_EXHAUSTED (here raised on purpose: a real one depends on the machine) becomes an
    InputError naming the run's cache; any other runtime error passes through."""
    from lookm_jax import model as model_module

    def exhausted(*args):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 768000147456 bytes.")

    monkeypatch.setattr(model_module, "kept_by_modality", exhausted)  # runs between prefill and decode
    cfg = tiny.text_config
    gib = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * (64 + 1000) / 2**30
    with pytest.raises(InputError, match=re.escape(
            f"out of device memory: 1 prompt(s) in bucket 64 with max_new_tokens=1000 need a KV cache of 1064 slots "
            f"per row ({gib:.1f} GiB uncompressed); lower max_new_tokens, the prompt's bucket or the batch")):
        tiny.run(*prompt, max_new_tokens=1000)

    def failed(*args):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(model_module, "kept_by_modality", failed)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        tiny.run(*prompt, max_new_tokens=1000)


def test_prompt_beyond_the_largest_bucket_says_how_to_raise_it(tiny, prompt):
    small = dataclasses.replace(tiny, buckets=(16,), _compiled={})
    with pytest.raises(PromptTooLongError, match=r"prompt of 33 tokens is longer than the largest bucket \(16\); "
                                                 r"add a bucket: `model.buckets = .*, 48\)`, or `lookm generate --buckets 48`"):
        small.run(*prompt, max_new_tokens=2)
    small.buckets = (*small.buckets, 48)
    assert small.run(*prompt, max_new_tokens=2).bucket == 48
    assert [inputs.suggest_bucket(n) for n in (17, 25000, 20000, 70000)] == [24, 32768, 24576, 98304]


def test_float_ids_are_refused(tiny):
    with pytest.raises(InputError, match="input_ids must be integer token ids, got dtype float32"):
        tiny.generate(np.ones((1, 5), np.float32), max_new_tokens=2)
    with pytest.raises(InputError, match="integer token ids"):
        tiny.logits([[1.0, 2.0]])


def test_ids_outside_the_vocabulary_are_refused_but_placeholders_and_padding_pass(tiny, prompt):
    ids, pixels = prompt
    for bad, value in ((IMAGE_TOKEN + 1, 251), (-3, -3)):
        wrong = ids.copy()
        wrong[0, 5] = bad
        with pytest.raises(InputError, match=rf"outside the vocabulary \[0, 251\) or the image placeholder 250: "
                                             rf"first {value} at row 0, position 5"):
            tiny.run(wrong, pixels, max_new_tokens=2)
    padded = np.concatenate([np.full((1, 3), 999, np.int32), ids], axis=1)  # garbage under the mask
    mask = np.arange(padded.shape[1])[None] >= 3
    assert tiny.run(padded, pixels, mask, max_new_tokens=2).prompt_lengths[0] == ids.shape[1]
    with pytest.raises(InputError, match="vocabulary"):
        tiny.logits(np.full((1, 4), 5000))


def test_other_requests_are_refused_with_input_error(tiny, prompt):
    ids, pixels = prompt
    for kwargs, message in (({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1, got 0"),
                            ({"method": "lookm"}, "method must be a lookm_jax method"),
                            ({"temperature": float("nan")},
                             r"temperature 0 \(greedy\) or in \[1e-06, 1e\+06\] .* got temperature nan"),
                            ({"temperature": 1e-39}, "got temperature 1e-39"),  # float32 has no 1 / 1e-39
                            ({"temperature": 1e300}, "got temperature 1e\\+300"),
                            ({"temperature": "hot"}, "got temperature 'hot'"),
                            ({"top_p": None}, "0 < top_p <= 1, got temperature 0.0, top_p None"),
                            ({"seed": 1.5}, r"seed must be an int in \[0, 4294967295\], got 1.5"),
                            ({"seed": 2**70}, f"got {2**70}")):
        with pytest.raises(InputError, match=message):
            tiny.run(ids, pixels, **{"max_new_tokens": 2, **kwargs})
    with pytest.raises(InputError, match="25 placeholder tokens .* the prompt has 0"):
        tiny.run(np.ones((1, 4), np.int32), pixels, max_new_tokens=2)
    with pytest.raises(InputError, match="pixel_values must be finite real numbers .* with NaN or inf"):
        tiny.run(ids, np.full_like(pixels, np.nan), max_new_tokens=2)
    with pytest.raises(InputError, match="pixel_values must be finite real numbers .* got dtype complex64$"):
        tiny.run(ids, pixels.astype(np.complex64), max_new_tokens=2)
    tiny.run(ids, jnp.asarray(pixels, jnp.bfloat16), max_new_tokens=2, seed=jnp.int32(3))  # bf16 pixels, a JAX seed
    with pytest.raises(InputError, match=r"input_ids must be \[batch, length\] with both >= 1, got shape \(0, 4\)"):
        tiny.run(np.ones((0, 4), np.int32), max_new_tokens=2)
    with pytest.raises(InputError, match=r"an image has no pixels \(size \(0, 0\)\)"):
        tiny.preprocess_images([np.zeros((0, 0, 3), np.uint8)])
    with pytest.raises(InputError, match="expected a PIL image or a \\[H, W, C\\] uint8 array"):
        tiny.preprocess_images([np.zeros((4, 4, 3), np.float32)])
    with pytest.raises(InputError, match=r"token ids must be in \[0, 251\), got \[-1\]"):
        tiny.decode_text([5, -1])
    with pytest.raises(InputError, match="num_images must be an int >= 0 or None, got -1"):
        tiny.encode_chat("x", num_images=-1)
    with pytest.raises(InputError, match="path must be a folder or .gguf file path, got None"):
        lookm_jax.load(None)
    with pytest.raises(InputError, match="dtype must be one of float32, bfloat16, got int8"):
        lookm_jax.load_default(np.int8)
    with pytest.raises(InputError, match="dtype must be one of float32, bfloat16, got 'fp8'"):
        lookm_jax.load_default("fp8")
    with pytest.raises(InputError, match="dtype must be one of float32, bfloat16, got None"):
        lookm_jax.load_default(None)
    with pytest.raises(InputError, match="dtype must be one of float32, bfloat16, got float16"):
        tiny.astype(np.float16)
    assert tiny.astype("bfloat16").params["text"]["embed"].dtype == jnp.bfloat16
    with pytest.raises(InputError, match="image_tiles is only for tiling"):
        tiny.processor.encode(None, "x", [1])
    assert isinstance(tiny.config, LlavaConfig) and not tiny.processor.tiling


def test_api_arguments_of_the_wrong_kind_are_refused(tiny, prompt):
    """Each public entry point names a wrong kind of argument instead of failing deeper down."""
    ids, pixels = prompt
    for mask, message in ((np.full(ids.shape, 2), "attention_mask must hold only 0 and 1"),
                          (np.full(ids.shape, np.nan), "attention_mask must hold only 0 and 1"),
                          (np.zeros(ids.shape, np.int32), r"rows \[0\] have none")):
        with pytest.raises(InputError, match=message):
            tiny.run(ids, pixels, mask, max_new_tokens=2)
        with pytest.raises(InputError, match=message):
            tiny.logits(ids, pixels, mask)
    assert tiny.run(ids, pixels, np.ones(ids.shape, np.float32), max_new_tokens=2).prompt_lengths[0] == ids.shape[1]
    with pytest.raises(InputError, match="input_ids must be a rectangular .* rows differ in length"):
        tiny.logits([[1, 2, 3], [1, 2]])
    with pytest.raises(InputError, match="ignore_context_limit must be True or False, got 'no'"):
        tiny.run(ids, pixels, max_new_tokens=2, ignore_context_limit="no")
    for buckets in ((), (50.5, 64), [0]):
        with pytest.raises(InputError, match=r"model.buckets must be a non-empty tuple of prompt lengths"):
            dataclasses.replace(tiny, buckets=buckets).run(ids, pixels, max_new_tokens=2)
    for images in ("a.png", [], None):
        with pytest.raises(InputError, match="images must be a non-empty list of image files or PIL images"):
            tiny.preprocess_images(images)
    with pytest.raises(InputError, match="prompt must be a str, got NoneType"):
        tiny.encode_chat(None)
    with pytest.raises(InputError, match="prompt is not valid Unicode text"):
        tiny.encode_chat("\udcff hi")
    with pytest.raises(InputError, match=r"decode_text takes one row of integer token ids \[L\] .* shape \(1, 2\)"):
        tiny.decode_text(np.array([[5, 6]]))
    with pytest.raises(InputError, match="decode_text takes one row of integer token ids .* dtype float64"):
        tiny.decode_text([1.7])
    with pytest.raises(InputError, match="shard takes a jax.sharding.Mesh .* got str"):
        tiny.shard("mesh")


def test_output_paths_are_checked_before_anything_is_written(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match=r"^--out \S*file/sub: \S*file is a file, not a folder$"):
        checks.check_output_folder(str(tmp_path / "file" / "sub"), "--out")
    with pytest.raises(InputError, match=r"^--out \S*file is a file, not a folder$"):
        checks.check_output_folder(str(tmp_path / "file"), "--out")
    with pytest.raises(InputError, match=r"^--out /proc/run: cannot write into /proc$"):
        checks.check_output_folder("/proc/run", "--out")
    checks.check_output_folder(str(tmp_path / "new" / "run"), "--out")  # made on save
    with pytest.raises(InputError, match=r"^--out \S* is a folder; give a file path$"):
        checks.check_output_file(str(tmp_path), "--out")
    with pytest.raises(FileNotFoundError, match=r"^--out \S*new/t.csv: folder \S*new does not exist$"):
        checks.check_output_file(str(tmp_path / "new" / "t.csv"), "--out")
    for create_folder in (False, True):
        with pytest.raises(InputError, match=r"^--out \S*file/t.csv: \S*file is a file, not a folder$"):
            checks.check_output_file(str(tmp_path / "file" / "t.csv"), "--out", create_folder=create_folder)
    with pytest.raises(InputError, match=r"^--out /proc/t.csv: cannot write into /proc$"):
        checks.check_output_file("/proc/t.csv", "--out")
    checks.check_output_file(str(tmp_path / "new" / "t.csv"), "--out", create_folder=True)
    assert sorted(os.listdir(tmp_path)) == ["file"]  # the write tests leave nothing behind
