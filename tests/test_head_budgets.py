"""Head-adaptive budgets (AdaKV): exact allocation vs the float64 reference, the per-head floor, exact
slot totals, one pool of exactly the allocated slots per layer, and decode on it equal to decode on the
same slots laid out per head."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference_lookm as ref
from conftest import image_ids
from lookm_jax import InputError, get_method
from lookm_jax.cache import KVCache
from lookm_jax.compression import heads as head_pool
from lookm_jax.compression.methods.base import LayerIndex
from method_variants import doubled_stats
from test_budgets import ask_and_step

L = 24
BUDGET = {"alpha_recent": 0.2, "alpha_important": 0.2}
LAYER = (0, 3)
# (method, options): AdaKV, and the adaptive split wrapped around other scorers and selection options.
ADAPTIVE = [
    ("adakv", {}),
    ("adakv", {"head_floor": 0.0}),
    ("adakv", {"head_floor": 1.0}),
    ("adakv", {"layer_split": "pyramid"}),
    ("h2o", {"head_split": "adaptive", "head_floor": 0.5}),
    ("lookm", {"head_split": "adaptive", "merge": None}),
    ("lookm", {"head_split": "adaptive"}),  # text-prior, pivotal merge into the head's own kept slots
    ("lookm", {"head_split": "adaptive", "text_prior": False, "n_sink": 2, "merge": "weighted"}),
    ("lookm", {"head_split": "adaptive", "image_quota": 0.5, "merge": None}),
    ("lookm", {"head_split": "adaptive", "image_quota": "proportional", "merge_scope": "same_modality",
               "size_aware": True}),
    ("lookm_quota", {"head_split": "adaptive", "picture_balance": True}),
]


def _ids(variants):
    return [name + "".join(f"-{k}={v}" for k, v in options.items()) for name, options in variants]


@functools.lru_cache(maxsize=None)
def _jitted(method):
    return jax.jit(lambda *arrays, stats: method(*arrays, stats=stats, layer=LayerIndex(*LAYER)))


def _run(method, inputs):
    q, k, _, _, valid = inputs
    return _jitted(method)(*(jnp.asarray(x) for x in inputs), stats=doubled_stats(method, q, k, valid))


# (KV heads, head groups): every variant runs on 4 heads in 2 groups and on one other layout, in turn,
# so each layout meets several variants (the layout and the scorer are independent parts of the code).
LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 1)]
CASES = [(name, options, hkv, groups) for i, (name, options) in enumerate(ADAPTIVE)
         for hkv, groups in ((4, 2), LAYOUTS[i % len(LAYOUTS)])]


@pytest.mark.parametrize("name,options,hkv,groups", CASES,
                         ids=[f"{_ids([(name, options)])[0]}-{hkv}-{groups}" for name, options, hkv, groups in CASES])
def test_adaptive_selection_matches_reference(name, options, hkv, groups):
    """Kept positions exactly the float64 reference's, keys/values (merged) to 1e-5, over 3 seeds of
    ragged rows; the pool is [B, G, H_g x S] with each head's slots contiguous, in head order."""
    method = get_method(name, **BUDGET, **options, head_groups=groups)
    for seed in range(3):
        inputs = ref.make_inputs(seed, hkv=hkv, length=L, lengths=[L, 9 + 5 * seed])
        out = _run(method, inputs)
        size = hkv // groups * method.capacity(L)
        chex.assert_shape([out.keys, out.values], (2, groups, size, 8))
        chex.assert_shape([out.positions, out.mask, out.heads], (2, groups, size))
        ref.check_against(out, ref.run_method(name, {**BUDGET, **options, "head_groups": groups}, *inputs,
                                              layer=LAYER, doubled=ref.doubled(*inputs[:2], inputs[4])))


@pytest.mark.parametrize("head_floor", [0.0, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("hkv,groups", [(2, 1), (4, 1), (4, 2)])
def test_floor_and_exact_totals(hkv, groups, head_floor):
    """Per row: every head keeps its recent window and at least floor(head_floor x N) ranked slots
    (all its candidates if fewer), each group keeps exactly H_g x min(M + N, L_b), so the layer keeps
    Hkv x min(M + N, L_b); floor 1 is the uniform split."""
    method = get_method("adakv", budget=0.5, head_floor=head_floor, head_groups=groups)
    for seed in range(4):
        lengths = [L, int(np.random.default_rng(seed).integers(1, L + 1))]
        inputs = ref.make_inputs(seed, hkv=hkv, length=L, lengths=lengths)
        per_head = _run(method, inputs).per_head(hkv, L)
        kept = np.asarray(per_head.mask).sum(-1)  # [B, Hkv]
        for b, length in enumerate(lengths):
            m, n = ref.budget(0.25, length), ref.budget(0.25, length)
            floor = min(int(np.floor(head_floor * n)), length - min(m, length))
            assert (kept[b] >= min(m, length) + floor).all(), (kept[b], m, floor)
            np.testing.assert_array_equal(kept[b].reshape(groups, -1).sum(-1), hkv // groups * min(m + n, length))
            positions = np.asarray(per_head.positions)[b]
            for h in range(hkv):
                assert set(ref.recent_positions(inputs[4][b], m)) <= set(positions[h][positions[h] >= 0])
            if head_floor == 1.0:
                np.testing.assert_array_equal(kept[b], min(m + n, length))


def test_budget_at_least_prompt_without_merge_is_full_cache():
    """A budget of the whole prompt, merging off: every head keeps every token, as the full cache."""
    inputs = ref.make_inputs(2, hkv=4, length=L, lengths=[L, 10])
    full = _run(get_method("full"), inputs)
    for name, options in (("adakv", {}), ("lookm", {"head_split": "adaptive", "merge": None})):
        for split in ({"alpha_recent": 1.0, "alpha_important": 0.0}, {"alpha_recent": 0.5, "alpha_important": 0.5}):
            out = _run(get_method(name, **split, **options, head_groups=2), inputs)
            chex.assert_trees_all_equal(out.per_head(4, L), full)


def test_refusals():
    for bad, match in (({"head_split": "heads"}, r"head_split must be one of \('uniform', 'adaptive'\), got 'heads'"),
                       ({"head_floor": 1.5}, r"head_floor must be a fraction in \[0, 1\], got 1.5"),
                       ({"head_floor": True}, r"head_floor must be a fraction in \[0, 1\], got True"),
                       ({"head_groups": 0}, r"head_groups must be None or an int >= 1, got 0")):
        with pytest.raises(InputError, match=match):
            get_method("adakv", **bad)
    for options in ({"keep_all_text": True}, {"merge": "averaged", "similarity_filter": True}):
        with pytest.raises(InputError, match="head_split='adaptive' cannot be combined with keep_all_text"):
            get_method("lookm", head_split="adaptive", **options)
    with pytest.raises(InputError, match="streamingllm ranks nothing, so it has no ranked slots to split over heads"):
        get_method("streamingllm", head_split="adaptive")
    with pytest.raises(ValueError, match="head groups dividing 4 KV heads"):
        _run(get_method("adakv", budget=0.5, head_groups=3), ref.make_inputs(0, hkv=4))


@pytest.fixture(scope="module")
def prompt(tiny):
    ids = image_ids(tiny.config.image_seq_length, [3, 4, "img", 5, 6, 7, "img", 8, 9, 10, 11])
    pixels = np.random.default_rng(0).standard_normal((2, 3, 30, 30)).astype(np.float32)
    return ids[None], pixels


def per_head_buffers(cache: KVCache) -> KVCache:
    """The same slots laid out per KV head (`KVCache.keys` etc.: each head's pool slots first, padded
    to H_g x P, then its new tokens), in uniform buffers with no pool."""
    n = cache.num_layers
    width = cache.keys.shape[3] - cache.layer_values[0].shape[2]  # the prompt slots of the per-head view
    return KVCache(layer_keys=tuple(cache.keys[i].swapaxes(-1, -2) for i in range(n)),
                   layer_values=tuple(cache.values[i] for i in range(n)),
                   layer_positions=tuple(cache.positions[i] for i in range(n)),
                   cursor=cache.cursor - cache.shift(0) + width, next_position=cache.next_position,
                   layer_log_counts=None if cache.layer_log_counts is None else tuple(
                       jnp.concatenate([head_pool.unpool(pool.log_counts, pool.heads, counts.shape[1], width),
                                        counts], -1) for pool, counts in zip(cache.layer_pools, cache.layer_log_counts)))


@pytest.mark.parametrize("name,options", [("adakv", {"layer_split": "pyramid"}),  # (a capacity per layer)
                                          ("lookm", {"head_split": "adaptive", "text_prior": False, "merge": "averaged",
                                                     "size_aware": True})],
                         ids=["adakv-pyramid", "lookm-adaptive-size-aware"])
def test_pool_saves_memory_and_decodes_as_per_head_buffers(tiny, prompt, name, options):
    """Each layer's pool holds exactly Hkv x P_l prompt slots (per-head buffers only the new tokens),
    the bytes equal the uniform method's at the same budget (and GenerationResult.cache_bytes), every
    layer keeps Hkv x min(M + N_l, L) slots in all, and a question and a decode step on the pool equal
    those on the same slots laid out per head."""
    ids, pixels = prompt
    cfg = tiny.text_config
    method = get_method(name, budget=0.4, **options)
    uniform = get_method(name, budget=0.4, **{k: v for k, v in options.items() if k != "head_split"},
                         head_split="uniform")
    assert uniform.layer_capacities(64, cfg.num_layers) == method.layer_capacities(64, cfg.num_layers)
    cache = tiny.prefill_context(ids, pixels, method=method).cache
    for i, capacity in enumerate(method.layer_capacities(64, cfg.num_layers)):
        chex.assert_shape(cache.layer_pools[i].values, (1, 1, cfg.num_kv_heads * capacity, cfg.head_dim))
        chex.assert_shape(cache.layer_pools[i].keys, (1, 1, cfg.head_dim, cfg.num_kv_heads * capacity))
        chex.assert_shape(cache.layer_values[i], (1, cfg.num_kv_heads, 0, cfg.head_dim))
    assert cache.nbytes == tiny.prefill_context(ids, pixels, method=uniform).cache.nbytes
    run = functools.partial(tiny.run, ids, pixels, max_new_tokens=4)
    assert run(method=method).cache_bytes == run(method=uniform).cache_bytes
    length = ids.shape[1]  # 59 of the 64-token bucket: M = N = 11
    split = "pyramid" if "layer_split" in options else [1.0] * cfg.num_layers
    expected = [min(length, 11 + ref.layer_ranked(11, 12, i, cfg.num_layers, split)) for i in range(cfg.num_layers)]
    assert [int((np.asarray(p.heads) >= 0).sum()) for p in cache.layer_pools] == [cfg.num_kv_heads * e
                                                                                   for e in expected]

    for got, want in zip(ask_and_step(tiny, cache), ask_and_step(tiny, per_head_buffers(cache))):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    if name == "adakv":  # (accumulated attention ranks by position alike in every head of the random tiny model)
        heads = [np.bincount(np.asarray(p.heads)[p.heads >= 0], minlength=cfg.num_kv_heads) for p in cache.layer_pools]
        assert any(len(set(h)) > 1 for h in heads), heads  # the heads did keep different numbers
        assert np.abs(ask_and_step(tiny, cache)[0] - ask_and_step(tiny, tiny.prefill_context(
            ids, pixels, method=uniform).cache)[0]).max() > 1e-4
