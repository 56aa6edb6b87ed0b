"""Compression inside generation: every method on the tiny LLaVA and on the SmolLM2 demo.

Cache sizes: a budget method keeps M + N = floor(alpha_recent * L) + floor(alpha_important * L)
prompt slots per layer and KV head, L = the row's own prompt length; the static capacity it
allocates is the same formula at the bucket length, floor(a1 * bucket) + floor(a2 * bucket), so
the compressed cache is (capacity + new) / (bucket + new) of the full cache's bytes. A per-layer
split (PyramidKV) moves ranked slots between layers and keeps the same total.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

import reference_lookm as ref
from lookm_jax import METHODS, generate as gen, get_method
from lookm_jax.cli_args import DEFAULT_IMAGES
from lookm_jax.compression.methods import ScorerMethod
from method_variants import DEFAULTS, VARIANTS, build, ids
from lookm_jax.models import llama
from lookm_jax.models.image_processing import CLIPImageProcessorConfig, preprocess_images
from lookm_jax.compression.scoring import STATISTICS, column_stats, mean_std_from_stats, scores_from_stats

# On the (slower) demo model: every method and every merge mode; every variant on tiny.
DEMO_CONFIGS = DEFAULTS + [v for v in VARIANTS if set(v[1]) == {"merge"} and v[1]["merge"] is not None]
KEEPS_ALL_TEXT = ("lookm", {"keep_all_text": True, "merge": "pivotal"})  # may keep more than M + N


def _method(name, budget, **params):
    return build(name, params, budget=budget)


def _check_sizes(result, method, new_tokens, num_layers):
    """Cache bytes scale with (capacity + new) / (bucket + new), summed over layers; each head keeps
    M + N (or L) slots, a per-layer split the same on average over layers."""
    bucket, length = result.bucket, int(result.prompt_lengths[0])
    capacities = method.layer_capacities(bucket, num_layers)
    if isinstance(method, ScorerMethod):
        m, n, n_max = (math.floor(a * x) for a, x in ((method.alpha_recent, length), (method.alpha_important, length),
                                                      (method.alpha_important, bucket)))
        assert sum(capacities) == num_layers * (math.floor(method.alpha_recent * bucket) + n_max)
        split = method.layer_split
        kept = m + (n if split == "uniform" else
                    np.mean([ref.layer_ranked(n, n_max, i, num_layers, split) for i in range(num_layers)]))
    else:
        assert capacities == (bucket,) * num_layers
        kept = length
    assert (result.cache_bytes * num_layers * (bucket + new_tokens)
            == result.full_cache_bytes * (sum(capacities) + num_layers * new_tokens))
    # Means over layers and KV heads, in float32: a miscounted slot moves the sum by 1 / (N * Hkv) >> 1e-3.
    assert result.kept_image_tokens[0] + result.kept_text_tokens[0] == pytest.approx(kept, abs=1e-3)
    chex.assert_shape(result.tokens, (1, new_tokens))


# ---- tiny LLaVA -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,params", VARIANTS, ids=ids(VARIANTS))
def test_every_method_generates_on_tiny_llava(tiny, tiny_prompt, name, params):
    method = _method(name, 0.4, **params)
    result = tiny.run(*tiny_prompt, max_new_tokens=4, method=method)
    if (name, params) != KEEPS_ALL_TEXT:
        _check_sizes(result, method, 4, tiny.text_config.num_layers)
    # Smaller exactly when the method keeps fewer slots than the bucket (not full, nor keep_all_text
    # without a capacity_ratio, whose static capacity is the whole bucket).
    assert result.bucket == 64 and (result.cache_bytes < result.full_cache_bytes) == (method.capacity(64) < 64)
    assert (method.capacity(64) < 64) == (name != "full" and (name, params) != KEEPS_ALL_TEXT)


@pytest.mark.parametrize("name", [m for m in METHODS if m != "full"])
def test_budget_covering_prompt_without_merge_gives_full_tokens(tiny, tiny_prompt, name):
    full = tiny.run(*tiny_prompt, max_new_tokens=8)
    params = {"alpha_recent": 1.0, "alpha_important": 0.0} | ({"merge": None} if name == "lookm" else {})
    covering = tiny.run(*tiny_prompt, max_new_tokens=8, method=get_method(name, **params))
    np.testing.assert_array_equal(covering.tokens, full.tokens)
    assert covering.cache_bytes == full.cache_bytes


def test_no_recompile_across_prompt_lengths_with_compression(tiny, tiny_prompt):
    method = get_method("lookm", budget=0.4)
    ids, pixels = tiny_prompt
    before = tiny.compile_count
    a = tiny.run(ids, pixels, max_new_tokens=3, method=method)  # L = 59
    b = tiny.run(ids[:, :-3], pixels, max_new_tokens=3, method=method)  # L = 56, same bucket
    assert a.bucket == b.bucket == 64 and b.compile_seconds == 0
    assert tiny.compile_count == before + (a.compile_seconds > 0)
    assert a.cache_bytes == b.cache_bytes  # static capacity floor(0.2 * 64) * 2 = 24
    assert a.kept_text_tokens + a.kept_image_tokens == 22 and b.kept_text_tokens + b.kept_image_tokens == 22


def test_no_host_round_trip_between_prefill_compression_and_decode(tiny, tiny_prompt):
    """Prefill (with LOOK-M compression inside) feeds the donated decode on the device."""
    ids, pixels = tiny_prompt
    method = get_method("lookm", budget=0.4, merge="weighted")
    tiny.run(ids, pixels, max_new_tokens=3, method=method)  # compile outside the guard
    prefill, decode = next(v for k, v in tiny._compiled.items() if k[2] == method and k[3] == 3)
    packed, valid = gen.pack_prompts(ids)
    key = jax.random.key(0)
    args = [jax.device_put(a) for a in (tiny.params, packed, valid, pixels)]
    with jax.transfer_guard_device_to_host("disallow"):
        first, cache, _ = prefill(*args, key)
        tokens, _, new_cache = decode(tiny.params["text"], first, cache, key)
    assert all(k.is_deleted() for k in cache.layer_keys)
    assert new_cache.capacity == method.capacity(64) + 3 and np.asarray(tokens).shape == (1, 3)


@pytest.mark.parametrize("hkv,block", [(1, 5), (2, 7)])
def test_prefill_attention_statistics_equal_standalone_scoring(hkv, block):
    """The column statistics the decoder's attention accumulates are eq. 4 / RoCo's, to 1e-5."""
    q, k, v, _, valid = ref.make_inputs(5, hkv=hkv, length=19, lengths=[19, 12])
    q, k, v, valid = map(jnp.asarray, (q, k, v, valid))
    attention = jax.jit(llama.causal_attention, static_argnames=("block", "statistics"))
    out, stats = attention(q, k, v, valid, block=block, statistics=STATISTICS)
    plain, none = attention(q, k, v, valid, block=block)
    assert none == {}
    np.testing.assert_array_equal(out, plain)
    want = column_stats(q, k, valid, STATISTICS, block=4)
    for name in STATISTICS:
        chex.assert_shape(stats[name], (2, hkv, 4 // hkv, 19))
        np.testing.assert_allclose(stats[name], want[name], atol=1e-5, rtol=1e-5)
    args = (np.asarray(q), np.asarray(k), np.asarray(valid))
    np.testing.assert_allclose(scores_from_stats(stats), ref.attention_scores(*args), atol=1e-5, rtol=1e-5)
    for got, expected in zip(mean_std_from_stats(stats, valid), ref.mean_std(*args)):
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-4)


def test_prefill_attention_memory_is_linear_in_length():
    """With statistics, the blocked attention's scratch memory grows ~linearly (4x length: < 6x).

    The query blocks must run one after another: scheduled breadth-first, every block's
    [block, end] probabilities and key/value prefixes would be live at once (4x length: ~11x).
    """
    def scratch(length):
        q = kv = jax.ShapeDtypeStruct((1, 2, length, 128), jnp.float32)
        flags = jax.ShapeDtypeStruct((1, length), jnp.bool_)
        fn = jax.jit(lambda *a: llama.causal_attention(*a, statistics=STATISTICS))
        return fn.lower(q, kv, kv, flags).compile().memory_analysis().temp_size_in_bytes

    assert scratch(4096) < 6 * scratch(1024)


# ---- SmolLM2 demo ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_prompt(demo):
    """The demo's two pictures, 4 times each (8 x 64 = 512 image tokens), and a short text: L ~ 550, bucket 768."""
    processor = CLIPImageProcessorConfig.from_hf_dict(demo.manifest["image_processor"])
    pixels = preprocess_images([Image.open(p) for p in DEFAULT_IMAGES * 4], processor)
    return demo.encode_chat("Write a haiku about the sea.", num_images=8), pixels


@pytest.mark.slow
@pytest.mark.parametrize("name,params", DEMO_CONFIGS, ids=ids(DEMO_CONFIGS))
def test_every_method_generates_on_smollm2_demo(demo, demo_prompt, name, params):
    method = _method(name, 0.2, **params)
    result = demo.run(*demo_prompt, max_new_tokens=2, method=method)
    _check_sizes(result, method, 2, demo.text_config.num_layers)
    assert result.bucket == 768 and int(result.image_tokens[0]) == 512
    if name == "lookm" and not params:
        # Text-prior at a 20% budget: with fewer text tokens than N, every text token is kept.
        length, text = int(result.prompt_lengths[0]), int(result.prompt_lengths[0] - result.image_tokens[0])
        assert text < math.floor(0.1 * length)
        assert result.kept_text_tokens[0] == text
