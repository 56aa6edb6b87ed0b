"""Selection (eq. 5-8) through compress_kv with merging off: reference agreement and properties."""

import functools

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import reference_lookm as ref
from lookm_jax import compress_kv
from lookm_jax.compression.compress import SelectionSpec
from lookm_jax.errors import InputError

B, H, L, D, S = 3, 2, 24, 8, 16


@functools.partial(jax.jit, static_argnames=("text_prior", "n_sink"))
def _select(k, v, scores, is_image, valid, m, n, text_prior, n_sink=0):
    """M, N are traced [B] arrays, so every hypothesis example reuses one compiled program."""
    return compress_kv(k, v, scores, is_image=is_image, valid=valid, n_recent=m, n_important=n,
                       text_prior=text_prior, n_sink=n_sink, capacity=S)


def _case(seed, lengths):
    rng = np.random.default_rng(seed)
    _, k, v, is_image, valid = ref.make_inputs(seed, batch=B, hkv=H, length=L, lengths=lengths)
    scores = rng.random((B, H, L)).astype(np.float32)
    return k, v, scores, is_image, valid


@pytest.mark.parametrize("text_prior", [False, True])
@pytest.mark.parametrize("n_sink", [0, 4])
def test_matches_reference(text_prior, n_sink):
    k, v, scores, is_image, valid = _case(0, [24, 17, 9])
    m, n = [4, 3, 1], [6, 5, 2]
    out = compress_kv(jnp.asarray(k), jnp.asarray(v), jnp.asarray(scores), is_image=jnp.asarray(is_image),
                      valid=jnp.asarray(valid), n_recent=np.array(m), n_important=np.array(n),
                      text_prior=text_prior, n_sink=n_sink)
    chex.assert_shape([out.keys, out.values], (B, H, 10, D))
    chex.assert_shape([out.positions, out.mask], (B, H, 10))
    chex.assert_type([out.positions, out.mask], [jnp.int32, jnp.bool_])
    kept = ref.select(scores, valid, is_image, m, n, text_prior=text_prior, n_sink=n_sink)
    ref.check_against(out, {bh: (p, k[bh[0], bh[1], p], v[bh[0], bh[1], p]) for bh, p in kept.items()}, atol=0)


def test_keep_all_text_matches_reference():
    k, v, scores, is_image, valid = _case(1, [24, 20, 12])
    m, n = [2, 2, 1], [3, 2, 1]
    out = compress_kv(jnp.asarray(k), jnp.asarray(v), jnp.asarray(scores), is_image=jnp.asarray(is_image),
                      valid=jnp.asarray(valid), n_recent=np.array(m), n_important=np.array(n),
                      keep_all_text=True, capacity=L)
    kept = ref.select(scores, valid, is_image, m, n, text_prior=True, keep_all_text=True)
    ref.check_against(out, {bh: (p, k[bh[0], bh[1], p], v[bh[0], bh[1], p]) for bh, p in kept.items()}, atol=0)
    assert out.mask.sum(-1).max() > max(a + c for a, c in zip(m, n))  # the budget really overruns


def test_ties_prefer_lower_positions():
    k, v, _, is_image, valid = _case(2, [24, 24, 24])
    out = compress_kv(jnp.asarray(k), jnp.asarray(v), jnp.zeros((B, H, L)), is_image=jnp.asarray(is_image),
                      valid=jnp.asarray(valid), n_recent=3, n_important=5, text_prior=False)
    np.testing.assert_array_equal(out.positions, np.broadcast_to([0, 1, 2, 3, 4, 21, 22, 23], (B, H, 8)))


_lengths = st.lists(st.integers(0, L), min_size=B, max_size=B)
_budgets = st.lists(st.integers(0, 8), min_size=B, max_size=B)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lengths=_lengths, m=_budgets, n=_budgets,
       text_prior=st.booleans(), n_sink=st.sampled_from([0, 4]))
def test_budget_window_and_padding(seed, lengths, m, n, text_prior, n_sink):
    """Exactly min(M + N, L_b) slots per head; the recent window is always kept; padding never;
    slots in ascending position order, empty slots last with position -1 and zero keys."""
    k, v, scores, is_image, valid = _case(seed, lengths)
    out = _select(k, v, scores, is_image, valid, np.array(m), np.array(n), text_prior, n_sink)
    pos, mask = np.asarray(out.positions), np.asarray(out.mask)
    for b in range(B):
        recent = ref.recent_positions(valid[b], m[b])
        for h in range(H):
            assert mask[b, h].sum() == min(m[b] + n[b], lengths[b])
            kept = pos[b, h][mask[b, h]]
            assert np.all(mask[b, h][: len(kept)]) and np.all(np.diff(kept) > 0)
            assert set(recent) <= set(kept)
            assert valid[b, kept].all()
    np.testing.assert_array_equal(pos[~mask], -1)
    np.testing.assert_array_equal(np.asarray(out.keys)[~mask], 0)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lengths=_lengths, m=_budgets, n=_budgets)
def test_text_prior(seed, lengths, m, n):
    """Under text-prior no image token outside the recent window is kept while a text token outside
    it is evicted."""
    k, v, scores, is_image, valid = _case(seed, lengths)
    out = _select(k, v, scores, is_image, valid, np.array(m), np.array(n), True)
    pos, mask = np.asarray(out.positions), np.asarray(out.mask)
    for b in range(B):
        outside = set(np.flatnonzero(valid[b])) - set(ref.recent_positions(valid[b], m[b]))
        for h in range(H):
            kept = set(pos[b, h][mask[b, h]])
            image_kept = any(is_image[b, j] for j in outside & kept)
            text_evicted = any(not is_image[b, j] for j in outside - kept)
            assert not (image_kept and text_evicted)


def test_capacity_defaults_to_max_budget_and_needs_concrete_budgets():
    k, v, scores, is_image, valid = (jnp.asarray(x) for x in _case(3, None))
    out = compress_kv(k, v, scores, is_image=is_image, valid=valid, n_recent=np.array([1, 2, 3]), n_important=4)
    assert out.capacity == 7
    with pytest.raises(ValueError, match="capacity"):
        jax.jit(lambda m: compress_kv(k, v, scores, is_image=is_image, valid=valid, n_recent=m, n_important=1))(
            jnp.array([1, 2, 3]))


@pytest.mark.parametrize("image_quota", [0.0, 0.5, 1.0, "proportional"])
@pytest.mark.parametrize("text_prior,n_sink", [(True, 0), (True, 2), (False, 0)])
@pytest.mark.parametrize("picture_balance", [False, True])
def test_image_quota_matches_reference(image_quota, text_prior, n_sink, picture_balance):
    """Random image masks: with picture balance, many pictures of 1-6 tokens, some cut by the window."""
    k, v, scores, is_image, valid = _case(3, [24, 19, 7])
    m, n = [3, 2, 1], [8, 6, 3]
    out = compress_kv(jnp.asarray(k), jnp.asarray(v), jnp.asarray(scores), is_image=jnp.asarray(is_image),
                      valid=jnp.asarray(valid), n_recent=np.array(m), n_important=np.array(n),
                      text_prior=text_prior, n_sink=n_sink, image_quota=image_quota, picture_balance=picture_balance)
    kept = ref.select(scores, valid, is_image, m, n, text_prior=text_prior, n_sink=n_sink, image_quota=image_quota,
                      picture_balance=picture_balance)
    ref.check_against(out, {bh: (p, k[bh[0], bh[1], p], v[bh[0], bh[1], p]) for bh, p in kept.items()}, atol=0)


@pytest.mark.parametrize("image_quota", [None, 0.5])
def test_text_window_matches_reference(image_quota):
    """Rows whose last tokens are text (a tail of 3, longer than M; of 1, shorter) or an image token (none)."""
    k, v, scores, is_image, valid = _case(4, [24, 19, 11])
    is_image[:, -3:] = False  # row 0: three text tokens after its last picture
    is_image[0, -4], is_image[1, 17], is_image[1, 18], is_image[2, 10] = True, True, False, True
    m, n = [2, 3, 2], [6, 5, 3]
    assert ref.text_window(valid, is_image, m, n) == ([2, 1, 0], [6, 7, 5])
    out = compress_kv(jnp.asarray(k), jnp.asarray(v), jnp.asarray(scores), is_image=jnp.asarray(is_image),
                      valid=jnp.asarray(valid), n_recent=np.array(m), n_important=np.array(n),
                      text_prior=True, image_quota=image_quota, text_window=True)
    kept = ref.select(scores, valid, is_image, *ref.text_window(valid, is_image, m, n), text_prior=True,
                      image_quota=image_quota)
    ref.check_against(out, {bh: (p, k[bh[0], bh[1], p], v[bh[0], bh[1], p]) for bh, p in kept.items()}, atol=0)
    np.testing.assert_array_equal(np.asarray(out.mask).sum(-1), np.broadcast_to([[8], [8], [5]], (B, H)))
    if image_quota is None:  # row 2 ends on an image token: a plain window keeps it; the text window leaves it to
        # the ranking, where text-prior puts its 5 ranked slots on text first
        assert 10 not in np.asarray(out.positions)[2][np.asarray(out.mask)[2]]


def test_text_window_without_pictures_is_the_recent_window():
    k, v, scores, _, valid = _case(5, [24, 15, 6])
    text = np.zeros_like(valid)
    kwargs = dict(is_image=jnp.asarray(text), valid=jnp.asarray(valid), n_recent=np.array([3, 2, 1]),
                  n_important=np.array([4, 4, 2]), text_prior=True)
    plain = compress_kv(jnp.asarray(k), jnp.asarray(v), jnp.asarray(scores), **kwargs)
    windowed = compress_kv(jnp.asarray(k), jnp.asarray(v), jnp.asarray(scores), text_window=True, **kwargs)
    chex.assert_trees_all_equal(plain, windowed)


def test_picture_ids_number_runs_of_image_tokens():
    from lookm_jax.compression.select import picture_ids

    is_image = np.array([[0, 1, 1, 0, 1, 0, 0, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0, 0, 1, 0]], bool)
    np.testing.assert_array_equal(picture_ids(jnp.asarray(is_image)),
                                  [[0, 1, 1, 0, 2, 0, 0, 3, 3, 3], [1, 1, 0, 0, 0, 0, 0, 0, 2, 0]])
    with pytest.raises(InputError, match="picture_balance needs an image_quota"):
        SelectionSpec(picture_balance=True)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), sizes=st.lists(st.integers(1, 5), min_size=2, max_size=5),
       n=st.integers(0, 12), quota=st.sampled_from([0.5, 1.0, "proportional"]))
def test_picture_balance_shares_the_quota_evenly(seed, sizes, n, quota):
    """Pictures of `sizes` tokens, one text token before each: under text-prior, while the text takes
    every ranked slot the quota leaves, the kept image tokens of every head are the quota's and differ
    by at most one between two pictures, unless the one with fewer has nothing left to keep."""
    is_row = [flag for size in sizes for flag in [False] + [True] * size]
    length = len(is_row)
    rng = np.random.default_rng(seed)
    is_image = np.array([is_row], bool)
    valid = np.ones((1, length), bool)
    k, v = rng.normal(size=(2, 1, H, length, D))
    scores = rng.random((1, H, length)) + np.linspace(2, 0, length)  # early tokens first, as accumulated attention
    out = compress_kv(jnp.asarray(k), jnp.asarray(v), jnp.asarray(scores), is_image=jnp.asarray(is_image),
                      valid=jnp.asarray(valid), n_recent=0, n_important=n, text_prior=True, image_quota=quota,
                      picture_balance=True)
    pictures = ref.picture_of(is_row)
    images = len(pictures)
    reserved = ref.image_quota_count(quota, n, length, images)
    if n - min(reserved, images) > len(sizes):  # slots left after the text: images beyond the quota, unbalanced
        return
    for h in range(H):
        kept = set(np.asarray(out.positions)[0, h][np.asarray(out.mask)[0, h]])
        per_picture = [sum(1 for j in kept if pictures.get(j) == p) for p in range(1, len(sizes) + 1)]
        assert sum(per_picture) == min(reserved, images), (per_picture, reserved)
        for a, size_a in zip(per_picture, sizes):
            for b in per_picture:
                assert a >= b - 1 or a == size_a, (per_picture, sizes)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lengths=st.lists(st.integers(1, L), min_size=B, max_size=B),
       m=st.lists(st.integers(0, 6), min_size=B, max_size=B), n=st.lists(st.integers(0, 8), min_size=B, max_size=B),
       quota=st.sampled_from([0.25, 0.5, 1.0]))
def test_image_quota_keeps_its_share_of_images_under_text_prior(seed, lengths, m, n, quota):
    """Text-prior ranks every text token first, yet floor(q N) of the ranked slots (or every image
    candidate, when fewer) go to images; slot totals are unchanged: min(M + N, L) per row."""
    k, v, scores, is_image, valid = _case(seed, lengths)
    out = jax.jit(functools.partial(compress_kv, text_prior=True, image_quota=quota, capacity=S))(
        k, v, scores, is_image=is_image, valid=valid, n_recent=np.array(m), n_important=np.array(n))
    positions, mask = np.asarray(out.positions), np.asarray(out.mask)
    for b in range(B):
        recent = set(ref.recent_positions(valid[b], m[b]))
        candidates = [j for j in range(L) if valid[b, j] and j not in recent]
        images = [j for j in candidates if is_image[b, j]]
        for h in range(H):
            kept = set(positions[b, h][mask[b, h]])
            assert len(kept) == min(m[b] + n[b], int(valid[b].sum()), S)
            ranked_images = len(kept & set(images))
            assert ranked_images >= min(int(np.floor(quota * n[b])), len(images), S - len(recent)), (b, h)
