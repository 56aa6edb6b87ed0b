"""Compress once, ask many: `Model.prefill_context` + `Model.ask` against `Model.run` / the full
forward on the whole prompt (fp32, 1e-5), reuse without a second context prefill, multi-turn
conversations, compile counts and refusals. Tiny random models (LLaVA, and its text decoder alone)."""

from __future__ import annotations

import dataclasses

import chex
import numpy as np
import pytest

import lookm_jax
from conftest import image_ids
from lookm_jax import generate as gen
from lookm_jax.context import Context
from lookm_jax.models import llama
from lookm_jax.errors import InputError

NEW = 6


@pytest.fixture(scope="module")
def llava(tiny):
    """Two ragged rows: contexts with a picture each, and their questions (the first left-padded)."""
    t = tiny.config.image_seq_length
    contexts = [image_ids(t, [5, "img", 6, 7, 8]), image_ids(t, [12, "img", 13, 9, 10, 11, 14, 15])]
    questions = [[20, 21, 22], [30, 31, 32, 33, 34, 35]]
    pixels = np.random.default_rng(0).standard_normal((2, 3, 30, 30)).astype(np.float32)
    return tiny, contexts, questions, pixels


def _left_pad(rows):
    ids, mask = gen.right_pad(rows)
    return np.stack([np.roll(r, (~m).sum()) for r, m in zip(ids, mask)]), np.stack(
        [np.roll(m, (~m).sum()) for m in mask])


def _check_against_whole(model, ctx, answer, rows, pixels):
    """`answer` equals `Model.run` on the whole prompts `rows`: tokens, and the first token's logits
    against the full forward's last position (1e-5)."""
    ids, mask = gen.right_pad(rows)
    np.testing.assert_array_equal(answer.tokens, model.run(ids, pixels, mask, NEW).tokens)
    logits = model.logits(ids, pixels, mask)
    last = logits[np.arange(len(rows)), mask.sum(1) - 1]
    chex.assert_shape(answer.logits, last.shape)
    chex.assert_type(answer.logits, np.float32)
    np.testing.assert_allclose(answer.logits, last, atol=1e-5, rtol=0)


def test_ask_after_the_context_equals_run_on_the_whole_prompt(llava):
    model, contexts, questions, pixels = llava
    ids, mask = gen.right_pad(contexts)
    ctx = model.prefill_context(ids, pixels, mask)
    answer = model.ask(ctx, *_left_pad(questions), max_new_tokens=NEW)
    _check_against_whole(model, ctx, answer, [list(c) + q for c, q in zip(contexts, questions)], pixels)
    np.testing.assert_array_equal(answer.question_tokens, [3, 6])
    image, text = ctx.kept_by_modality()
    np.testing.assert_allclose(image, 25)
    np.testing.assert_allclose(text, [4, 7])


def test_text_only_model(llava):
    model, _, _, _ = llava
    text = dataclasses.replace(model, config=model.text_config, params={"text": model.params["text"]}, _compiled={})
    assert not text.is_multimodal
    contexts, questions = [[3, 4, 5, 6, 7, 8, 9], [10, 11]], [[12, 13], [14, 15, 16, 17, 18]]
    ids, mask = gen.right_pad(contexts)
    ctx = text.prefill_context(ids, None, mask)
    answer = text.ask(ctx, *gen.right_pad(questions), max_new_tokens=NEW)
    _check_against_whole(text, ctx, answer, [c + q for c, q in zip(contexts, questions)], None)


def test_one_context_answers_many_questions_without_a_second_prefill(llava):
    """Three questions of different lengths in one bucket: one context program run once, one
    question and one answer program; the context's cache is unchanged by the questions."""
    model, contexts, questions, pixels = llava
    model._compiled.clear()
    ids, mask = gen.right_pad(contexts)
    method = lookm_jax.get_method("lookm", budget=0.4, merge="pivotal")
    ctx = model.prefill_context(ids, pixels, mask, method=method)
    assert model.compile_count == 1 and ctx.cache.capacity == method.capacity(64) < 64
    (signature, program), = model._compiled.items()
    encodings = []
    model._compiled[signature] = lambda *a: encodings.append(1) or program(*a)  # counts context encodings
    keys = np.asarray(ctx.cache.keys)
    answers = [model.ask(ctx, *gen.right_pad(q), max_new_tokens=NEW).tokens
               for q in (questions, [[40], [41, 42]], [[43, 44, 45, 46, 47, 48, 49], [50]])]
    assert model.compile_count == 3 and not encodings
    np.testing.assert_array_equal(np.asarray(ctx.cache.keys), keys)  # never donated, never written
    assert not np.array_equal(answers[0], answers[1])
    again = model.ask(ctx, *gen.right_pad(questions), max_new_tokens=NEW)  # the first question again
    np.testing.assert_array_equal(again.tokens, answers[0])
    assert model.compile_count == 3 and again.compile_seconds == 0 and not encodings


def test_a_conversation_equals_the_whole_conversation_as_one_prompt(llava):
    """Three turns on ragged rows whose answers end at an EOS at different steps: the last answer
    equals `run` on context + every question and answer as one prompt; earlier turns' tokens are
    all in the cache (none evicted)."""
    model, contexts, questions, pixels = llava
    ids, mask = gen.right_pad(contexts)
    free = model.ask(model.prefill_context(ids, pixels, mask), *gen.right_pad(questions), max_new_tokens=NEW).tokens
    eos = int(free[0, 2])
    cfg = dataclasses.replace(model.text_config, eos_token_ids=(eos,))
    model = dataclasses.replace(model, config=dataclasses.replace(model.config, text=cfg), _compiled={})
    ctx = model.prefill_context(ids, pixels, mask)
    turns = [questions, [[40, 41], [42, 43, 44, 45]], [[50], [51, 52]]]
    rows = [list(c) for c in contexts]
    for turn in turns[:-1]:
        answer = model.ask(ctx, *gen.right_pad(turn), max_new_tokens=NEW, extend=True)
        assert isinstance(answer.context, Context) and answer.context.used > ctx.used
        ctx = answer.context
        for r in range(2):
            rows[r] += turn[r] + answer.tokens[r, :answer.lengths[r]].tolist()
        written = (np.asarray(ctx.cache.positions) >= 0).sum(-1)  # [N, B, Hkv]: every token so far but the last
        np.testing.assert_array_equal(written, np.broadcast_to(np.asarray([len(r) - 1 for r in rows])[:, None], written.shape))
    assert answer.lengths.tolist() != [NEW, NEW]  # a row stopped early at the EOS
    last = model.ask(ctx, *gen.right_pad(turns[-1]), max_new_tokens=NEW)
    _check_against_whole(model, ctx, last, [r + q for r, q in zip(rows, turns[-1])], pixels)


def test_refusals(llava):
    model, contexts, questions, pixels = llava
    ids, mask = gen.right_pad(contexts)
    ctx = model.prefill_context(ids, pixels, mask)
    q = gen.right_pad(questions)
    with pytest.raises(InputError, match="question_ids has 1 row"):
        model.ask(ctx, [[3, 4]])
    with pytest.raises(InputError, match="question_ids hold image placeholders"):
        model.ask(ctx, [[3, 250], [4, 5]])
    with pytest.raises(InputError, match="context must be a Context"):
        model.ask(ids, *q)
    with pytest.raises(InputError, match=r"row 1's context holds 32 positions \+ 6 question tokens \+ "
                                         r"max_new_tokens=2011 = 2049 > 2048"):
        model.ask(ctx, *q, max_new_tokens=2011)
    with pytest.raises(lookm_jax.PromptTooLongError, match="longer than the largest bucket"):
        model.ask(ctx, np.ones((2, 20000), np.int32), max_new_tokens=1, ignore_context_limit=True)


def test_encode_chat_counts_every_image_once(llava, tiny_with_tokenizer):
    model = tiny_with_tokenizer
    six = "".join(f"Picture {k}: <image>\n" for k in range(1, 7)) + "What"
    ids = model.encode_chat(six, num_images=6)
    assert (ids == 250).sum() == 6 * 25
    np.testing.assert_array_equal(ids, model.encode_chat(six))  # None: the markers place them all
    assert (model.encode_chat("What", num_images=2) == 250).sum() == 2 * 25  # no markers: before the text
    np.testing.assert_array_equal(model.encode_chat("<image>\nWhat", num_images=2),
                                  model.encode_chat("<image>\n<image>\nWhat"))
    with pytest.raises(InputError, match="the prompt has 6 <image> markers but num_images=2"):
        model.encode_chat(six, num_images=2)


def test_a_per_slot_log_count_shifts_the_question_s_attention(llava):
    """A cache's per-slot log-counts (N x [B, Hkv, S], `KVCache.layer_log_counts`) are added to the
    logits of a question prefilled onto it and of a decode step after it: zeros change nothing; a
    large negative value on every context slot leaves both attending as on a cache with no context
    slot valid."""
    import jax
    import jax.numpy as jnp

    model, contexts, questions, pixels = llava
    ctx = model.prefill_context(*gen.right_pad(contexts)[:1], pixels, gen.right_pad(contexts)[1])
    q_ids, q_valid = (jnp.asarray(a) for a in gen.pack_prompts(*gen.right_pad(questions), gen.QUESTION_BUCKETS))
    cfg, params, key, room = model.text_config, model.params["text"], jax.random.key(0), 16

    def logits(cache):
        return np.asarray(gen.prefill_question(cfg, params, cache, q_ids, q_valid, key, room=room,
                                               sampling=gen.Sampling())[1])

    def decoded(cache):  # the hidden state of one decode step after the question
        first, _, cache = gen.prefill_question(cfg, params, cache, q_ids, q_valid, key, room=room,
                                               sampling=gen.Sampling())
        return np.asarray(llama.decode_step(cfg, params, llama.embed_tokens(params, first[:, None])[:, 0], cache)[0])

    def with_log_counts(value):  # the context's slots, before `prefill_question` grows the cache
        shape = (len(contexts), cfg.num_kv_heads, ctx.cache.capacity)
        return ctx.cache.replace(layer_log_counts=tuple(jnp.full(shape, value, jnp.float32)
                                                        for _ in range(cfg.num_layers)))

    plain = logits(ctx.cache)
    np.testing.assert_array_equal(logits(with_log_counts(0.0)), plain)
    empty = ctx.cache.replace(layer_positions=tuple(jnp.full_like(p, -1) for p in ctx.cache.layer_positions))
    alone = logits(empty)
    np.testing.assert_allclose(logits(with_log_counts(-1e4)), alone, atol=1e-5, rtol=0)
    assert np.abs(alone - plain).max() > 1e-3  # the context mattered (100x the tolerance)
    np.testing.assert_array_equal(decoded(with_log_counts(0.0)), decoded(ctx.cache))
    np.testing.assert_allclose(decoded(with_log_counts(-1e4)), decoded(empty), atol=1e-5, rtol=0)
    assert np.abs(decoded(empty) - decoded(ctx.cache)).max() > 1e-3


@pytest.mark.parametrize("other", ["adakv"])
def test_contexts_of_equal_capacity_and_different_layouts_each_get_their_own_programs(llava, other):
    """SnapKV's cache and PyramidKV's (per-layer buffers) or AdaKV's (head pools) hold the same slots in
    the largest layer; asking one after the other on one model answers each as a fresh model does."""
    model, contexts, questions, pixels = llava
    ids, mask = gen.right_pad(contexts)
    first, second = (model.prefill_context(ids, pixels, mask, method=lookm_jax.get_method(name, budget=0.4))
                     for name in ("snapkv", other))
    assert first.cache.capacity == second.cache.capacity
    for ctx in (first, second):
        fresh = dataclasses.replace(model, _compiled={})
        expected = fresh.ask(fresh.prefill_context(ids, pixels, mask, method=ctx.method), *_left_pad(questions),
                             max_new_tokens=NEW)
        answer = model.ask(ctx, *_left_pad(questions), max_new_tokens=NEW)
        np.testing.assert_array_equal(answer.tokens, expected.tokens)
        np.testing.assert_allclose(answer.logits, expected.logits, atol=1e-6, rtol=0)
