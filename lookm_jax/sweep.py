"""Many methods from one prefill: the shared-prefill sweep of the needle benchmark.

The prompt's hidden states do not depend on the cache method (compression happens after the
prompt is encoded), so one prefill feeds every method: `generate.prefill_states` keeps the
uncompressed per-layer K/V and the statistics the methods rank by, `generate.compress_prefilled`
builds each method's cache, and methods of equal cache layout decode together.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax import generate as gen, inputs
from lookm_jax.cache import KVCache
from lookm_jax.checks import is_int_at_least
from lookm_jax.errors import InputError
from lookm_jax.compression.scoring import KNOWN_STATISTICS


def generate_methods(model, input_ids, pixel_values=None, attention_mask=None, max_new_tokens: int = 32, *,
                     methods: Sequence, max_decode_rows: int = 16, ignore_context_limit: bool = False,
                     after: np.ndarray | None = None) -> list[np.ndarray]:
    """Greedy new tokens [B, max_new_tokens] for each of `methods`, from ONE prefill of `model`.

    The same tokens as `model.generate(..., method=m)` for each m, at the cost of one prefill;
    methods of equal cache layout decode together, up to `max_decode_rows` rows per `generate.decode`
    call (at least one method's B rows). Inputs are checked as `Model.run` checks them.

    after: optional [B, A] int32 tokens (right-padded with -1, at least one per row) prefilled onto
    each compressed cache in one block before generating (`generate.prefill_question`, as
    `Model.ask` asks), e.g. the rest of the turn with the question: the answer then depends on the
    compressed cache alone, not on the prefill's last logits.
    """
    if not isinstance(methods, (list, tuple)) or not methods:
        raise InputError(f"methods must be a non-empty list of methods (lookm_jax.get_method), got {methods!r:.80}")
    if model.mesh is not None:
        raise InputError("generate_methods runs on one device; call it on the unsharded model")
    if not is_int_at_least(max_decode_rows, 1):
        raise InputError(f"max_decode_rows must be an int >= 1, got {max_decode_rows!r}")
    fed = np.shape(after)[-1] if after is not None and np.ndim(after) == 2 else 0  # checked with the prompt's rows
    prompt = inputs.prepare(model, input_ids, pixel_values, attention_mask, fed + max_new_tokens, methods,
                            ignore_context_limit)
    batch, bucket = prompt.ids.shape
    question = None if after is None else _question(model, after, batch)
    asked = 0 if question is None else question[0].shape[1]  # the question's bucket: slots it takes in the cache
    key = jax.random.key(0)
    sampling = gen.Sampling()
    prefilled = gen.prefill_states(
        model.config, model.params, jnp.asarray(prompt.ids), jnp.asarray(prompt.valid), prompt.pixel_values, key,
        statistics=tuple(s for s in KNOWN_STATISTICS if any(s in m.statistics for m in methods)),
        window=max(1, *(gen.query_window(m, bucket) for m in methods)), sampling=sampling)
    by_layout: dict[tuple, list[int]] = {}
    for i, m in enumerate(methods):
        by_layout.setdefault(m.cache_layout(bucket, model.text_config.num_layers), []).append(i)
    per_call = max(1, max_decode_rows // batch)
    text_config, params = model.text_config, model.params["text"]
    out: list[np.ndarray | None] = [None] * len(methods)
    for indices in by_layout.values():
        for start in range(0, len(indices), per_call):
            chunk = indices[start:start + per_call]
            cache = KVCache.concat_rows([gen.compress_prefilled(prefilled, method=methods[i],
                                                                max_new_tokens=asked + max_new_tokens) for i in chunk])
            if question is None:
                first = jnp.tile(prefilled.first, len(chunk))
            else:  # prefilled onto the compressed cache in one block, as `Model.ask` asks
                q_ids, q_valid = (jnp.tile(a, (len(chunk), 1)) for a in question)
                first, _, cache = gen.prefill_question(text_config, params, cache, q_ids, q_valid, key, room=0,
                                                       sampling=sampling)
            tokens, _, _ = gen.decode(text_config, params, first, cache, key, max_new_tokens=max_new_tokens,
                                      sampling=sampling, eos_ids=text_config.eos_token_ids)
            for i, rows in zip(chunk, np.split(np.asarray(tokens), len(chunk))):
                out[i] = rows
    return out


def _question(model, after, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """`after` ([batch, A] ids right-padded with -1), checked -> (ids, valid) [batch, question bucket]."""
    after = _after_tokens(model, after, batch)
    return gen.pack_prompts(np.maximum(after, 0), after >= 0, gen.QUESTION_BUCKETS)


def _after_tokens(model, after, batch: int) -> np.ndarray:
    """`after` checked: [batch, A] token ids, each row one or more real ids right-padded with -1."""
    after = np.asarray(after)
    shape_ok = after.ndim == 2 and after.shape[0] == batch and after.shape[1] >= 1 and after.dtype.kind in "iu"
    real = after >= 0 if shape_ok else None
    if not (shape_ok and real[:, 0].all() and (np.diff(real.astype(int), axis=1) <= 0).all()):
        raise InputError(f"after must be integer ids [{batch}, A] with at least one token per row, right-padded "
                         f"with -1; got dtype {after.dtype} and shape {after.shape}")
    vocab = model.text_config.vocab_size
    if (after >= vocab).any():
        raise InputError(f"after holds ids outside the vocabulary [0, {vocab}): first {int(after[after >= vocab][0])}")
    return after.astype(np.int32)

