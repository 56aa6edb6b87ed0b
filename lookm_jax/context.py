"""Compress once, ask many: a compressed context as a value, and questions prefilled onto it.

`prefill_context` encodes and compresses a context (pictures and text) once and returns a
`Context`: the compressed cache and its bookkeeping. `ask` prefills a question onto a copy of that
cache in one compiled block (`generate.prefill_question`: the question attends to every kept
slot and causally to itself; nothing of it is evicted), then decodes the answer with the donated
decode loop. The context is never consumed: it answers any number of questions. With
`extend=True` the answer also carries the context extended by the question and the answer, for
the next turn of a conversation (`lookm_jax.chat` renders turns with the chat template).

Programs are compiled per (context cache layout, question bucket, added room, max_new_tokens,
sampling): a new question length inside its bucket (`generate.QUESTION_BUCKETS`) reuses them, and
a conversation's context grows a bucket at a time (`_room`), so its turns share them too.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax import generate as gen, inputs
from lookm_jax.cache import KVCache, kept_by_modality
from lookm_jax.errors import InputError
from lookm_jax.compression.methods import Method, get_method



@dataclasses.dataclass(frozen=True)
class Context:
    """A (compressed) context on the device, and what a question asked after it needs to know."""
    cache: KVCache  # slots [0, used) hold the context's kept slots (and earlier turns), per layer
    is_image: jax.Array  # [B, bucket] modality of the context prompt's positions; later positions are text
    prompt_lengths: np.ndarray  # [B] real tokens of the context prompt
    bucket: int  # the context prompt's bucket
    method: Method  # what compressed it
    used: int  # slots written (the cache's cursor)
    next_positions: np.ndarray  # [B] each row's next RoPE position
    pending: np.ndarray | None = None  # [B] each row's last answer token, not in the cache yet (extended)

    @property
    def batch(self) -> int:
        return len(self.prompt_lengths)

    @property
    def prompt_slots(self) -> int:
        """Context slots per row and KV head that the method kept in its largest layer: method.capacity(bucket)
        (every layer's under a uniform budget)."""
        return self.method.capacity(self.bucket)

    def kept_by_modality(self) -> tuple[np.ndarray, np.ndarray]:
        """(image [B], text [B]) slots the cache holds, mean over layers and KV heads (questions and
        answers of earlier turns count as text)."""
        image, text = kept_by_modality(self.cache.positions, self.is_image)
        return np.asarray(image), np.asarray(text)


@dataclasses.dataclass(frozen=True)
class Answer:
    tokens: np.ndarray  # [B, max_new_tokens] int32; after EOS filled with the EOS id
    lengths: np.ndarray  # [B] tokens generated, EOS included
    logits: np.ndarray  # [B, V] fp32 logits of the first answer token
    question_tokens: np.ndarray  # [B] tokens prefilled onto the context (an extended context's pending one included)
    cache_bytes: int  # K/V bytes of the cache the answer was decoded on
    compile_seconds: float  # 0 when the programs were already compiled
    prefill_seconds: float  # the question's prefill onto the context (+ the first token)
    decode_seconds: float
    context: Context | None = None  # the context extended by the question and the answer (extend=True)


def prefill_context(model, input_ids, pixel_values=None, attention_mask=None, *, method=None,
                    ignore_context_limit: bool = False) -> Context:
    """Encode and compress a context once: [B, L] ids (left- or right-padded) with their pictures.

    Checked as `Model.run` checks a prompt (room for at least one question token). Compiled once
    per (bucket, batch, pictures' shape, method).
    """
    method = get_method("full") if method is None else method
    prompt = inputs.prepare(model, input_ids, pixel_values, attention_mask, 1, [method], ignore_context_limit)
    pixels = prompt.pixel_values
    args = (model.config, model.params, *model._rows(prompt.ids, prompt.valid), pixels)
    signature = ("context", prompt.ids.shape, None if pixels is None else pixels.shape, method)
    program, _ = model._program(signature, lambda: gen.prefill_context.lower(*args, method=method))
    cache, is_image = program(*args[1:])
    lengths = prompt.lengths.astype(np.int32)
    return Context(cache=cache, is_image=is_image, prompt_lengths=lengths, bucket=prompt.ids.shape[1],
                   method=method, used=cache.capacity,
                   next_positions=np.asarray(cache.next_position))  # the length, or M-RoPE's max + 1


def ask(model, context: Context, question_ids, attention_mask=None, max_new_tokens: int = 32, *,
        temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, extend: bool = False,
        ignore_context_limit: bool = False) -> Answer:
    """Append a question [B, Q] (text ids, left- or right-padded) to `context` and decode the answer.

    The question is prefilled onto a copy of the context's cache in one block, so `context` stays
    valid for the next question; the answer decodes with the donated decode loop. A context
    extended by an earlier answer first feeds that answer's last token. The context's positions
    + question + max_new_tokens must fit the model's context length unless `ignore_context_limit`.
    With `extend`, `Answer.context` is the context extended by the question and the answer.
    """
    if not isinstance(context, Context):
        raise InputError(f"context must be a Context (Model.prefill_context), got {type(context).__name__}")
    if context.cache.num_layers != model.text_config.num_layers:
        raise InputError(f"this context has {context.cache.num_layers} layers, the model "
                         f"{model.text_config.num_layers}: it was built by another model")
    inputs.check_max_new_tokens(max_new_tokens)
    inputs.check_flag(extend, "extend")
    inputs.check_flag(ignore_context_limit, "ignore_context_limit")
    sampling = gen.Sampling(temperature, top_p)
    inputs.check_seed(seed)
    rows = _question_rows(model, context, question_ids, attention_mask)
    lengths = np.asarray([len(r) for r in rows], np.int32)
    inputs.check_bucket(int(lengths.max()), gen.QUESTION_BUCKETS)
    ends = context.next_positions + lengths + max_new_tokens
    limit = model.text_config.max_position_embeddings
    if ends.max() > limit and not ignore_context_limit:
        r = int(ends.argmax())
        raise InputError(f"the question passes the context length: row {r}'s context holds {context.next_positions[r]} "
                         f"positions + {lengths[r]} question tokens + max_new_tokens={max_new_tokens} = {ends[r]} > "
                         f"{limit} (max_position_embeddings); ask a shorter question or start a new context")
    ids, valid = gen.pack_prompts(*gen.right_pad(rows), gen.QUESTION_BUCKETS)
    width = ids.shape[1]
    room = _room(context, width + max_new_tokens)
    if context.cache.capacity + room > inputs.MAX_SLOTS:
        raise InputError(f"the context's {context.cache.capacity + room} cache slots would exceed the "
                         f"{inputs.MAX_SLOTS} that int32 positions can number")
    key = jax.random.key(seed)
    cfg, params = model.text_config, model.params["text"]
    q_ids, q_valid = model._rows(ids, valid)
    args = (cfg, params, context.cache, q_ids, q_valid, key)
    signature = ("question", _layout(context.cache), width, room, sampling)
    prefill, compile_prefill = model._program(signature, lambda: gen.prefill_question.lower(
        *args, room=room, sampling=sampling))
    first_info, _, cache_info = prefill.out_info
    decode, compile_decode = model._program(
        ("answer", _layout(cache_info), max_new_tokens, sampling),
        lambda: gen.decode.lower(cfg, params, first_info, cache_info, key, max_new_tokens=max_new_tokens,
                                 sampling=sampling, eos_ids=cfg.eos_token_ids))
    start = time.perf_counter()
    first, logits, cache = jax.block_until_ready(prefill(*args[1:]))
    prefill_seconds = time.perf_counter() - start
    cache_bytes = cache.nbytes
    start = time.perf_counter()
    tokens, answer_lengths, cache = jax.block_until_ready(decode(params, first, cache, key))
    decode_seconds = time.perf_counter() - start
    tokens, answer_lengths = np.asarray(tokens), np.asarray(answer_lengths)
    extended = None
    if extend:
        asked = context.used + width  # the cursor after the question; decode wrote answer tokens from there
        cache = _truncate_rows(cache, jnp.asarray(asked + answer_lengths - 1, jnp.int32))
        extended = dataclasses.replace(
            context, cache=cache, used=int(cache.cursor), next_positions=context.next_positions + lengths + answer_lengths - 1,
            pending=tokens[np.arange(context.batch), answer_lengths - 1])
    return Answer(tokens=tokens, lengths=answer_lengths, logits=np.asarray(logits), question_tokens=lengths,
                  cache_bytes=cache_bytes, compile_seconds=compile_prefill + compile_decode,
                  prefill_seconds=prefill_seconds, decode_seconds=decode_seconds, context=extended)


def _layout(cache) -> tuple:
    """What a program compiled over `cache` (arrays or their ShapeDtypeStructs) is specific to: its
    structure (per-layer buffers' static shifts, head pools, log counts) and every array's shape and
    dtype. Two methods' caches of one capacity can differ here (e.g. SnapKV's and AdaKV's)."""
    leaves, structure = jax.tree.flatten(cache)
    return structure, tuple((leaf.shape, str(leaf.dtype)) for leaf in leaves)


def _room(context: Context, slots: int) -> int:
    """Empty slots to add to the context's cache for `slots` more. A fresh context grows by exactly
    that; an extended one (a conversation) to the next of `generate.LONG_BUCKETS` (then multiples
    of the largest), so its turns share programs until that fills instead of compiling one a turn."""
    needed = context.used + slots
    if needed <= context.cache.capacity:
        return 0
    if context.pending is None:
        return needed - context.cache.capacity
    largest = max(gen.LONG_BUCKETS)
    grown = next((b for b in gen.LONG_BUCKETS if b >= needed), -(-needed // largest) * largest)
    return grown - context.cache.capacity


@functools.partial(jax.jit, donate_argnums=0)
def _truncate_rows(cache: KVCache, ends: jax.Array) -> KVCache:
    """`KVCache.truncate_rows`: each row keeps its answer's tokens, not the fill after its EOS."""
    return cache.truncate_rows(ends)


def _question_rows(model, context: Context, question_ids, attention_mask) -> list[list[int]]:
    """Each row's real question ids (checked: text ids of the vocabulary, one row per context row),
    after the context's pending answer token, if any."""
    ids, mask = inputs.token_ids(model.config, question_ids, attention_mask)
    if ids.shape[0] != context.batch:
        raise InputError(f"question_ids has {ids.shape[0]} row(s), the context {context.batch}")
    if model.is_multimodal and ((ids == model.config.image_token_id) & mask).any():
        raise InputError(f"question_ids hold image placeholders ({model.config.image_token_id}): pictures belong "
                         "in the context (prefill_context)")
    rows = [row[m].tolist() for row, m in zip(ids, mask)]
    if context.pending is not None:
        rows = [[int(p)] + r for p, r in zip(context.pending, rows)]
    return rows

