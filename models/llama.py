"""Llama-family decoder (Llama 2/3, Vicuna, SmolLM2, Qwen2) as pure functions of a params pytree.

Params are stored (convert/tables.py, converted folders) with layers stacked on a leading axis N
and weights [in, out]. `runtime_params` turns them once, at load time, into the layout the
compiled programs read, and `stored_params` back (Model.save):
    embed [V, H]; final_norm [H]; lm_head [V, H] (absent when tied to embed)
    layers: a tuple of N dicts: attn_norm [H], w_qkv [Hkv, G + 2, D, H] (per KV head: its G query
            heads, its key, its value; G = Hq // Hkv), wo [H, Hq*D], mlp_norm [H],
            w_gate_up [I, 2, H] (each MLP row's gate and up), w_down [H, I]
            (+ b_qkv [Hkv, G + 2, D] when cfg.qkv_bias: Qwen2)
            (+ adapters {name: {"a": [R, In], "b": [Out, R]}} for names in ADAPTED_WEIGHTS, while
            low-rank adapters are trained on the fly; shipped adapters are folded into the weights)
Weights are [out, in], so a batch-1 decode dot contracts each weight's minor axis (on XLA:CPU it
streams about twice as fast as [in, out]); q/k/v and gate/up are one dot each (larger dots stream
faster: 30 SmolLM2 layers' batch-1 dots 22.5 -> 19.5 ms), split by KV head and by MLP row so a
mesh still shards whole heads and rows (the split axis leads, so no weight is gathered); and one
array per layer lets the decode loop, a Python loop over layers inside `lax.while_loop`, read every
weight in place: slicing a layer out of a stacked array inside the loop copies it on every step.

`encode` runs the layer loop over a whole padded prompt (the logits path, the compressing
prefill, the shared prefill and the attention analysis call it with their own per-layer hook);
`decode_step` appends one token; `encode_onto_cache` a block of tokens (a question after a context).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax.cache import KVCache
from lookm_jax.models.config import LlamaConfig, RopeConfig
from lookm_jax.models.layers import rms_norm
from lookm_jax.compression.scoring import accumulate, column_stats_of_block, counted_queries, query_blocks

# Query block of the prefill attention: scores are [B, Hq, block, <=L], never [B, Hq, L, L].
ATTENTION_BLOCK = 256
# The query blocks are split into this many groups, each attending to its own static key prefix
# (its last query's causal span): the compiled program does not grow with L, and the masked
# upper triangle costs (KEY_PREFIXES + 1) / KEY_PREFIXES of the causal work instead of twice it.
KEY_PREFIXES = 8
# The weights a layer's low-rank adapters may update, each seen as one [Out, In] matrix (w_qkv as
# [Hkv * (G + 2) * D, H], w_gate_up as [I * 2, H]): `dense` applies them, train/adapters.py folds them.
ADAPTED_WEIGHTS = ("w_qkv", "wo", "w_gate_up", "w_down")
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
    """positions [B, L], or M-RoPE's [3, B, L] (time, height, width rows; `cfg.rope.mrope_section`
    splits the D/2 frequencies among them, as HF's Qwen2-VL does) -> cos, sin [B, 1, L, D] (HF's
    rotate-half layout), computed in fp32."""
    if positions.ndim == 3:  # frequency i rotates by the position row its section names (static)
        sections = cfg.rope.mrope_section
        row = np.concatenate([np.full(size, i % 3) for i, size in enumerate(sections)])  # [D/2]
        positions = jnp.moveaxis(positions[row], 0, -1)  # [B, L, D/2]
        angles = positions.astype(jnp.float32) * rope_inv_freq(cfg.rope, cfg.head_dim)
    else:
        angles = positions.astype(jnp.float32)[..., None] * rope_inv_freq(cfg.rope, cfg.head_dim)
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, H, L, D] rotated by the tables [B, 1, L, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _masked_scores(q: jax.Array, k: jax.Array, mask: jax.Array, slots_minor: bool = False) -> jax.Array:
    """Scaled fp32 logits [B, Hkv, G, Lq, Lk] (see ``_softmax_parts``), masked entries _MASKED.
    k is [B, Hkv, Lk, D], or [B, Hkv, D, Lk] with `slots_minor` (the cache's key layout)."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[-1 if slots_minor else 2]
    qg = q.reshape(b, hkv, hq // hkv * lq, d)
    keys = "bhdk" if slots_minor else "bhkd"
    scores = jnp.einsum(f"bhqd,{keys}->bhqk", qg, k, preferred_element_type=jnp.float32) * d**-0.5
    return jnp.where(mask, scores.reshape(b, hkv, hq // hkv, lq, lk), _MASKED)


def _mix_values(probs: jax.Array, v: jax.Array, out_dtype=None) -> jax.Array:
    """probs [B, Hkv, G, Lq, Lk], v [B, Hkv, Lk, D] -> [B, Hkv * G, Lq, D] in out_dtype (v's by default)."""
    b, hkv, g, lq, lk = probs.shape
    probs = probs.astype(v.dtype).reshape(b, hkv, g * lq, lk)
    out = jnp.einsum("bhqk,bhkd->bhqd", probs, v, preferred_element_type=out_dtype)
    return out.reshape(b, hkv * g, lq, v.shape[-1])


def _softmax_parts(q: jax.Array, k: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax rows with GQA before their division, logits accumulated in fp32.

    q [B, Hq, Lq, D], k [B, Hkv, Lk, D], mask bool broadcastable to [B, Hkv, 1, Lq, Lk]
    -> (exp(scores - row max) [B, Hkv, G, Lq, Lk] fp32, the row sums [B, Hkv, G, Lq, 1]),
    G = Hq // Hkv. A group's query heads are stacked along the query axis, so each KV head is one
    plain matmul and no K repeat is materialised. weights / sums are the softmax probabilities.
    """
    scores = _masked_scores(q, k, mask)
    weights = jnp.exp(scores - jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True)))
    return weights, weights.sum(axis=-1, keepdims=True)


def _normalised_mix(weights: jax.Array, total: jax.Array, v: jax.Array) -> jax.Array:
    """Softmax attention's output from ``_softmax_parts``: the division is applied to the
    [Lq, D] output instead of the [Lq, Lk] weights, one pass fewer over the largest array.
    -> [B, Hq, Lq, D] in v's dtype."""
    b, hkv, g, lq, _ = weights.shape
    mixed = _mix_values(weights, v, jnp.float32)  # one rounding to v's dtype, after the division
    return (mixed / total.reshape(b, hkv * g, lq, 1)).astype(v.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention with GQA (``_softmax_parts``); q [B, Hq, Lq, D] -> [B, Hq, Lq, D]."""
    return _normalised_mix(*_softmax_parts(q, k, mask), v)


def attend_step(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, mask: jax.Array, k: jax.Array,
                v: jax.Array, own_mask: jax.Array | bool = True, bias: jax.Array | None = None,
                pool: tuple | None = None) -> jax.Array:
    """Q new tokens attend, in one softmax, to the cache (k_cache [B, Hkv, D, S], v_cache
    [B, Hkv, S, D], valid slots mask [B, Hkv, S]: `KVCache.layer`) and to their own block (k/v
    [B, Hkv, Q, D]): q [B, Hq, Q, D] -> [B, Hq, Q, D]. A decode step is Q = 1.

    own_mask: which of the block's keys each query sees, broadcastable to [B, Hkv, G, Q, Q] (a
    question prefilled onto the cache: causal and not padding; True for one token). bias: optional
    additive logits per cache slot [B, Hkv, S] (e.g. a per-slot log-count); None adds nothing.
    pool: a head-adaptive prompt pool (`KVCache.pool`: keys [B, Gh, D, P], values [B, Gh, P, D], each
    KV head's slots [B, Hkv, P], log-counts [B, Gh, P] or None), attended in the same softmax: every
    query head of a group against all the pool's slots (one read of the pool), masked to its KV head's.
    The cache is read before the block is written into it (``KVCache.append``/``write(..., after=)``):
    reading the updated buffer would make XLA copy the cache.
    """
    cached = _masked_scores(q, k_cache, mask[:, :, None, None, :], slots_minor=True)  # [B, Hkv, G, Q, S]
    if bias is not None:
        cached = cached + bias[:, :, None, None, :].astype(cached.dtype)
    own = _masked_scores(q, k, own_mask)  # [B, Hkv, G, Q, Q]
    parts = [cached, own]
    if pool is not None:
        pool_keys, pool_values, pool_mask, pool_bias = pool
        b, hq, lq, d = q.shape
        groups, size = pool_keys.shape[1], pool_keys.shape[-1]
        hkv = mask.shape[1]
        pooled = jnp.einsum("bgqd,bgdp->bgqp", q.reshape(b, groups, hq // groups * lq, d), pool_keys,
                            preferred_element_type=jnp.float32) * d**-0.5  # [B, Gh, H_g * G * Q, P]
        if pool_bias is not None:
            pooled = pooled + pool_bias[:, :, None, :].astype(pooled.dtype)
        pooled = pooled.reshape(b, hkv, hq // hkv, lq, size)  # [B, Hkv, G, Q, P]
        parts.insert(0, jnp.where(pool_mask[:, :, None, None, :], pooled, _MASKED))
    probs = jax.nn.softmax(jnp.concatenate(parts, axis=-1), axis=-1)
    if pool is not None:
        mix = probs[..., :size].astype(pool_values.dtype).reshape(b, groups, hq // groups * lq, size)
        from_pool = jnp.einsum("bgqp,bgpd->bgqd", mix, pool_values).reshape(b, hq, lq, d)
        probs = probs[..., size:]
    slots = cached.shape[-1]
    out = _mix_values(probs[..., :slots], v_cache) + _mix_values(probs[..., slots:], v)
    return out if pool is None else from_pool + out


def _query_groups(n_blocks: int) -> list[tuple[int, int]]:
    """[start, stop) query-block ranges of the ``KEY_PREFIXES`` groups (fewer for short prompts)."""
    groups = min(KEY_PREFIXES, n_blocks)
    bounds = [round(i * n_blocks / groups) for i in range(groups + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array,
                     block: int = ATTENTION_BLOCK, statistics: tuple[str, ...] = (),
                     query_masks: dict[str, jax.Array] | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Causal self-attention over a padded prompt, one query block per step of a compiled loop.

    q [B, Hq, L, D], k/v [B, Hkv, L, D], valid [B, L] (padding keys are never attended). The query
    blocks (the last one padded) are split into ``KEY_PREFIXES`` groups; a `lax.scan` over each
    group's blocks attends to the group's static key prefix with an exact softmax per block. The
    program's size does not depend on L, and memory is O(L x block): one block's
    [B, Hq, block, <= L] probabilities at a time.

    ``statistics`` (static; names from ``lookm_jax.compression.scoring.KNOWN_STATISTICS``) are accumulated
    from the same softmax rows over the valid queries (or, per statistic, those of ``query_masks``
    {name: [B, L] bool}), which is all that eq. 4 scoring needs: a method that declares them costs
    no second attention pass. Returns (out [B, Hq, L, D],
    {name: [B, Hkv, G, L] fp32}), the dict empty when no statistics are asked for.
    """
    b, hq, length, d = q.shape
    hkv = k.shape[1]
    block = min(block, length)
    n_blocks = -(-length // block)
    pad = n_blocks * block - length
    q_blocks = jnp.pad(q, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(b, hq, n_blocks, block, d)
    q_blocks = q_blocks.transpose(2, 0, 1, 3, 4)  # [n_blocks, B, Hq, block, D]
    counted = {name: query_blocks(mask, block)  # [n_blocks, B, block] each
               for name, mask in counted_queries(statistics, valid, query_masks).items()}
    stats = {name: jnp.zeros((b, hkv, hq // hkv, length), jnp.float32) for name in statistics}
    outs = []
    for first, stop in _query_groups(n_blocks):
        end = min(stop * block, length)  # the group's key prefix: its last query's causal span
        k_pre, v_pre = k[:, :, :end], v[:, :, :end]  # [B, Hkv, end, D]
        key_ok = valid[:, None, None, None, :end]

        def step(stats, inputs, end=end, k_pre=k_pre, v_pre=v_pre, key_ok=key_ok):
            index, q_blk, ok = inputs  # q_blk [B, Hq, block, D], ok {name: [B, block]}
            causal = index * block + jnp.arange(block)[:, None] >= jnp.arange(end)[None, :]  # [block, end]
            weights, total = _softmax_parts(q_blk, k_pre, causal & key_ok)  # [B, Hkv, G, block, end | 1]
            if statistics:
                for name, col in column_stats_of_block(weights / total, ok, statistics).items():
                    stats[name] = stats[name].at[..., :end].set(accumulate(name, stats[name][..., :end], col))
            return stats, _normalised_mix(weights, total, v_pre)

        # Rematerialised under autodiff: a backward pass (training) keeps each block's q/k/v, not its
        # [B, Hq, block, end] probabilities, which for 30 layers of a 1408-token prompt came to GBs.
        # A forward pass compiles the same program either way.
        step = jax.checkpoint(step, prevent_cse=False)
        ok = {name: mask[first:stop] for name, mask in counted.items()}
        stats, out = jax.lax.scan(step, stats, (jnp.arange(first, stop), q_blocks[first:stop], ok))
        outs.append(out)  # [stop - first, B, Hq, block, D]
    out = jnp.concatenate(outs).transpose(1, 2, 0, 3, 4).reshape(b, hq, n_blocks * block, d)
    return out[:, :, :length], stats


def dense(x: jax.Array, w: jax.Array, b: jax.Array | None = None, adapter: dict | None = None) -> jax.Array:
    """x [..., In] @ w[Out, In].T (+ b [Out]) (+ a low-rank update (x @ a.T) @ b.T, `adapter` =
    {"a": [R, In], "b": [Out, R]}: LoRA applied on the fly, `lookm_jax.train.adapters`; with
    "tokens" [...] bool in it, only at the tokens it marks, e.g. the image tokens)."""
    y = jnp.einsum("...i,oi->...o", x, w)
    if adapter is not None:
        update = jnp.einsum("...r,or->...o", jnp.einsum("...i,ri->...r", x, adapter["a"]), adapter["b"])
        y = y + (update if "tokens" not in adapter else jnp.where(adapter["tokens"][..., None], update, 0))
    return y if b is None else y + b


def with_adapters_at(params: dict, stacked: dict, tokens: jax.Array) -> dict:
    """Runtime text params whose layers carry adapters that act at the tokens `tokens` [B, L] marks only
    (`dense`); `stacked` = {name (ADAPTED_WEIGHTS): {"a": [N, R, In], "b": [N, Out, R]}}, b scaled."""
    layers = tuple({**lp, "adapters": {name: {"a": ad["a"][i], "b": ad["b"][i], "tokens": tokens}
                                       for name, ad in stacked.items()}} for i, lp in enumerate(params["layers"]))
    return {**params, "layers": layers}


def _adapter(lp: dict, name: str) -> dict | None:
    """The layer's low-rank adapter of weight `name` (ADAPTED_WEIGHTS), if it carries one."""
    return lp.get("adapters", {}).get(name)


def _no_tap(name: str, x: jax.Array) -> None:
    """The default `tap` of `project_qkv` and `finish_layer`: sees nothing."""


def project_qkv(cfg: LlamaConfig, lp: dict, h: jax.Array, cos: jax.Array, sin: jax.Array, tap=_no_tap):
    """h [B, L, H] -> RoPE'd q [B, Hq, L, D], k [B, Hkv, L, D], v [B, Hkv, L, D] (one dot).

    ``tap(name, x)`` sees the input x of the projection it runs (named as in ADAPTED_WEIGHTS)."""
    b, length, _ = h.shape
    x = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
    tap("w_qkv", x)
    w = lp["w_qkv"]  # [Hkv, G + 2, D, H], used as one [out, in] matrix (a 3-D contraction gets transposed)
    bias = lp["b_qkv"].reshape(-1) if cfg.qkv_bias else None  # Qwen2
    qkv = dense(x, w.reshape(-1, w.shape[-1]), bias, _adapter(lp, "w_qkv")).reshape(b, length, *w.shape[:3])
    qkv = qkv.transpose(0, 2, 3, 1, 4)  # [B, Hkv, G + 2, L, D]
    group = cfg.num_heads // cfg.num_kv_heads
    q = qkv[:, :, :group].reshape(b, cfg.num_heads, length, cfg.head_dim)
    return apply_rope(q, cos, sin), apply_rope(qkv[:, :, group], cos, sin), qkv[:, :, group + 1]


def finish_layer(cfg: LlamaConfig, lp: dict, h: jax.Array, attn: jax.Array, tap=_no_tap) -> jax.Array:
    """Residual output projection, then the SwiGLU MLP block. attn [B, Hq, L, D] -> h [B, L, H].
    ``tap``: as `project_qkv`'s, for the output, gate/up and down projections."""
    b, _, length, _ = attn.shape
    heads = attn.transpose(0, 2, 1, 3).reshape(b, length, -1)  # [B, L, Hq * D]
    tap("wo", heads)
    h = h + dense(heads, lp["wo"], adapter=_adapter(lp, "wo"))
    x = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
    tap("w_gate_up", x)
    w = lp["w_gate_up"]  # [I, 2, H], one [out, in] matrix
    gate_up = dense(x, w.reshape(-1, w.shape[-1]), adapter=_adapter(lp, "w_gate_up")).reshape(b, length, -1, 2)  # [B, L, I, 2]
    hidden = jax.nn.silu(gate_up[..., 0]) * gate_up[..., 1]  # [B, L, I]
    tap("w_down", hidden)
    return h + dense(hidden, lp["w_down"], adapter=_adapter(lp, "w_down"))


def final_hidden(cfg: LlamaConfig, params: dict, h: jax.Array) -> jax.Array:
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps)


def lm_logits(params: dict, h: jax.Array) -> jax.Array:
    """Final-normed hidden [..., H] -> fp32 logits [..., V]; the head [V, H] is lm_head or, tied, embed."""
    head = params.get("lm_head", params["embed"])
    return jnp.einsum("...h,vh->...v", h, head, preferred_element_type=jnp.float32)


def embed_tokens(params: dict, ids: jax.Array) -> jax.Array:
    """ids [B, L] -> [B, L, H]; ids outside the vocab (e.g. an appended <image> id) read row 0."""
    vocab = params["embed"].shape[0]
    return params["embed"][jnp.where(ids < vocab, ids, 0)]


def encode(cfg: LlamaConfig, params: dict, x: jax.Array, valid: jax.Array, statistics: tuple[str, ...] = (),
           on_layer=None, positions: jax.Array | None = None, query_masks: dict[str, jax.Array] | None = None):
    """Run the decoder over a right-padded prompt, handing every layer's attention to a hook.

    x [B, L, H] embeddings, valid [B, L]. In every layer, ``on_layer(q, k, v, stats, index)`` gets the
    RoPE'd q [B, Hq, L, D], k/v [B, Hkv, L, D], the attention statistics asked for
    (``statistics``, static: {name: [B, Hkv, G, L] fp32}, see ``causal_attention``) and the layer's
    index (traced), and returns
    what the caller keeps of the layer (any pytree; None keeps nothing). The layers run as one
    `lax.scan`, so only one layer's q/k/v is alive at a time. Returns (final-normed h [B, L, H],
    the hook's outputs stacked on a leading layer axis N). ``positions``: RoPE positions [B, L] or
    M-RoPE's [3, B, L] (`rope_tables`); None: 0 .. L-1 in every row. ``query_masks``: the queries each
    statistic counts (`causal_attention`).
    """
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(x.shape[1]), valid.shape)
    cos, sin = rope_tables(cfg, positions, x.dtype)
    layers = params["layers"]
    branches = [lambda lp=lp: lp for lp in layers]

    def layer(h, index):
        lp = jax.lax.switch(index, branches)  # one layer's weights (the layers are separate arrays)
        q, k, v = project_qkv(cfg, lp, h, cos, sin)
        attn, stats = causal_attention(q, k, v, valid, statistics=statistics, query_masks=query_masks)
        kept = None if on_layer is None else on_layer(q, k, v, stats, index)
        return finish_layer(cfg, lp, h, attn), kept

    h, kept = jax.lax.scan(layer, x, jnp.arange(len(layers)))
    return final_hidden(cfg, params, h), kept


def forward(cfg: LlamaConfig, params: dict, x: jax.Array, valid: jax.Array,
            positions: jax.Array | None = None) -> jax.Array:
    """Whole-sequence pass without cache. x [B, L, H] embeddings, valid [B, L], positions as for
    `encode` -> normed h [B, L, H]."""
    return encode(cfg, params, x, valid, positions=positions)[0]


def decode_step(cfg: LlamaConfig, params: dict, x: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Append one token per row. x [B, H] embeddings -> (normed hidden [B, H], cache advanced by one).

    A Python loop over the layers: each reads its own weight and cache arrays, nothing is sliced.
    """
    cos, sin = rope_tables(cfg, cache.next_position[:, None], x.dtype)
    h = x[:, None]  # [B, 1, H]
    for index, lp in enumerate(params["layers"]):
        q, k, v = project_qkv(cfg, lp, h, cos, sin)  # q [B, Hq, 1, D], k/v [B, Hkv, 1, D]
        attn = attend_step(q, *cache.layer(index), k, v, bias=cache.attend_bias(index), pool=cache.pool(index))
        cache = cache.append(index, k, v, after=attn.reshape(k.shape[:2] + (-1,) + k.shape[2:])[:, :, 0])
        h = finish_layer(cfg, lp, h, attn)
    return final_hidden(cfg, params, h[:, 0]), cache.advance()


def encode_onto_cache(cfg: LlamaConfig, params: dict, x: jax.Array, valid: jax.Array,
                      cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Encode a block of new tokens onto a cache in one pass (a question after a compressed context).

    x [B, Q, H] embeddings, right-padded, valid [B, Q]. Every layer's queries attend to every valid
    cache slot and causally to the block's valid tokens (`attend_step`); the block's k/v are written
    at slots [cursor, cursor + Q), at each row's next positions (padding as empty slots), so decode
    continues after it. Size-aware slots add their log-count (`KVCache.attend_bias`). Needs
    cache.capacity >= cursor + Q. Returns (normed hidden [B, Q, H], cache advanced by Q slots and
    each row's valid count of positions).
    """
    width = x.shape[1]
    positions = cache.next_position[:, None] + jnp.arange(width)  # [B, Q]
    cos, sin = rope_tables(cfg, positions, x.dtype)
    own_mask = jnp.tril(jnp.ones((width, width), bool)) & valid[:, None, None, None, :]  # [B, 1, 1, Q, Q]
    written = jnp.where(valid, positions, -1)
    h = x
    for index, lp in enumerate(params["layers"]):
        q, k, v = project_qkv(cfg, lp, h, cos, sin)  # q [B, Hq, Q, D], k/v [B, Hkv, Q, D]
        attn = attend_step(q, *cache.layer(index), k, v, own_mask, cache.attend_bias(index), cache.pool(index))
        cache = cache.write(index, k, v, written, after=attn.reshape(k.shape[:2] + (-1,) + k.shape[2:])[:, :, 0])
        h = finish_layer(cfg, lp, h, attn)
    return final_hidden(cfg, params, h), cache.advance(width, valid.sum(axis=1).astype(jnp.int32))


def _runtime_layer(cfg: LlamaConfig, stored: dict) -> dict:
    """One layer's stored weights (wq/wk/wv [H, heads*D], w_gate/w_up [H, I], ...) -> runtime layout."""
    hkv, d = cfg.num_kv_heads, cfg.head_dim
    per_head = lambda w: w.T.reshape(hkv, -1, d, w.shape[0])  # [H, Hkv*n*D] -> [Hkv, n, D, H]
    layer = {"attn_norm": stored["attn_norm"], "mlp_norm": stored["mlp_norm"],
             "wo": stored["wo"].T, "w_down": stored["w_down"].T}
    layer["w_qkv"] = jnp.concatenate([per_head(stored[n]) for n in ("wq", "wk", "wv")], axis=1)
    layer["w_gate_up"] = jnp.stack([stored["w_gate"].T, stored["w_up"].T], axis=1)
    if "bq" in stored:
        layer["b_qkv"] = jnp.concatenate([stored[n].reshape(hkv, -1, d) for n in ("bq", "bk", "bv")], axis=1)
    return layer


def _stored_layer(cfg: LlamaConfig, layer: dict) -> dict:
    """The inverse of ``_runtime_layer``, in numpy."""
    layer = {name: np.asarray(a) for name, a in layer.items()}
    group = cfg.num_heads // cfg.num_kv_heads
    q_k_v = lambda a: np.split(a, [group, group + 1], axis=1)  # [Hkv, G + 2, ...] -> G, 1 and 1 along axis 1
    stored = {"attn_norm": layer["attn_norm"], "mlp_norm": layer["mlp_norm"],
              "wo": layer["wo"].T, "w_down": layer["w_down"].T}
    for name, part in zip(("wq", "wk", "wv"), q_k_v(layer["w_qkv"])):  # [Hkv, n, D, H] -> [H, Hkv*n*D]
        stored[name] = part.reshape(-1, part.shape[-1]).T
    stored["w_gate"], stored["w_up"] = (w.T for w in np.moveaxis(layer["w_gate_up"], 1, 0))
    if "b_qkv" in layer:
        stored.update({name: part.reshape(-1) for name, part in zip(("bq", "bk", "bv"), q_k_v(layer["b_qkv"]))})
    return stored


def runtime_params(cfg: LlamaConfig, stored: dict) -> dict:
    """Stored text params (layers stacked, weights [in, out]) -> the runtime layout (module doc).

    Done once at load time (lookm_jax.loading), on whatever device holds the arrays.
    """
    params = {k: v for k, v in stored.items() if k != "layers"}
    if "lm_head" in params:
        params["lm_head"] = params["lm_head"].T
    stacked = stored["layers"]
    params["layers"] = tuple(_runtime_layer(cfg, {name: w[i] for name, w in stacked.items()})
                             for i in range(cfg.num_layers))
    return params


def stored_params(cfg: LlamaConfig, params: dict) -> dict:
    """The inverse of ``runtime_params``, as numpy arrays on the host (what Model.save writes)."""
    stored = {k: np.asarray(v) for k, v in params.items() if k != "layers"}
    if "lm_head" in stored:
        stored["lm_head"] = stored["lm_head"].T
    layers = [_stored_layer(cfg, lp) for lp in params["layers"]]
    stored["layers"] = {name: np.stack([lp[name] for lp in layers]) for name in layers[0]}
    return stored
