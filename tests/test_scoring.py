"""Scoring: eq. 4, RoCo mean/std and SnapKV window scores against the float64 reference."""

import re

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import reference_lookm as ref
from lookm_jax import attention_scores, get_method
from lookm_jax.compression.scoring import attention_mean_std, window_scores


@pytest.mark.parametrize("hkv", [1, 2, 4])
@pytest.mark.parametrize("block", [4, 128])
def test_attention_scores_match_reference(hkv, block):
    q, k, _, _, valid = ref.make_inputs(0, hkv=hkv, length=13, lengths=[13, 9])
    valid[1, 4] = False  # padding need not be on the right
    got = attention_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(valid), block=block)
    chex.assert_shape(got, (2, hkv, 13))
    chex.assert_type(got, jnp.float32)
    np.testing.assert_allclose(got, ref.attention_scores(q, k, valid), atol=1e-5, rtol=1e-5)
    # every valid query row sums to one, so the scores of a row sum to its length
    np.testing.assert_allclose(got.sum(-1), np.broadcast_to(valid.sum(-1)[:, None], (2, hkv)), rtol=1e-5)


def test_attention_scores_bf16_inputs_are_scored_in_fp32():
    q, k, _, _, valid = ref.make_inputs(1, length=10)
    got = attention_scores(jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(valid))
    chex.assert_type(got, jnp.float32)
    want = ref.attention_scores(np.asarray(jnp.asarray(q, jnp.bfloat16), np.float64),
                                np.asarray(jnp.asarray(k, jnp.bfloat16), np.float64), valid)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_mean_std_match_reference():
    q, k, _, _, valid = ref.make_inputs(2, length=11, lengths=[11, 6])
    mean, std = attention_mean_std(jnp.asarray(q), jnp.asarray(k), jnp.asarray(valid), block=4)
    want_mean, want_std = ref.mean_std(q, k, valid)
    np.testing.assert_allclose(mean, want_mean, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(std, want_std, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kernel_size,pooling", [(7, "max"), (5, "avg"), (1, "max")])
def test_window_scores_match_reference(kernel_size, pooling):
    q, k, _, _, valid = ref.make_inputs(3, length=16, lengths=[16, 7])
    window, m = [5, 9], [3, 2]
    candidates = valid.copy()
    for b in range(2):
        candidates[b, ref.recent_positions(valid[b], m[b])] = False
    got = window_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(valid), jnp.asarray(candidates),
                        jnp.asarray(window), max_window=9, kernel_size=kernel_size, pooling=pooling)
    want = ref.window_scores(q, k, valid, window, m, kernel_size, pooling)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


_scores = jax.jit(lambda q, k, valid: (attention_scores(q, k, valid, block=8),
                                       *attention_mean_std(q, k, valid, block=8)))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n0=st.integers(1, 20), n1=st.integers(1, 20))
def test_padding_is_never_attended(seed, n0, n1):
    """Garbage at padded positions changes no score, and padding scores are zero."""
    q, k, _, _, valid = ref.make_inputs(seed, length=20, lengths=[n0, n1])
    rng = np.random.default_rng(seed + 1)
    q2, k2 = q.copy(), k.copy()
    for b in range(2):
        q2[b, :, ~valid[b]] = rng.normal(scale=30, size=q2[b, :, ~valid[b]].shape)
        k2[b, :, ~valid[b]] = rng.normal(scale=30, size=k2[b, :, ~valid[b]].shape)
    a = _scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(valid))
    b_ = _scores(jnp.asarray(q2), jnp.asarray(k2), jnp.asarray(valid))
    for x, y in zip(a, b_):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(np.asarray(x)[np.broadcast_to(~valid[:, None], x.shape)], 0)


def _jaxpr_shapes(jaxpr):
    """Shapes of every intermediate of a jaxpr, including inside scan / cond / pjit bodies."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield tuple(getattr(var.aval, "shape", ()))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _jaxpr_shapes(inner)


@pytest.mark.parametrize("what", ["attention_scores", "lookm"])
def test_no_quadratic_intermediate(what):
    """At L = 2048 no [L, L]-sized array exists per head: peak O(L x block)."""
    b, hq, hkv, length, d, block = 1, 4, 2, 2048, 16, 64
    q = jax.ShapeDtypeStruct((b, hq, length, d), jnp.float32)
    kv = jax.ShapeDtypeStruct((b, hkv, length, d), jnp.float32)
    flags = jax.ShapeDtypeStruct((b, length), jnp.bool_)
    if what == "attention_scores":
        fn, args = (lambda q, k, valid: attention_scores(q, k, valid, block=block)), (q, kv, flags)
    else:
        method = get_method("lookm", merge="weighted", similarity_filter=True, block=block)
        fn, args = (lambda *a: method(*a)), (q, kv, kv, flags, flags)
    limit = 4 * b * hq * length * block  # O(L x block); a per-head [L, L] array is 8x larger
    shapes = list(_jaxpr_shapes(jax.make_jaxpr(fn)(*args).jaxpr))
    assert max(int(np.prod(s)) for s in shapes) <= limit
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    for dims in re.findall(r"\[([\d,]+)\]", hlo):
        sizes = [int(x) for x in dims.split(",") if x]
        assert sum(x >= length for x in sizes) <= 1, f"quadratic buffer {sizes} in compiled HLO"
