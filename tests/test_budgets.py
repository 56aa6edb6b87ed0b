"""Per-layer budgets (PyramidKV's schedule, user weights): exact slot totals, real per-layer buffers,
and decode on them equal to decode on the same slots in one uniform buffer."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference_lookm as ref
from conftest import image_ids
from lookm_jax import InputError, generate as gen, get_method
from lookm_jax.cache import KVCache
from lookm_jax.compression import budgets
from lookm_jax.models import llama


@pytest.mark.parametrize("num_layers", [2, 5, 30, 40])
@pytest.mark.parametrize("split", ["pyramid", "weights"])
def test_layer_slots_sum_to_the_uniform_total(num_layers, split):
    """At the bucket's N every layer's slots sum to N_layers x N exactly; for shorter rows never more,
    and each layer's share is the float64 reference's (cumulative floors); a pyramid falls with depth
    from about (2 - 1/beta) N to N / beta."""
    weights = "pyramid" if split == "pyramid" else tuple(float(w) for w in np.random.default_rng(num_layers).
                                                          uniform(0.2, 3.0, num_layers))
    n_max = 57
    table = budgets.slot_table(weights, num_layers, 20.0, n_max)
    assert table[:, n_max].sum() == num_layers * n_max
    assert (table.sum(0) <= num_layers * np.arange(n_max + 1)).all()
    assert (table.sum(0) >= num_layers * np.arange(n_max + 1) - num_layers).all()
    for n in (0, 1, 13, n_max):
        expected = [ref.layer_ranked(n, n_max, i, num_layers, list(weights) if split == "weights" else "pyramid")
                    for i in range(num_layers)]
        np.testing.assert_array_equal(table[:, n], expected)
    if split == "pyramid":
        assert (np.diff(table[:, n_max]) <= 0).all()
        assert abs(table[0, n_max] - (2 - 1 / 20) * n_max) <= 1 and abs(table[-1, n_max] - n_max / 20) <= 1


def test_refusals():
    with pytest.raises(InputError, match="layer_split must be 'uniform', 'pyramid' or a tuple"):
        get_method("h2o", layer_split="steps")
    with pytest.raises(InputError, match="positive numbers"):
        get_method("h2o", layer_split=(1.0, -1.0))
    with pytest.raises(InputError, match="pyramid_beta must be a number >= 1"):
        get_method("pyramidkv", pyramid_beta=0.5)
    with pytest.raises(InputError, match="gives 3 weights for a model of 2 layers"):
        get_method("h2o", layer_split=(1.0, 2.0, 3.0)).layer_capacities(64, 2)
    with pytest.raises(InputError, match="streamingllm ranks nothing"):
        get_method("streamingllm", layer_split="pyramid")
    with pytest.raises(InputError, match="keep_all_text needs layer_split='uniform'"):
        get_method("lookm", keep_all_text=True, layer_split="pyramid")
    with pytest.raises(ValueError, match="needs the layer"):
        q, k, v, is_image, valid = ref.make_inputs(0)
        get_method("pyramidkv", budget=0.5)(q, k, v, is_image, valid)


@pytest.fixture(scope="module")
def prompt(tiny):
    ids = image_ids(tiny.config.image_seq_length, [3, 4, "img", 5, 6, 7, "img", 8, 9, 10, 11])
    pixels = np.random.default_rng(0).standard_normal((2, 3, 30, 30)).astype(np.float32)
    return ids[None], pixels


def ask_and_step(model, cache: KVCache) -> tuple[np.ndarray, np.ndarray]:
    """A question prefilled onto `cache` and one decode step after it -> (the question's last logits, the
    step's hidden state): what a compressed cache's layout must not change."""
    cfg, params = model.text_config, model.params["text"]
    question = jnp.asarray([[5, 6, 7, 8, 0, 0, 0, 0]], jnp.int32)
    first, logits, cache = gen.prefill_question(cfg, params, cache, question, question > 0, jax.random.key(0),
                                                room=8, sampling=gen.Sampling())
    hidden = llama.decode_step(cfg, params, llama.embed_tokens(params, first[:, None])[:, 0], cache)[0]
    return np.asarray(logits), np.asarray(hidden)


def as_uniform(cache: KVCache) -> KVCache:
    """The same slots in one buffer per layer of the largest layer's size (smaller layers' extra slots empty)."""
    n = cache.num_layers
    return KVCache(layer_keys=tuple(cache.keys[i].swapaxes(-1, -2) for i in range(n)),
                   layer_values=tuple(cache.values[i] for i in range(n)),
                   layer_positions=tuple(cache.positions[i] for i in range(n)), cursor=cache.cursor,
                   next_position=cache.next_position)


@pytest.mark.parametrize("options", [{}, {"layer_split": (3.0, 1.0)}, {"layer_split": (1.0, 3.0)}],
                         ids=["pyramid", "weights-3-1", "weights-1-3"])
def test_per_layer_cache_saves_memory_and_decodes_as_one_buffer(tiny, prompt, options):
    """Each layer's buffers hold its own slots (+ the new tokens), the bytes equal SnapKV's at the same
    budget, and a question and a decode step on it equal those on the same slots in uniform buffers."""
    ids, pixels = prompt
    cfg = tiny.text_config
    method = get_method("pyramidkv", budget=0.4, **options)
    capacities = method.layer_capacities(64, cfg.num_layers)
    assert len(set(capacities)) > 1 and sum(capacities) == cfg.num_layers * get_method("snapkv", budget=0.4).capacity(64)
    context = tiny.prefill_context(ids, pixels, method=method)
    cache = context.cache
    for i, capacity in enumerate(capacities):
        chex.assert_shape(cache.layer_values[i], (1, cfg.num_kv_heads, capacity, cfg.head_dim))
    assert cache.nbytes == tiny.prefill_context(ids, pixels, method=get_method("snapkv", budget=0.4)).cache.nbytes
    length = ids.shape[1]  # 59 of the 64-token bucket: M = N = floor(0.2 * 59) per layer under the uniform budget
    split = list(options.get("layer_split", ())) or "pyramid"
    expected = [min(length, 11 + ref.layer_ranked(11, 12, i, cfg.num_layers, split)) for i in range(cfg.num_layers)]
    assert [int((np.asarray(p) >= 0).sum()) for p in cache.layer_positions] == [cfg.num_kv_heads * e for e in expected]

    for got, want in zip(ask_and_step(tiny, cache), ask_and_step(tiny, as_uniform(cache))):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    uniform = tiny.prefill_context(ids, pixels, method=get_method("snapkv", budget=0.4)).cache
    assert np.abs(ask_and_step(tiny, cache)[0] - ask_and_step(tiny, uniform)[0]).max() > 1e-4
