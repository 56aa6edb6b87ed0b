"""Generation loop: cached decode == full forward, ragged batches, EOS, sampling, compilation, errors."""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest

import lookm_jax
from conftest import IMAGE_TOKEN, image_ids, tiny_llava
from lookm_jax import generate as gen


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llava")
    tiny_llava(folder, kv_heads=2)
    return lookm_jax.load(str(folder))


def greedy_by_full_forward(model, ids, pixels, steps):
    """Reference decode: re-run the whole sequence without cache for every token."""
    seq = list(ids)
    out = []
    for _ in range(steps):
        logits = model.logits(np.asarray(seq)[None], pixels)
        out.append(int(np.argmax(logits[0, -1])))
        seq.append(out[-1])
    return out, logits[0, -1]


def test_cached_decode_equals_full_forward(model, rng):
    ids = image_ids(model.config.image_seq_length, [7, "img", 9, 30, 31])
    pixels = rng.standard_normal((1, 3, 30, 30)).astype(np.float32)
    tokens = model.generate(ids[None], pixels, max_new_tokens=10)
    ref, _ = greedy_by_full_forward(model, ids, pixels, 10)
    assert tokens[0].tolist() == ref


def test_decode_step_logits_equal_full_forward(model, rng):
    """Logits of one cached decode step equal the full forward's last-position logits."""
    from lookm_jax.compression.methods import get_method
    from lookm_jax.models import llama

    cfg = model.text_config
    ids = np.asarray([[3, 4, 5, 6, 7, 8]], np.int32)
    packed, valid = gen.pack_prompts(ids, buckets=(8,))
    first, cache, _ = gen.prefill(model.config, model.params, packed, valid, None, jax.random.key(0),
                                  method=get_method("full"), max_new_tokens=4, sampling=gen.Sampling())
    x = llama.embed_tokens(model.params["text"], first[:, None])[:, 0]
    h, cache = llama.decode_step(cfg, model.params["text"], x, cache)
    step_logits = np.asarray(llama.lm_logits(model.params["text"], h))
    full = model.logits(np.concatenate([ids, np.asarray(first)[:, None]], axis=1))[:, -1]
    np.testing.assert_allclose(step_logits, full, atol=1e-5, rtol=0)
    chex.assert_shape(cache.keys, (cfg.num_layers, 1, cfg.num_kv_heads, 12, cfg.head_dim))
    assert int(cache.cursor) == 9 and int(cache.next_position[0]) == 7


def test_ragged_batch_rows_equal_rows_alone(model, rng):
    t = model.config.image_seq_length
    rows = [image_ids(t, [5, "img", 6, 7, 8, 9, 10, 11]), image_ids(t, [12, "img", 13])]
    pixels = rng.standard_normal((2, 3, 30, 30)).astype(np.float32)
    width = max(map(len, rows))
    ids = np.zeros((2, width), np.int32)
    mask = np.zeros_like(ids)
    ids[0, : len(rows[0])], mask[0, : len(rows[0])] = rows[0], 1
    ids[1, width - len(rows[1]):], mask[1, width - len(rows[1]):] = rows[1], 1  # left padding works too
    batch = model.generate(ids, pixels, attention_mask=mask, max_new_tokens=8)
    for i, row in enumerate(rows):
        alone = model.generate(row[None], pixels[i: i + 1], max_new_tokens=8)
        np.testing.assert_array_equal(batch[i], alone[0])


def test_no_recompile_within_a_bucket(model):
    model._compiled.clear()
    before = model.compile_count
    a = model.run(np.arange(1, 20)[None], max_new_tokens=4)
    b = model.run(np.arange(1, 40)[None], max_new_tokens=4)  # same 64-token bucket
    assert model.compile_count == before + 1
    assert a.bucket == b.bucket == 64 and a.compile_seconds > 0 and b.compile_seconds == 0
    model.run(np.arange(1, 70)[None], max_new_tokens=4)  # next bucket compiles once more
    assert model.compile_count == before + 2


def test_no_host_round_trip_between_prefill_and_decode(model):
    """Prefill's outputs feed the donated decode directly: no device->host transfer in between."""
    model._compiled.clear()
    model.run(np.arange(1, 9)[None], max_new_tokens=3)  # compile outside the guard
    prefill, decode = next(iter(model._compiled.values()))
    ids, valid = gen.pack_prompts(np.arange(1, 9)[None])
    key = jax.random.key(0)
    args = [jax.device_put(a) for a in (model.params, ids, valid)]
    with jax.transfer_guard_device_to_host("disallow"):
        first, cache, _ = prefill(*args, None, key)
        tokens, lengths, new_cache = decode(model.params["text"], first, cache, key)
    assert all(k.is_deleted() for k in cache.layer_keys)  # donated: decode reused its buffers
    assert np.asarray(tokens).shape == (1, 3) and int(new_cache.cursor) == 64 + 2




def test_per_row_eos_stops_and_fills(model):
    ids = np.asarray([[3, 4, 5, 6], [9, 8, 7, 6]], np.int32)
    free = model.generate(ids, max_new_tokens=6)
    eos = int(free[0, 2])  # make row 0's third token the EOS
    cfg = model.text_config
    import dataclasses

    eos_model = dataclasses.replace(model, config=dataclasses.replace(model.config, text=dataclasses.replace(
        cfg, eos_token_ids=(eos,))), _compiled={})
    result = eos_model.run(ids, max_new_tokens=6)
    assert result.lengths[0] == 3
    assert result.tokens[0, :3].tolist() == free[0, :3].tolist()
    assert (result.tokens[0, 3:] == eos).all()
    stop = np.flatnonzero(free[1] == eos)
    assert result.lengths[1] == (stop[0] + 1 if stop.size else 6)


def test_sampling_is_reproducible_and_keyed(model):
    ids = np.asarray([[3, 4, 5, 6]], np.int32)
    a = model.generate(ids, max_new_tokens=12, temperature=1.5, top_p=0.9, seed=1)
    b = model.generate(ids, max_new_tokens=12, temperature=1.5, top_p=0.9, seed=1)
    c = model.generate(ids, max_new_tokens=12, temperature=1.5, top_p=0.9, seed=2)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_top_p_keeps_only_the_nucleus():
    logits = jax.numpy.log(jax.numpy.asarray([[0.5, 0.3, 0.15, 0.05]]))
    draws = {int(gen.sample(logits, jax.random.key(i), gen.Sampling(1.0, 0.75))[0]) for i in range(200)}
    assert draws == {0, 1}


def test_prompt_longer_than_largest_bucket(model):
    with pytest.raises(lookm_jax.PromptTooLongError, match="longer than the largest bucket"):
        model.generate(np.ones((1, 20000), np.int32), max_new_tokens=2)


def test_image_count_must_match_placeholders(model, rng):
    ids = image_ids(model.config.image_seq_length, [7, "img", 9])[None]
    two = rng.standard_normal((2, 3, 30, 30)).astype(np.float32)
    with pytest.raises(ValueError, match=r"2 image\(s\) need 50 placeholder tokens .* has 25"):
        model.generate(ids, two)
    with pytest.raises(ValueError, match="no pixel_values"):
        model.generate(ids)
    with pytest.raises(ValueError, match=r"pixel_values must be \[num_images, 3, 30, 30\]"):
        model.generate(ids, two[:1, :, :20])
    assert IMAGE_TOKEN in ids
