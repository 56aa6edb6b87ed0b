"""Merging (eq. 9-12): reference agreement, convexity, eq. 12 weights, negative cosines."""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import reference_lookm as ref
from lookm_jax import compress_kv

B, H, L, D = 2, 2, 20, 8


def _inputs(seed, lengths):
    rng = np.random.default_rng(seed)
    _, k, v, is_image, valid = ref.make_inputs(seed, batch=B, hkv=H, length=L, lengths=lengths)
    return k, v, rng.random((B, H, L)).astype(np.float32), is_image, valid


@pytest.mark.parametrize("merge,similarity_filter,text_prior", [
    ("averaged", False, True), ("averaged", True, False),
    ("pivotal", False, False), ("pivotal", True, True),
    ("weighted", False, True), ("weighted", True, False),
])
def test_matches_reference(merge, similarity_filter, text_prior):
    k, v, scores, is_image, valid = _inputs(0, [20, 13])
    m, n = [3, 2], [4, 3]
    out = compress_kv(jnp.asarray(k), jnp.asarray(v), jnp.asarray(scores), is_image=jnp.asarray(is_image),
                      valid=jnp.asarray(valid), n_recent=np.array(m), n_important=np.array(n),
                      text_prior=text_prior, merge=merge, similarity_filter=similarity_filter, block=8)
    kept = ref.select(scores, valid, is_image, m, n, text_prior=text_prior)
    merged = ref.merge(k, v, kept, valid, merge, similarity_filter)
    ref.check_against(out, {bh: (p, *merged[bh][:2]) for bh, p in kept.items()})


@functools.partial(jax.jit, static_argnames="merge")
def _merge_one_hot(k, scores, is_image, valid, m, n, merge):
    """Values are one-hot rows, so merged value slot s reads off the weight of every token in it."""
    one_hot = jnp.broadcast_to(jnp.eye(L), (B, H, L, L))
    return compress_kv(k, one_hot, scores, is_image=is_image, valid=valid, n_recent=m, n_important=n,
                       merge=merge, capacity=L, block=8)


_lengths = st.lists(st.integers(1, L), min_size=B, max_size=B)
_budgets = st.lists(st.integers(0, 6), min_size=B, max_size=B)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lengths=_lengths, m=_budgets, n=_budgets,
       merge=st.sampled_from(["averaged", "pivotal", "weighted"]))
def test_merge_weights(seed, lengths, m, n, merge):
    """Averaged and pivotal: convex (weights >= 0, sum 1). Weighted: exactly eq. 12, the kept pair
    with weight 1 and each merged pair with its raw cosine, over 1 + n_s. Keys use the same weights."""
    k, _, scores, is_image, valid = _inputs(seed, lengths)
    out = _merge_one_hot(k, scores, is_image, valid, np.array(m), np.array(n), merge)
    weights, pos, mask = (np.asarray(x, np.float64) for x in (out.values, out.positions, out.mask))
    merged_keys = np.asarray(out.keys, np.float64)
    for b in range(B):
        for h in range(H):
            occ = mask[b, h].astype(bool)
            w = weights[b, h][occ]  # [S_occ, L]
            np.testing.assert_allclose(merged_keys[b, h][occ], w @ k[b, h], atol=1e-5)
            if merge != "weighted":
                assert (w >= 0).all()
                np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)
                continue
            kept = pos[b, h][occ].astype(int)
            unit = k[b, h] / np.linalg.norm(k[b, h], axis=-1, keepdims=True)
            want = np.zeros_like(w)
            want[np.arange(len(kept)), kept] = 1.0
            for e in set(np.flatnonzero(valid[b])) - set(kept) if len(kept) else ():
                cos = unit[kept] @ unit[e]
                want[np.argmax(cos), e] = cos.max()
            want /= (want != 0).sum(-1, keepdims=True)
            np.testing.assert_allclose(w, want, atol=1e-6)


def test_weighted_negative_cosine_subtracts_the_evicted_pair():
    """An evicted key at an obtuse angle to every kept key merges with a negative weight: it is
    subtracted from its best (least dissimilar) kept pair, which also shrinks by 1 / (1 + n)."""
    k = jnp.array([[-1.0, 0.0], [1.0, 0.2], [1.0, -0.5]])[None, None]  # [1, 1, 3, 2]
    v = jnp.array([[1.0, 1.0], [0.0, 1.0], [1.0, 0.0]])[None, None]
    flags = jnp.ones((1, 3), bool)
    out = compress_kv(k, v, jnp.zeros((1, 1, 3)), is_image=~flags, valid=flags, n_recent=2, n_important=0,
                      merge="weighted")
    cos = -1.0 / np.sqrt(1.25)  # token 0 vs token 2: the best of two negative cosines
    np.testing.assert_array_equal(out.positions[0, 0], [1, 2])
    np.testing.assert_allclose(out.values[0, 0], [[0.0, 1.0], [(1.0 + cos) / 2, cos / 2]], atol=1e-6)
    np.testing.assert_allclose(out.keys[0, 0], [[1.0, 0.2], [(1.0 - cos) / 2, -0.25]], atol=1e-6)


def test_assignment_picks_the_first_of_tied_slots_like_argmax():
    """`reductions.first_max` (two plain reductions instead of XLA:CPU's slow argmax) returns
    jnp.argmax's index, the lowest of tied slots, and the maximum; a row with no kept slot (all
    -inf) gets slot 0 as argmax does."""
    from lookm_jax.reductions import first_max

    rng = np.random.default_rng(0)
    x = rng.integers(0, 4, (64, 9)).astype(np.float32)  # many ties
    x[3] = -np.inf
    index, top = first_max(jnp.asarray(x))
    np.testing.assert_array_equal(index, np.argmax(x, -1))
    np.testing.assert_array_equal(top, x.max(-1))
    assert index[3] == 0


@pytest.mark.parametrize("merge", ["averaged", "pivotal", "weighted"])
@pytest.mark.parametrize("text_prior,image_quota", [(True, None), (True, "proportional"), (False, 0.5)])
def test_same_modality_scope_matches_reference(merge, text_prior, image_quota):
    k, v, scores, is_image, valid = _inputs(4, [20, 14])
    m, n = [3, 2], [5, 4]
    out = compress_kv(jnp.asarray(k), jnp.asarray(v), jnp.asarray(scores), is_image=jnp.asarray(is_image),
                      valid=jnp.asarray(valid), n_recent=np.array(m), n_important=np.array(n),
                      text_prior=text_prior, merge=merge, image_quota=image_quota, merge_scope="same_modality",
                      block=8)
    kept = ref.select(scores, valid, is_image, m, n, text_prior=text_prior, image_quota=image_quota)
    merged = ref.merge(k, v, kept, valid, merge, is_image=is_image)
    ref.check_against(out, {bh: (p, *merged[bh][:2]) for bh, p in kept.items()})


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lengths=_lengths, m=_budgets, n=_budgets,
       merge=st.sampled_from(["averaged", "pivotal", "weighted"]))
def test_same_modality_never_merges_across_modalities(seed, lengths, m, n, merge):
    """One-hot values read off every token's weight in each slot: an image slot holds no text token
    and a text slot no image token; a token whose head kept no slot of its modality is in no slot."""
    k, _, scores, is_image, valid = _inputs(seed, lengths)
    one_hot = jnp.broadcast_to(jnp.eye(L), (B, H, L, L))
    out = jax.jit(functools.partial(compress_kv, merge=merge, merge_scope="same_modality", capacity=L, block=8))(
        k, one_hot, scores, is_image=is_image, valid=valid, n_recent=np.array(m), n_important=np.array(n))
    weights, pos, mask = np.asarray(out.values), np.asarray(out.positions), np.asarray(out.mask)
    for b in range(B):
        for h in range(H):
            for slot in np.flatnonzero(mask[b, h]):
                holds = np.flatnonzero(weights[b, h, slot])
                assert (is_image[b, holds] == is_image[b, pos[b, h, slot]]).all(), (b, h, slot)
            kept_modalities = set(is_image[b, pos[b, h][mask[b, h]]])
            for j in np.flatnonzero(valid[b]):
                if is_image[b, j] not in kept_modalities:
                    assert not weights[b, h, mask[b, h], j].any()


def test_scope_and_quota_refuse_what_they_cannot_do():
    from lookm_jax import InputError, get_method

    with pytest.raises(InputError, match="image_quota must be None, a fraction in"):
        get_method("lookm", image_quota=1.5)
    with pytest.raises(InputError, match="merge_scope must be one of"):
        get_method("lookm", merge_scope="image")
    with pytest.raises(InputError, match="needs a merge mode"):
        get_method("lookm", merge=None, merge_scope="same_modality")
    with pytest.raises(InputError, match="cannot be combined"):
        get_method("lookm", keep_all_text=True, image_quota=0.5)
    with pytest.raises(InputError, match="size_aware needs a merge mode"):
        get_method("lookm", merge=None, size_aware=True)
    with pytest.raises(InputError, match="size_aware must be True or False"):
        get_method("lookm", size_aware=1)


@pytest.mark.parametrize("merge", ["averaged", "pivotal", "weighted"])
@pytest.mark.parametrize("merge_scope", ["any", "same_modality"])
def test_size_aware_log_counts_match_reference(merge, merge_scope):
    """Each kept slot's log-count is log(1 + the pairs merged into it) (float64 reference); empty
    slots hold 0; keys and values are those of the same merge without size_aware."""
    k, v, scores, is_image, valid = _inputs(5, [20, 11])
    m, n = [3, 2], [4, 4]
    run = functools.partial(compress_kv, jnp.asarray(k), jnp.asarray(v), jnp.asarray(scores),
                            is_image=jnp.asarray(is_image), valid=jnp.asarray(valid), n_recent=np.array(m),
                            n_important=np.array(n), merge=merge, merge_scope=merge_scope, block=8)
    out = run(size_aware=True)
    kept = ref.select(scores, valid, is_image, m, n, text_prior=True)
    merged = ref.merge(k, v, kept, valid, merge, is_image=is_image if merge_scope == "same_modality" else None)
    ref.check_against(out, {bh: (p, *merged[bh][:2], np.log(merged[bh][2])) for bh, p in kept.items()})
    plain = run(size_aware=False)
    assert plain.log_counts is None
    np.testing.assert_array_equal(out.keys, plain.keys)
    assert np.asarray(out.log_counts).max() > np.log(2) - 1e-6  # some slot took in at least one pair


def test_size_aware_slots_attend_as_the_tokens_they_hold():
    """n identical key/value pairs merged into one size-aware slot are attended exactly as the n
    originals were: a later query's attention output over the compressed cache equals its output over
    the whole prompt. Without the log-counts it differs."""
    from lookm_jax.models.llama import attend_step

    rng = np.random.default_rng(0)
    distinct, copies, hq = 6, [3, 1, 2, 0, 4, 0], 4
    keys = rng.normal(size=(1, H, distinct, D)).astype(np.float32)
    values = rng.normal(size=(1, H, distinct, D)).astype(np.float32)
    source = np.concatenate([np.arange(distinct), np.repeat(np.arange(distinct), copies)])  # token -> original
    k, v = keys[:, :, source], values[:, :, source]
    length = len(source)
    scores = np.where(np.arange(length) < distinct, 1.0, 0.0)[None, None].repeat(H, 1).astype(np.float32)
    valid = np.ones((1, length), bool)
    out = compress_kv(jnp.asarray(k), jnp.asarray(v), jnp.asarray(scores), is_image=jnp.zeros((1, length), bool),
                      valid=jnp.asarray(valid), n_recent=0, n_important=distinct, text_prior=False,
                      merge="averaged", size_aware=True, block=8)
    np.testing.assert_array_equal(np.asarray(out.positions)[0, 0], np.arange(distinct))
    np.testing.assert_allclose(np.exp(np.asarray(out.log_counts)[0]), np.broadcast_to(1 + np.array(copies), (H, distinct)),
                               rtol=1e-6)
    q = jnp.asarray(rng.normal(size=(1, hq, 1, D)).astype(np.float32))
    own_k, own_v = (jnp.asarray(rng.normal(size=(1, H, 1, D)).astype(np.float32)) for _ in range(2))

    def attend(cache_k, cache_v, bias=None):
        mask = jnp.ones(cache_k.shape[:3], bool)
        return np.asarray(attend_step(q, cache_k.swapaxes(-1, -2), cache_v, mask, own_k, own_v, bias=bias))

    whole = attend(jnp.asarray(k), jnp.asarray(v))
    np.testing.assert_allclose(attend(out.keys, out.values, out.log_counts), whole, atol=1e-6, rtol=1e-6)
    assert np.abs(attend(out.keys, out.values) - whole).max() > 1e-3
