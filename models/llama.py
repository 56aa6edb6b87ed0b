"""Llama-family decoder (Llama 2/3, Vicuna, SmolLM2, Qwen2) as pure functions of a params pytree.

Params (layers stacked on a leading axis N so the decoder is one `lax.scan`; weights [in, out]):
    embed [V, H]; final_norm [H]; lm_head [H, V] (absent when tied to embed)
    layers: attn_norm [N, H], wq [N, H, Hq*D], wk/wv [N, H, Hkv*D], wo [N, Hq*D, H],
            mlp_norm [N, H], w_gate/w_up [N, H, I], w_down [N, I, H]
            (+ bq [N, Hq*D], bk/bv [N, Hkv*D] when cfg.qkv_bias: Qwen2)

Three entry points share the layer body: `forward` (whole sequence, no cache: logits API),
`prefill` (whole padded prompt, writes a possibly compressed cache) and `decode_step` (one token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax.cache import KVCache
from lookm_jax.models.config import LlamaConfig, RopeConfig
from lookm_jax.models.layers import linear, rms_norm
from lookm_jax.scoring import column_stats_of_block

if TYPE_CHECKING:
    from lookm_jax.methods import Method

# Query block of the prefill attention: scores are [B, Hq, block, <=L], never [B, Hq, L, L].
ATTENTION_BLOCK = 256
_MASKED = -1e30  # finite, so a fully masked row gives a uniform softmax instead of NaN


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """[D/2] float32 inverse frequencies, with Llama-3 scaling when configured (HF's formula)."""
    inv_freq = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    inv_freq = inv_freq.astype(np.float32)
    if rope.factor is None:
        return inv_freq
    old_len = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / rope.low_freq_factor, old_len / rope.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(cfg: LlamaConfig, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """positions [B, L] -> cos, sin [B, 1, L, D] (HF's rotate-half layout), computed in fp32."""
    angles = positions.astype(jnp.float32)[..., None] * rope_inv_freq(cfg.rope, cfg.head_dim)
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, H, L, D] rotated by the tables [B, 1, L, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def attention_probs(q: jax.Array, k: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax rows with GQA, logits accumulated and softmax taken in fp32.

    q [B, Hq, Lq, D], k [B, Hkv, Lk, D], mask bool broadcastable to [B, Hkv, 1, Lq, Lk]
    -> [B, Hkv, G, Lq, Lk] fp32, G = Hq // Hkv. A group's query heads are stacked along the query
    axis, so each KV head is one plain matmul and no K repeat is materialised.
    """
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, hkv, g * lq, d)
    scores = jnp.einsum("bhqd,bhkd->bhqk", qg, k, preferred_element_type=jnp.float32) * d**-0.5
    scores = jnp.where(mask, scores.reshape(b, hkv, g, lq, lk), _MASKED)
    return jax.nn.softmax(scores, axis=-1)


def _mix_values(probs: jax.Array, v: jax.Array) -> jax.Array:
    """probs [B, Hkv, G, Lq, Lk], v [B, Hkv, Lk, D] -> [B, Hkv * G, Lq, D] in v's dtype."""
    b, hkv, g, lq, lk = probs.shape
    probs = probs.astype(v.dtype).reshape(b, hkv, g * lq, lk)
    return jnp.einsum("bhqk,bhkd->bhqd", probs, v).reshape(b, hkv * g, lq, v.shape[-1])


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention with GQA (``attention_probs``); q [B, Hq, Lq, D] -> [B, Hq, Lq, D]."""
    return _mix_values(attention_probs(q, k, mask), v)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array,
                     block: int = ATTENTION_BLOCK,
                     statistics: tuple[str, ...] = ()) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Causal self-attention over a padded prompt, one query block at a time.

    q [B, Hq, L, D], k/v [B, Hkv, L, D], valid [B, L] (padding keys are never attended).
    Query block i only reads keys [0, end of block i): the blocks are unrolled at trace time (L is
    static), so the masked upper triangle is never computed. Each block's q/k/v slices carry a
    zero-valued data dependency on the previous block's results (0 * x is not folded for floats),
    so XLA runs the blocks one after another: scheduled breadth-first, every block's [block, end]
    probabilities and key/value prefixes would be live at once (O(L^2)); in order, memory is
    O(L x block).

    ``statistics`` (static; names from ``lookm_jax.scoring.STATISTICS``) are accumulated from the
    same softmax rows over the valid queries, which is all that eq. 4 scoring needs: a method that
    declares them costs no second attention pass. Returns (out [B, Hq, L, D],
    {name: [B, Hkv, G, L] fp32}), the dict empty when no statistics are asked for.
    """
    b, hq, length, _ = q.shape
    hkv = k.shape[1]
    stats = {name: jnp.zeros((b, hkv, hq // hkv, length), jnp.float32) for name in statistics}
    outs = []
    previous = jnp.zeros((), jnp.float32)  # one scalar of the previous block's results
    for start in range(0, length, block):
        end = min(start + block, length)
        causal = jnp.arange(start, end)[:, None] >= jnp.arange(end)[None, :]  # [Lq, end]
        mask = causal & valid[:, None, None, None, :end]
        zero = (0 * previous).astype(q.dtype)  # orders this block's slices after the previous block
        k_blk, v_blk = k[:, :, :end] + zero, v[:, :, :end] + zero  # [B, Hkv, end, D]
        probs = attention_probs(q[:, :, start:end] + zero, k_blk, mask)  # [B, Hkv, G, Lq, end]
        outs.append(_mix_values(probs, v_blk))
        previous = outs[-1][0, 0, 0, 0].astype(jnp.float32)
        for name, col in column_stats_of_block(probs, valid[:, start:end], statistics).items():
            stats[name] = stats[name].at[..., :end].add(col)
            previous = previous + col[0, 0, 0, 0]
    return jnp.concatenate(outs, axis=2), stats


def project_qkv(cfg: LlamaConfig, lp: dict, h: jax.Array, cos: jax.Array, sin: jax.Array):
    """h [B, L, H] -> RoPE'd q [B, Hq, L, D], k [B, Hkv, L, D], v [B, Hkv, L, D]."""
    b, length, _ = h.shape
    x = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)

    def heads(name, n):  # biases "bq"/"bk"/"bv" only when cfg.qkv_bias (Qwen2)
        bias = lp["b" + name[1]] if cfg.qkv_bias else None
        return linear(x, lp[name], bias).reshape(b, length, n, cfg.head_dim).transpose(0, 2, 1, 3)

    q = apply_rope(heads("wq", cfg.num_heads), cos, sin)
    k = apply_rope(heads("wk", cfg.num_kv_heads), cos, sin)
    return q, k, heads("wv", cfg.num_kv_heads)


def finish_layer(cfg: LlamaConfig, lp: dict, h: jax.Array, attn: jax.Array) -> jax.Array:
    """Residual output projection, then the SwiGLU MLP block. attn [B, Hq, L, D] -> h [B, L, H]."""
    b, _, length, _ = attn.shape
    h = h + linear(attn.transpose(0, 2, 1, 3).reshape(b, length, -1), lp["wo"])
    x = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
    return h + linear(jax.nn.silu(linear(x, lp["w_gate"])) * linear(x, lp["w_up"]), lp["w_down"])


def final_hidden(cfg: LlamaConfig, params: dict, h: jax.Array) -> jax.Array:
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps)


def lm_logits(params: dict, h: jax.Array) -> jax.Array:
    """Final-normed hidden [..., H] -> fp32 logits [..., V] (tied or untied head)."""
    if "lm_head" in params:
        return jnp.einsum("...h,hv->...v", h, params["lm_head"], preferred_element_type=jnp.float32)
    # Tied: contract against embed [V, H] directly; `embed.T` would be materialised every decode step.
    return jnp.einsum("...h,vh->...v", h, params["embed"], preferred_element_type=jnp.float32)


def embed_tokens(params: dict, ids: jax.Array) -> jax.Array:
    """ids [B, L] -> [B, L, H]; ids outside the vocab (e.g. an appended <image> id) read row 0."""
    vocab = params["embed"].shape[0]
    return params["embed"][jnp.where(ids < vocab, ids, 0)]


def forward(cfg: LlamaConfig, params: dict, x: jax.Array, valid: jax.Array) -> jax.Array:
    """Whole-sequence pass without cache. x [B, L, H] embeddings, valid [B, L] -> normed h [B, L, H]."""
    positions = jnp.broadcast_to(jnp.arange(x.shape[1]), valid.shape)
    cos, sin = rope_tables(cfg, positions, x.dtype)

    def layer(h, lp):
        q, k, v = project_qkv(cfg, lp, h, cos, sin)
        return finish_layer(cfg, lp, h, causal_attention(q, k, v, valid)[0]), None

    h, _ = jax.lax.scan(layer, x, params["layers"])
    return final_hidden(cfg, params, h)


def prefill(cfg: LlamaConfig, params: dict, x: jax.Array, valid: jax.Array, is_image: jax.Array,
            method: "Method", kept_slots: int, max_new_tokens: int) -> tuple[jax.Array, KVCache]:
    """Encode a right-padded prompt and build the decode cache, compressing each layer once.

    x [B, L, H] embeddings, valid/is_image [B, L]. `method(q, k, v, is_image, valid, stats=...)`
    returns the layer's kept slots (keys/values [B, Hkv, kept_slots, D], positions
    [B, Hkv, kept_slots]); it runs inside the layer scan, so only one layer's uncompressed K/V
    exists at a time, and receives the attention statistics it declares (`method.statistics`),
    accumulated by the layer's own attention. The cache has static capacity
    kept_slots + max_new_tokens. Returns (normed last-token hidden [B, H], cache).
    """
    b, length, _ = x.shape
    positions = jnp.broadcast_to(jnp.arange(length), (b, length))
    cos, sin = rope_tables(cfg, positions, x.dtype)
    cache = KVCache.empty(cfg.num_layers, b, cfg.num_kv_heads, kept_slots + max_new_tokens,
                          cfg.head_dim, x.dtype)

    def layer(carry, inputs):
        h, cache = carry
        index, lp = inputs
        q, k, v = project_qkv(cfg, lp, h, cos, sin)
        attn, stats = causal_attention(q, k, v, valid, statistics=method.statistics)
        kept = method(q, k, v, is_image, valid, stats=stats)
        cache = cache.replace(
            keys=jax.lax.dynamic_update_slice(cache.keys, kept.keys[None].astype(x.dtype), (index, 0, 0, 0, 0)),
            values=jax.lax.dynamic_update_slice(cache.values, kept.values[None].astype(x.dtype), (index, 0, 0, 0, 0)),
            positions=jax.lax.dynamic_update_slice(cache.positions, kept.positions[None], (index, 0, 0, 0)))
        return (finish_layer(cfg, lp, h, attn), cache), None

    layer_ids = jnp.arange(cfg.num_layers)
    (h, cache), _ = jax.lax.scan(layer, (x, cache), (layer_ids, params["layers"]))
    lengths = valid.sum(axis=1).astype(jnp.int32)  # [B]
    last = jnp.take_along_axis(h, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    cache = cache.replace(cursor=jnp.asarray(kept_slots, jnp.int32), next_position=lengths)
    return final_hidden(cfg, params, last), cache


def decode_step(cfg: LlamaConfig, params: dict, x: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Append one token per row. x [B, H] embeddings -> (normed hidden [B, H], cache advanced by one)."""
    b = x.shape[0]
    cos, sin = rope_tables(cfg, cache.next_position[:, None], x.dtype)
    slot = cache.cursor
    new_positions = jnp.broadcast_to(cache.next_position[:, None], (b, cfg.num_kv_heads))

    def layer(carry, inputs):
        h, cache = carry
        index, lp = inputs
        q, k, v = project_qkv(cfg, lp, h, cos, sin)  # q [B, Hq, 1, D], k/v [B, Hkv, 1, D]
        cache = cache.replace(
            keys=jax.lax.dynamic_update_slice(cache.keys, k[None], (index, 0, 0, slot, 0)),
            values=jax.lax.dynamic_update_slice(cache.values, v[None], (index, 0, 0, slot, 0)),
            positions=jax.lax.dynamic_update_slice(cache.positions, new_positions[None, ..., None],
                                                   (index, 0, 0, slot)))
        layer_k = jax.lax.dynamic_index_in_dim(cache.keys, index, keepdims=False)
        layer_v = jax.lax.dynamic_index_in_dim(cache.values, index, keepdims=False)
        layer_mask = jax.lax.dynamic_index_in_dim(cache.positions, index, keepdims=False) >= 0
        attn = attend(q, layer_k, layer_v, layer_mask[:, :, None, None, :])
        return (finish_layer(cfg, lp, h, attn), cache), None

    layer_ids = jnp.arange(cfg.num_layers)
    (h, cache), _ = jax.lax.scan(layer, (x[:, None], cache), (layer_ids, params["layers"]))
    cache = cache.replace(cursor=slot + 1, next_position=cache.next_position + 1)
    return final_hidden(cfg, params, h[:, 0]), cache
