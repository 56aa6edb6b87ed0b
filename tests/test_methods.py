"""Every registered method: reference agreement, budgets, padding, raggedness, GQA, jit-staticness."""

import functools
import re

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import reference_lookm as ref
from lookm_jax import METHODS, InputError, get_method
from lookm_jax.compression.methods import LookM, ScorerMethod
from lookm_jax.compression.methods.base import LayerIndex
from method_variants import DEFAULTS, VARIANTS, build, doubled_stats, ids

L = 24
BUDGET = {"alpha_recent": 0.2, "alpha_important": 0.2}
LAYER = (0, 3)  # methods with a per-layer split compress the first of three layers (the most slots)


def _default(name, **kwargs):
    return build(name, kwargs, **BUDGET)


@functools.lru_cache(maxsize=None)
def _jitted(method):
    """One compiled program per (method, shapes)."""
    return jax.jit(lambda *arrays, stats: method(*arrays, stats=stats, layer=LayerIndex(*LAYER)))


def _run(method, q, k, v, is_image, valid):
    return _jitted(method)(*(jnp.asarray(x) for x in (q, k, v, is_image, valid)),
                           stats=doubled_stats(method, q, k, valid))


def _reference(name, params, q, k, v, is_image, valid):
    return ref.run_method(name, {**BUDGET, **params}, q, k, v, is_image, valid, layer=LAYER,
                          doubled=ref.doubled(q, k, valid))




@pytest.mark.parametrize("name,params", VARIANTS, ids=ids(VARIANTS))
def test_matches_reference(name, params):
    inputs = ref.make_inputs(0, length=L, lengths=[L, 15])
    method = _default(name, **params)
    out = _run(method, *inputs)
    s = method.capacity(L)
    shape = (2, 2, s) if out.heads is None else (2, 1, 2 * s)  # head-adaptive: one pool of both heads' slots
    chex.assert_shape([out.keys, out.values], shape + (8,))
    chex.assert_shape([out.positions, out.mask] + ([] if out.heads is None else [out.heads]), shape)
    chex.assert_type([out.keys, out.positions, out.mask], [jnp.float32, jnp.int32, jnp.bool_])
    ref.check_against(out, _reference(name, params, *inputs))


@pytest.mark.parametrize("hkv", [1, 4])
@pytest.mark.parametrize("name,params", VARIANTS, ids=ids(VARIANTS))
def test_gqa_matches_reference(name, params, hkv):
    """1 and all KV heads (2 is covered above) with 4 query heads: group-averaged scores."""
    inputs = ref.make_inputs(1, hkv=hkv, length=16, lengths=[16, 11])
    ref.check_against(_run(_default(name, **params), *inputs), _reference(name, params, *inputs))


@pytest.mark.parametrize("name", [name for name, _ in DEFAULTS])
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lengths=st.lists(st.integers(1, L), min_size=2, max_size=2))
def test_budget_and_padding(name, seed, lengths):
    """Exactly min(M + N, L_b) kept per head (all L_b for full; head-adaptive: twice that over the two
    heads), the always-kept tail (a text window's: the text after the last picture) is kept, padding is
    never kept, and garbage at padded positions changes nothing (never attended)."""
    method = _default(name)
    q, k, v, is_image, valid = ref.make_inputs(seed, length=L, lengths=lengths)
    out = _run(method, q, k, v, is_image, valid)
    noisy = [x.copy() for x in (q, k, v)]
    rng = np.random.default_rng(seed)
    for x in noisy:
        for b in range(2):
            x[b, :, ~valid[b]] = rng.normal(scale=50, size=x[b, :, ~valid[b]].shape)
    chex.assert_trees_all_equal(out, _run(method, *noisy, is_image, valid))
    adaptive = out.heads is not None
    if adaptive:
        out = out.per_head(2, L)
    pos, mask = np.asarray(out.positions), np.asarray(out.mask)
    for b, n_b in enumerate(lengths):
        if isinstance(method, ScorerMethod):
            m_b, n_max = ref.budget(0.2, n_b), ref.budget(0.2, L)
            total = m_b + (ref.layer_ranked(m_b, n_max, *LAYER, "pyramid") if name == "pyramidkv" else m_b)
            tail = total - min(4, total) if name == "streamingllm" else m_b
            if method.selection().text_window:  # the window: the row's text after its last picture
                tail = ref.text_window(valid[b:b + 1], is_image[b:b + 1], [m_b], [0])[0][0]
        else:
            tail = total = n_b
        assert mask[b].sum() == 2 * min(total, n_b)
        for h in range(2):
            kept = pos[b, h][mask[b, h]]
            assert adaptive or len(kept) == min(total, n_b)
            assert valid[b, kept].all()
            assert set(ref.recent_positions(valid[b], tail)) <= set(kept)


@pytest.mark.parametrize("name", [m for m in METHODS if m != "full"])
def test_budget_at_least_prompt_without_merge_is_full_cache(name):
    """A budget of 1 (all of it recent) with merging off: bit-for-bit the full cache."""
    params = {"alpha_recent": 1.0, "alpha_important": 0.0} | ({"merge": None} if name == "lookm" else {})
    method = get_method(name, **params)
    inputs = ref.make_inputs(2, length=L, lengths=[L, 10])
    assert method.capacity(L) == L
    out = _run(method, *inputs)
    if out.heads is not None:  # head-adaptive: its pool read per head
        out = out.per_head(2, L)
    chex.assert_trees_all_equal(out, _run(get_method("full"), *inputs))


@pytest.mark.parametrize("name,params", VARIANTS, ids=ids(VARIANTS))
def test_ragged_row_equals_row_alone(name, params):
    """A right-padded row of a batch gets the same cache as the same row run alone, unpadded."""
    method = _default(name, **params)
    q, k, v, is_image, valid = ref.make_inputs(3, length=L, lengths=[L, 13])
    batch = _run(method, q, k, v, is_image, valid)
    alone = _run(method, *(x[1:, ..., :13, :] for x in (q, k, v)), is_image[1:, :13], valid[1:, :13])
    s = alone.capacity
    np.testing.assert_array_equal(batch.positions[1, :, :s], alone.positions[0])
    np.testing.assert_array_equal(batch.positions[1, :, s:], -1)
    np.testing.assert_allclose(batch.keys[1, :, :s], alone.keys[0], atol=1e-6)
    np.testing.assert_allclose(batch.values[1, :, :s], alone.values[0], atol=1e-6)


def test_one_compilation_per_bucket():
    """Methods are hashable static arguments; prompts of any length in a bucket share one program."""
    method = get_method("lookm")
    assert hash(method) == hash(get_method("lookm", alpha_recent=0.1, alpha_important=0.1, merge="pivotal"))
    fn = jax.jit(lambda m, *arrays: m(*arrays), static_argnums=0)
    for lengths in ([L, 5], [7, 19], [1, L]):
        fn(method, *(jnp.asarray(x) for x in ref.make_inputs(4, length=L, lengths=lengths)))
    assert fn._cache_size() == 1


def test_get_method():
    assert METHODS == ("full", "streamingllm", "h2o", "snapkv", "pyramidkv", "adakv", "roco", "lookm", "lookm_quota")
    assert get_method("lookm") == LookM(alpha_recent=0.1, alpha_important=0.1, merge="pivotal", text_prior=True)
    assert get_method("h2o", budget=0.2) == get_method("h2o", alpha_recent=0.1, alpha_important=0.1)
    assert get_method("full").capacity(100) == 100
    assert get_method("lookm", budget=0.2).capacity(100) == 20
    shared = get_method("h2o", budget=0.2, recent_share=0.25)
    np.testing.assert_allclose([shared.alpha_recent, shared.alpha_important], [0.05, 0.15])
    assert shared.bucket_slots(100) == (5, 15) and get_method("h2o", budget=0.2).bucket_slots(100) == (10, 10)
    assert get_method("lookm_quota", budget=0.2).bucket_slots(100) == (10, 10)  # half: its text window
    assert get_method("snapkv", budget=0.2, recent_share=0.0).bucket_slots(100) == (0, 20)
    assert get_method("lookm", keep_all_text=True, capacity_ratio=0.5).capacity(100) == 50
    for bad, message in ((dict(recent_share=0.5), "recent_share splits a budget: give budget too"),
                         (dict(budget=0.2, recent_share=1.5), "recent_share must be a fraction in [0, 1], got 1.5"),
                         (dict(budget=0.2, recent_share="half"), "recent_share must be a fraction in [0, 1], got 'half'")):
        with pytest.raises(InputError, match=re.escape(message)):
            get_method("h2o", **bad)
    with pytest.raises(InputError, match="method 'full' takes no recent_share"):
        get_method("full", recent_share=0.5)
    for bad in (lambda: get_method("nope"), lambda: get_method("full", budget=0.2),
                lambda: get_method("lookm", budget=0.2, alpha_recent=0.1),
                lambda: get_method("lookm", merge="median"), lambda: get_method("lookm", text_prior=False,
                                                                              keep_all_text=True),
                lambda: get_method("snapkv", kernel_size=4)):
        with pytest.raises(ValueError):
            bad()
