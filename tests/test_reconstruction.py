"""Context reconstruction (KVzip's scores, `scores="reconstruction"`): the doubled prompt, the statistic
against the float64 reference, the method against the reference, and the prefill on a tiny LLaVA."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference_lookm as ref
from lookm_jax import InputError, get_method, sweep
from lookm_jax import generate as gen
from lookm_jax.compression.reconstruction import doubled_marks, doubled_prompt
from lookm_jax.compression.scoring import RECONSTRUCTION, STATISTICS, SUMS, column_stats
from lookm_jax.models import llama, llava

BUDGET = {"alpha_recent": 0.2, "alpha_important": 0.2}


def _doubled_inputs(seed, *, length=12, lengths=(12, 7), hq=4, hkv=2, dim=8):
    """Random q/k/v over [prompt ; prompt] rows (the copy's q/k differ from the prompt's: deeper layers'
    do), the prompt's flags, and (valid, second) over 2L."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    q = rng.standard_normal((b, hq, 2 * length, dim)).astype(np.float32)
    k, v = (rng.standard_normal((b, hkv, 2 * length, dim)).astype(np.float32) for _ in range(2))
    n = np.asarray(lengths)[:, None]
    index = np.arange(2 * length)[None]
    valid2, second = index < 2 * n, (index >= n) & (index < 2 * n)
    is_image = rng.random((b, length)) < 0.6
    return q, k, v, is_image, (index < n)[:, :length], valid2, second


def test_doubled_prompt_copies_each_row_after_itself():
    x = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
    valid = jnp.asarray([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
    positions = jnp.asarray([[0, 1, 2, 0], [0, 1, 0, 0]], jnp.int32)
    x2, valid2, pos2, masks = doubled_prompt(x, valid, positions, jnp.asarray([3, 2], jnp.int32))
    chex.assert_shape(x2, (2, 8, 3))
    np.testing.assert_array_equal(x2[0, :6], np.concatenate([x[0, :3], x[0, :3]]))
    np.testing.assert_array_equal(x2[1, :4], np.concatenate([x[1, :2], x[1, :2]]))
    assert not np.asarray(x2[0, 6:]).any() and not np.asarray(x2[1, 4:]).any()
    np.testing.assert_array_equal(valid2, [[1] * 6 + [0] * 2, [1] * 4 + [0] * 4])
    np.testing.assert_array_equal(pos2, [[0, 1, 2, 3, 4, 5, 0, 0], [0, 1, 2, 3, 0, 0, 0, 0]])
    np.testing.assert_array_equal(masks[RECONSTRUCTION], [[0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0, 0, 0]])
    for name in STATISTICS:
        np.testing.assert_array_equal(masks[name], [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]])
    marks = jnp.asarray([[0, 1, 1, 1], [1, 0, 1, 1]], bool)  # the last marks sit on padding
    np.testing.assert_array_equal(doubled_marks(marks, valid), [[0, 1, 1, 0, 1, 1, 0, 0], [1, 0, 1, 0, 0, 0, 0, 0]])
    # M-RoPE's three position rows all move by the row's next position
    mrope = jnp.stack([positions, positions + 10, positions + 20])
    _, _, pos3, _ = doubled_prompt(x, valid, mrope, jnp.asarray([30, 25], jnp.int32))
    np.testing.assert_array_equal(pos3[1, 0, :6], [10, 11, 12, 40, 41, 42])


@pytest.mark.parametrize("hkv,block", [(1, 5), (2, 7)])
def test_reconstruction_statistic_matches_reference(hkv, block):
    """The prefill attention's accumulated maximum and the standalone one equal the float64 reference (1e-5),
    while the prompt's sums count the first copy's queries only (eq. 4 of the prompt alone)."""
    q, k, v, _, _, valid2, second = _doubled_inputs(3, hkv=hkv)
    first = valid2 & ~second
    masks = {SUMS: jnp.asarray(first), RECONSTRUCTION: jnp.asarray(second)}
    names = (SUMS, RECONSTRUCTION)
    attention = jax.jit(llama.causal_attention, static_argnames=("block", "statistics"))
    _, stats = attention(*map(jnp.asarray, (q, k, v, valid2)), block=block, statistics=names, query_masks=masks)
    standalone = column_stats(*map(jnp.asarray, (q, k, valid2)), names, block=4, query_masks=masks)
    want = ref.reconstruction_maxima(q.astype(np.float64), k.astype(np.float64), valid2, second)
    for got in (stats, standalone):
        chex.assert_shape(got[RECONSTRUCTION], (2, hkv, 4 // hkv, 24))
        np.testing.assert_allclose(got[RECONSTRUCTION].reshape(2, 4, 24), want, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(got[SUMS].mean(2)[..., :12], ref.attention_scores(
            q[:, :, :12].astype(np.float64), k[:, :, :12].astype(np.float64), first[:, :12]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,params,lengths", [
    ("lookm_quota", {"scores": "reconstruction"}, (12, 7)),
    ("lookm", {"scores": "reconstruction", "merge": None}, (12, 7)),
    ("lookm", {"scores": "reconstruction", "merge": "averaged"}, (12, 7)),
    ("lookm_quota", {}, (12, 7)),
    ("lookm_quota", {}, (44, 37)),  # longer than the votes' window of 32 queries
    ("lookm", {"scores": "split", "reconstruction_weight": 0.4}, (12, 7))])
def test_reconstruction_method_matches_reference(name, params, lengths):
    """Reconstruction scores, and split ones (text by eq. 4 of the first copy's queries; image tokens by
    shares of the second copy's maxima and the last queries' votes), select as the float64 reference."""
    length = lengths[0]
    q, k, v, is_image, valid, valid2, second = _doubled_inputs(4, length=length, lengths=lengths)
    method = get_method(name, **BUDGET, **params)
    first = valid2 & ~second
    stats = column_stats(*map(jnp.asarray, (q, k, valid2)), method.statistics, query_masks={
        SUMS: jnp.asarray(first), RECONSTRUCTION: jnp.asarray(second)})
    context = [jnp.asarray(a[:, :, :length]) for a in (q, k, v)]
    out = jax.jit(lambda *a: method(*a, stats={stat: s[..., :length] for stat, s in stats.items()}))(
        *context, jnp.asarray(is_image), jnp.asarray(valid))
    want = ref.run_method(name, {**BUDGET, **params}, *(a[:, :, :length] for a in (q, k, v)), is_image, valid,
                          doubled=(q, k, valid2, second))
    ref.check_against(out, want)


def test_reconstruction_without_its_queries_is_refused():
    q, k, v, is_image, valid, _, _ = _doubled_inputs(0)
    method = get_method("lookm_quota", budget=0.4, scores="reconstruction")
    with pytest.raises(ValueError, match="second copy: run the method through a prefill"):
        method(*(jnp.asarray(a[:, :, :12]) for a in (q, k, v)), jnp.asarray(is_image), jnp.asarray(valid))
    with pytest.raises(InputError, match=r"scores must be one of \('attention', 'reconstruction', 'split'\), got 'kvzip'"):
        get_method("lookm", budget=0.4, scores="kvzip")
    with pytest.raises(InputError, match=r"reconstruction_weight must be a fraction in \[0, 1\], got 1.5"):
        get_method("lookm", budget=0.4, scores="split", reconstruction_weight=1.5)
    with pytest.raises(InputError, match="reconstruction_weight only applies with scores='split'"):
        get_method("lookm", budget=0.4, reconstruction_weight=0.3)
    with pytest.raises(InputError, match="only text_prior=True keeps apart"):
        get_method("lookm", budget=0.4, scores="split", text_prior=False)


# ---- the prefill, on a tiny LLaVA -------------------------------------------------------------------

def _prefilled(model, ids, valid, pixels, statistics):
    return gen.prefill_states(model.config, model.params, jnp.asarray(ids), jnp.asarray(valid), pixels,
                              jax.random.key(0), statistics=statistics, window=1, sampling=gen.Sampling())


def test_prefill_twice_over_keeps_the_plain_prompt_and_scores_it_as_the_reference(tiny, tiny_prompt):
    """The first copy's keys and values (at its tokens), first token and next position are the plain prefill's (1e-5),
    and every layer's statistic is the reference's maximum over the copy's own queries and keys."""
    ids, pixels = tiny_prompt
    packed, valid = gen.pack_prompts(np.concatenate([ids, ids]), np.asarray([[1] * ids.shape[1], [1] * 50 +
                                                                              [0] * (ids.shape[1] - 50)], bool))
    pixels = jnp.concatenate([pixels, pixels])
    plain = _prefilled(tiny, packed, valid, pixels, ())
    twice = _prefilled(tiny, packed, valid, pixels, (SUMS, RECONSTRUCTION))
    real = valid[None, :, None, :, None]  # padding slots hold the copy's keys, never attended
    for got, want in ((twice.keys, plain.keys), (twice.values, plain.values)):
        np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(twice.first, plain.first)
    np.testing.assert_array_equal(twice.next_position, plain.next_position)
    np.testing.assert_array_equal(twice.is_image, plain.is_image)
    # the copy's q/k straight from the decoder, then the reference over them
    cfg, text_cfg = tiny.config, tiny.text_config
    x, _ = llava.embed(cfg, tiny.params, jnp.asarray(packed), pixels)
    positions, next_position = llava.rope_positions(cfg, jnp.asarray(packed), jnp.asarray(valid), pixels)
    x2, valid2, positions2, masks = doubled_prompt(x, jnp.asarray(valid), positions, next_position)
    _, (q2, k2) = llama.encode(text_cfg, tiny.params["text"], x2, valid2, (), lambda q, k, v, s, i: (q, k), positions2)
    length = packed.shape[1]
    sums = _prefilled(tiny, packed, valid, pixels, (SUMS,)).stats[SUMS]
    for layer in range(text_cfg.num_layers):
        args = (np.asarray(q2[layer], np.float64), np.asarray(k2[layer], np.float64), np.asarray(valid2))
        want = ref.reconstruction_maxima(*args, np.asarray(masks[RECONSTRUCTION]))[..., :length]
        got = twice.stats[RECONSTRUCTION][layer]
        np.testing.assert_allclose(got.reshape(want.shape), want, atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(twice.stats[SUMS][layer], sums[layer], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scores", ["reconstruction", "split"])
def test_reconstruction_runs_as_its_shared_prefill_and_covering_budget_is_the_full_cache(tiny, tiny_prompt, scores):
    """Model.run gives the shared prefill's tokens (split: the 32 voting queries of a 59-token prompt kept
    beside the doubled prefill's statistics), and a budget covering the prompt gives the full cache's."""
    ids, pixels = tiny_prompt
    method = get_method("lookm_quota", budget=0.4, scores=scores)
    result = tiny.run(ids, pixels, max_new_tokens=6, method=method)
    shared, full_shared = sweep.generate_methods(tiny, ids, pixels, max_new_tokens=6,
                                                 methods=[method, get_method("full")])
    np.testing.assert_array_equal(result.tokens, shared)
    assert result.cache_bytes < result.full_cache_bytes
    covering = get_method("lookm_quota", alpha_recent=1.0, alpha_important=0.0, scores=scores)
    np.testing.assert_array_equal(tiny.run(ids, pixels, max_new_tokens=6, method=covering).tokens, full_shared)


def test_a_prompt_read_twice_over_must_fit_the_context(tiny, tiny_prompt):
    """59 tokens read twice over number 118 positions: refused under a context of 100, unless deliberately."""
    short = dataclasses.replace(tiny, config=dataclasses.replace(
        tiny.config, text=dataclasses.replace(tiny.text_config, max_position_embeddings=100)), _compiled={})
    method = get_method("lookm_quota", budget=0.4)  # its default scores="split" reads the prompt twice over too
    with pytest.raises(InputError, match=r"reads a prompt of 59 tokens twice over: 118 positions exceed the model's "
                                         r"context length \(100, max_position_embeddings\); use a prompt of at most 50"):
        short.run(*tiny_prompt, max_new_tokens=2, method=method)
    eq4 = get_method("lookm_quota", budget=0.4, scores="attention")
    assert short.run(*tiny_prompt, max_new_tokens=2, method=eq4).tokens.shape == (1, 2)
    assert short.run(*tiny_prompt, max_new_tokens=2, method=method, ignore_context_limit=True).tokens.shape == (1, 2)
