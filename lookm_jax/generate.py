"""Prefill -> compress once -> jitted decode loop.

Two compiled programs per (config, method, bucket, max_new_tokens, sampling):
  `prefill`: embed (images spliced), encode the padded prompt, compress every layer's K/V into a
      cache of static capacity kept + max_new_tokens, and pick the first new token.
  `decode`:  a `lax.while_loop` appending one token per step until every row hit EOS or the limit.
      The cache argument is donated, so XLA updates it in place instead of copying it per call.
Arrays flow from one to the other on the device: nothing returns to the host in between.
Prompts are right-padded to a static bucket length, so every prompt of a bucket reuses both programs.

Compress once, ask many (`lookm_jax.context`): `prefill_context` encodes and compresses a context
alone; `prefill_question` encodes a question onto a copy of that cache in one block (the context
stays reusable) and picks the first answer token; `decode` continues from there.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax.cache import KVCache
from lookm_jax.checks import is_real
from lookm_jax.compression import reconstruction
from lookm_jax.compression.methods.base import LayerIndex
from lookm_jax.compression.scoring import RECONSTRUCTION
from lookm_jax.errors import InputError, PromptTooLongError
from lookm_jax.models import llama, llava
from lookm_jax.models.config import LlamaConfig, LlavaConfig
from lookm_jax.reductions import first_max
from lookm_jax.sharding import constrain_cache

# Static prompt lengths: powers of two and the midpoints between them, so padding wastes < 1/3.
DEFAULT_BUCKETS = (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
# Long prompts, when asked for (e.g. `Model(..., buckets=LONG_BUCKETS)`): the prefill's program does
# not grow with the bucket and its memory is O(L x block), so only the arrays themselves grow.
LONG_BUCKETS = DEFAULT_BUCKETS + (24576, 32768, 49152, 65536, 98304, 131072)
# Question lengths (`prefill_question`): a question is short, so its block starts smaller.
QUESTION_BUCKETS = (8, 16, 32) + DEFAULT_BUCKETS


def bucket_length(length: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> int:
    """Smallest bucket >= length."""
    for bucket in sorted(buckets):
        if length <= bucket:
            return bucket
    raise PromptTooLongError(f"prompt of {length} tokens is longer than the largest bucket "
                             f"({max(buckets)}); pass larger buckets or a shorter prompt")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; otherwise softmax(logits / T) restricted to the top-p nucleus."""
    temperature: float = 0.0
    top_p: float = 1.0

    TEMPERATURES = (1e-6, 1e6)  # beyond, T or logits / T leave float32's range (a greedy or a uniform draw anyway)

    def __post_init__(self):
        low, high = self.TEMPERATURES
        if (not (is_real(self.temperature) and is_real(self.top_p)) or not 0 < self.top_p <= 1
                or not (self.temperature == 0 or low <= self.temperature <= high)):
            raise InputError(f"need temperature 0 (greedy) or in [{low:g}, {high:g}] and 0 < top_p <= 1, got "
                             f"temperature {self.temperature!r}, top_p {self.top_p!r}")


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """logits [B, V] fp32 -> token ids [B] int32."""
    if sampling.temperature == 0:
        return first_max(logits)[0]  # jnp.argmax's token, without XLA:CPU's slow variadic reduce
    logits = logits / sampling.temperature
    if sampling.top_p < 1:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the top token is always kept).
        cutoff_index = jnp.sum(cumulative < sampling.top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "method", "max_new_tokens", "sampling"))
def prefill(cfg: LlavaConfig | LlamaConfig, params: dict, input_ids: jax.Array, valid: jax.Array,
            pixel_values: jax.Array | None, key: jax.Array, *, method, max_new_tokens: int,
            sampling: Sampling) -> tuple[jax.Array, KVCache, jax.Array]:
    """input_ids/valid [B, L_bucket] (right-padded), pixel_values [n_images, C, H, W] or None.

    Static: cfg, method (its budgets), max_new_tokens, sampling. The bucket length is the static
    shape of input_ids. Returns (first token [B], cache, is_image [B, L_bucket]).
    """
    h, cache, is_image = _compressed_prompt(cfg, params, input_ids, valid, pixel_values, method, max_new_tokens)
    first = sample(llama.lm_logits(params["text"], last_valid(h, valid.sum(axis=1))), jax.random.fold_in(key, 0),
                   sampling)
    return first, cache, is_image


@functools.partial(jax.jit, static_argnames=("cfg", "method"))
def prefill_context(cfg: LlavaConfig | LlamaConfig, params: dict, input_ids: jax.Array, valid: jax.Array,
                    pixel_values: jax.Array | None, *, method) -> tuple[KVCache, jax.Array]:
    """Encode and compress a context once, for questions asked after it (`prefill_question`).

    input_ids/valid [B, L_bucket] (right-padded), pixel_values [n_images, C, H, W] or None. Static:
    cfg, method; the bucket length is input_ids' static shape. Returns (cache of capacity
    method.capacity(L_bucket), full: cursor at the capacity; is_image [B, L_bucket]).
    """
    _, cache, is_image = _compressed_prompt(cfg, params, input_ids, valid, pixel_values, method, 0)
    return cache, is_image


def _encode_prompt(cfg, params, input_ids, valid, pixel_values, statistics: tuple[str, ...], on_layer):
    """Embed (images spliced) and encode a right-padded prompt, every layer's q [B, Hq, L, D], k/v [B, Hkv, L, D] and
    statistics handed to ``on_layer`` (`llama.encode`) -> (final-normed h [B, L, H], the hook's outputs,
    is_image [B, L], next position [B]). When ``statistics`` ask for ``RECONSTRUCTION``, the prompt
    is encoded twice over (`lookm_jax.compression.reconstruction`) and the hook and h see the first
    copy only, as a plain prefill's."""
    x, is_image = llava.embed(cfg, params, input_ids, pixel_values)
    positions, next_position = llava.rope_positions(cfg, input_ids, valid, pixel_values)  # [(3,) B, L], [B]
    text_cfg = llava.text_config(cfg)
    if RECONSTRUCTION not in statistics:
        h, kept = llama.encode(text_cfg, llava.decoder_params(params, is_image), x, valid, statistics, on_layer,
                               positions)
        return h, kept, is_image, next_position
    length = x.shape[1]
    x2, valid2, positions2, query_masks = reconstruction.doubled_prompt(x, valid, positions, next_position)

    def first_copy(q, k, v, stats, index):
        cut = {name: stat[..., :length] for name, stat in stats.items()}
        return on_layer(q[:, :, :length], k[:, :, :length], v[:, :, :length], cut, index)

    text = llava.decoder_params(params, reconstruction.doubled_marks(is_image, valid))
    h, kept = llama.encode(text_cfg, text, x2, valid2, statistics, first_copy, positions2, query_masks)
    return h[:, :length], kept, is_image, next_position


def _compressed_prompt(cfg, params, input_ids, valid, pixel_values, method, room: int):
    """Embed (images spliced) and encode a prompt, compressing every layer's K/V inside the layer
    loop -> (final-normed h [B, L, H], cache of capacity method.capacity(L) + room, is_image [B, L])."""
    num_layers = llava.text_config(cfg).num_layers
    is_image = llava.image_mask(cfg, input_ids)

    def compress(q, k, v, stats, index):  # one layer, inside the layer loop: [B, Hkv, kept, D] slots (or a pool)
        kept = method(q, k, v, is_image, valid, stats=stats, layer=LayerIndex(index, num_layers))
        return kept.keys.astype(k.dtype), kept.values.astype(v.dtype), kept.positions, kept.log_counts, kept.heads

    h, kept, is_image, next_position = _encode_prompt(cfg, params, input_ids, valid, pixel_values, method.statistics,
                                                      compress)
    keys, values, kept_positions, log_counts, heads = kept  # [N, B, Hkv, kept(, D)]
    layer_slots = method.layer_capacities(input_ids.shape[1], num_layers)
    cache = constrain_cache(  # placed as on the mesh, if any
        KVCache.from_prompt(keys, values, kept_positions, next_position, room, log_counts, layer_slots, heads))
    return h, cache, is_image


@functools.partial(jax.jit, static_argnames=("cfg", "room", "sampling"))
def prefill_question(cfg: LlamaConfig, params: dict, cache: KVCache, question_ids: jax.Array, valid: jax.Array,
                     key: jax.Array, *, room: int, sampling: Sampling) -> tuple[jax.Array, jax.Array, KVCache]:
    """Prefill a question onto a (compressed) cache in one block, then pick the first answer token.

    question_ids/valid [B, Q_bucket] (right-padded text ids), cache: its cursor after the context
    (capacity >= cursor + Q_bucket after growing). Static: cfg (the text config), room (empty slots
    added at the end of the cache first: a copy, so `cache` stays valid for the next question),
    sampling; Q_bucket is the static shape of question_ids. The question attends to every valid
    slot (`llama.encode_onto_cache`, size-aware slots with their log-counts) and is
    written after the context; nothing is evicted. Returns (first token [B], its logits [B, V] fp32,
    the cache with the question written, ready for `decode`).
    """
    cache = cache.grow(room) if room else cache
    x = llama.embed_tokens(params, question_ids)
    h, cache = llama.encode_onto_cache(cfg, params, x, valid, cache)
    logits = llama.lm_logits(params, last_valid(h, valid.sum(axis=1)))
    return sample(logits, jax.random.fold_in(key, 0), sampling), logits, cache


def last_valid(h: jax.Array, lengths: jax.Array) -> jax.Array:
    """h [B, L, H] of right-padded rows, lengths [B] -> each row's last real position [B, H]."""
    return jnp.take_along_axis(h, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "sampling", "eos_ids"),
                   donate_argnames=("cache",))
def decode(cfg: LlamaConfig, params: dict, first: jax.Array, cache: KVCache, key: jax.Array, *,
           max_new_tokens: int, sampling: Sampling, eos_ids: tuple[int, ...]) -> tuple[jax.Array, jax.Array, KVCache]:
    """Greedy/sampled decode from `first` [B]; `cache` is donated and returned advanced (its
    buffers alias the input's: no copy), so the caller must not reuse the cache it passed in.

    Static: cfg, max_new_tokens, sampling, eos_ids. Returns (tokens [B, max_new_tokens] int32, with
    the first EOS kept and every later slot set to eos_ids[0], lengths [B] = tokens up to and
    including EOS, cache).
    """
    eos = jnp.asarray(eos_ids or (-1,), jnp.int32)
    fill = eos[0]
    tokens = jnp.zeros((first.shape[0], max_new_tokens), jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, eos)
    lengths = jnp.ones_like(first)

    def cond(state):
        step, _, _, done, _ = state
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(state):
        step, tokens, cache, done, lengths = state
        x = llama.embed_tokens(params, tokens[:, step - 1][:, None])[:, 0]
        h, cache = llama.decode_step(cfg, params, x, cache)
        token = sample(llama.lm_logits(params, h), jax.random.fold_in(key, step), sampling)
        token = jnp.where(done, fill, token)
        return step + 1, tokens.at[:, step].set(token), cache, done | jnp.isin(token, eos), lengths + ~done

    init = (jnp.asarray(1, jnp.int32), tokens, cache, done, lengths)
    _, tokens, cache, _, lengths = jax.lax.while_loop(cond, body, init)
    # Rows that finished early leave the rest of their row at the fill id.
    tokens = jnp.where(jnp.arange(max_new_tokens)[None] < lengths[:, None], tokens, fill)
    return tokens, lengths, cache


def pack_prompts(input_ids, attention_mask=None, buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 pad_id: int = 0):
    """Host-side: [B, L] ids (left- or right-padded, mask 1 = real) -> right-padded numpy
    (ids [B, bucket] int32, valid [B, bucket] bool); each row's real tokens keep their order."""
    ids = np.asarray(input_ids, np.int32)
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {ids.shape}")
    mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask shape {mask.shape} != input_ids shape {ids.shape}")
    lengths = mask.sum(axis=1)
    if (lengths == 0).any():
        raise ValueError("every row needs at least one real token")
    bucket = bucket_length(int(lengths.max()), buckets)
    packed = np.full((ids.shape[0], bucket), pad_id, np.int32)
    valid = np.arange(bucket)[None] < lengths[:, None]
    packed[valid] = ids[mask]
    return packed, valid


def right_pad(rows, fill: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token rows of different lengths -> (int32 [B, longest] padded with `fill`, mask [B, longest] bool)."""
    ids = np.full((len(rows), max(len(r) for r in rows)), fill, np.int32)
    mask = np.zeros(ids.shape, bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, True
    return ids, mask


# ---- prefill once, compress with several methods ---------------------------------------------------
# The prompt's hidden states do not depend on the cache method (compression happens after the prompt
# is encoded), so one prefill can feed every method: `prefill_states` keeps each layer's uncompressed
# K/V plus what methods rank by, and `compress_prefilled` builds one method's decode cache from it.


@flax.struct.dataclass
class Prefilled:
    """One prefill's per-layer prompt K/V and the inputs methods rank by (N layers, W query window)."""
    first: jax.Array  # [B] int32, the first generated token (the same for every method)
    keys: jax.Array  # [N, B, Hkv, L, D], RoPE'd at the original positions
    values: jax.Array  # [N, B, Hkv, L, D]
    stats: dict  # {name: [N, B, Hkv, G, L] fp32}, the attention column statistics asked for
    window_queries: jax.Array  # [N, B, Hq, W, D], the queries of each row's last W valid tokens
    window_positions: jax.Array  # [B, W] int32, their positions (latest first; clamped to 0 past the start)
    valid: jax.Array  # [B, L] bool
    is_image: jax.Array  # [B, L] bool
    next_position: jax.Array  # [B] int32, each row's first new RoPE position (the length, or M-RoPE's max + 1)


def query_window(method, bucket_len: int) -> int:
    """How many of a row's last valid queries `method` reads besides the attention statistics."""
    window = method.queries_read(bucket_len)
    if window is not None:
        return window
    raise ValueError(f"{type(method).__name__} is not known to compress from a shared prefill "
                     "(it may read any query); run it with Model.run")


@functools.partial(jax.jit, static_argnames=("cfg", "statistics", "window", "sampling"))
def prefill_states(cfg: LlavaConfig | LlamaConfig, params: dict, input_ids: jax.Array, valid: jax.Array,
                   pixel_values: jax.Array | None, key: jax.Array, *, statistics: tuple[str, ...], window: int,
                   sampling: Sampling) -> Prefilled:
    """Encode a right-padded prompt once and keep its uncompressed per-layer K/V.

    input_ids/valid [B, L_bucket], pixel_values [n_images, C, H, W] or None. Static: cfg, statistics
    (names from `lookm_jax.compression.scoring.KNOWN_STATISTICS`, accumulated by the prefill attention as in
    `prefill`; the reconstruction statistic encodes the prompt twice over, as there), window (W, the last
    queries kept per row; `query_window` says what a method needs), sampling.
    """
    length = input_ids.shape[1]
    w = min(window, length)
    window_positions = jnp.maximum(jax.lax.top_k(jnp.where(valid, jnp.arange(length), -1), w)[0], 0)  # [B, W]

    def keep(q, k, v, stats, index):
        q_window = jnp.take_along_axis(q, window_positions[:, None, :, None], axis=2)  # [B, Hq, W, D]
        return k, v, stats, q_window

    h, (keys, values, stats, window_queries), is_image, next_position = _encode_prompt(
        cfg, params, input_ids, valid, pixel_values, statistics, keep)
    logits = llama.lm_logits(params["text"], last_valid(h, valid.sum(axis=1)))
    first = sample(logits, jax.random.fold_in(key, 0), sampling)
    return Prefilled(first=first, keys=keys, values=values, stats=stats, window_queries=window_queries,
                     window_positions=window_positions, valid=valid, is_image=is_image, next_position=next_position)


@functools.partial(jax.jit, static_argnames=("method", "max_new_tokens"))
def compress_prefilled(prefilled: Prefilled, *, method, max_new_tokens: int) -> KVCache:
    """`method`'s decode cache from a shared prefill: the cache `prefill(..., method=method)` builds.

    Static: method, max_new_tokens. The method sees the layer's keys, values and statistics, and
    queries that are exact at the kept window positions and zero elsewhere (`query_window` checks
    that the window covers what it reads). Capacity method.capacity(L) + max_new_tokens.
    """
    _, b, _, length, head_dim = prefilled.keys.shape
    if query_window(method, length) > prefilled.window_queries.shape[3]:
        raise ValueError(f"{method} reads the last {query_window(method, length)} queries; the prefill kept "
                         f"{prefilled.window_queries.shape[3]} (raise prefill_states' window)")
    missing = set(method.statistics) - set(prefilled.stats)
    if missing:
        raise ValueError(f"{type(method).__name__} needs attention statistics {sorted(missing)}; the prefill "
                         f"accumulated {sorted(prefilled.stats)}")
    num_heads = prefilled.window_queries.shape[2]
    rows = jnp.arange(b)[:, None]  # [B, 1]

    def layer(index, inputs):
        k, v, stats, q_window = inputs
        queries = jnp.zeros((b, length, num_heads, head_dim), q_window.dtype)  # [B, L, Hq, D]
        queries = queries.at[rows, prefilled.window_positions].set(q_window.transpose(0, 2, 1, 3))
        kept = method(queries.transpose(0, 2, 1, 3), k, v, prefilled.is_image, prefilled.valid,
                      stats={name: stats[name] for name in method.statistics}, layer=LayerIndex(index, num_layers))
        return index + 1, (kept.keys.astype(k.dtype), kept.values.astype(v.dtype), kept.positions, kept.log_counts,
                           kept.heads)

    layer_inputs = (prefilled.keys, prefilled.values, prefilled.stats, prefilled.window_queries)
    num_layers = prefilled.keys.shape[0]
    _, kept = jax.lax.scan(layer, jnp.asarray(0, jnp.int32), layer_inputs)
    keys, values, positions, log_counts, heads = kept
    return KVCache.from_prompt(keys, values, positions, prefilled.next_position, max_new_tokens, log_counts,
                               method.layer_capacities(length, num_layers), heads)

