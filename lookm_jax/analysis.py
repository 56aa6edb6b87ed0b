"""Attention each prompt token receives, per decoder layer (LOOK-M eq. 4), for pictures and analysis.

A_s[j] = sum over the valid queries i >= j of softmax row i at column j, averaged over all query
heads: the statistic LOOK-M ranks tokens by, taken from the decoder's own attention as it encodes
the prompt (``llama.causal_attention`` accumulates it; no second attention pass, no [L, L] matrix).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax import generate as gen, inputs
from lookm_jax.models import llama, llava
from lookm_jax.compression.scoring import SUMS, scores_from_stats


@functools.partial(jax.jit, static_argnames=("cfg",))
def attention_received_padded(cfg, params: dict, input_ids: jax.Array, valid: jax.Array,
                              pixel_values: jax.Array | None) -> jax.Array:
    """input_ids/valid [B, L] (right-padded), pixel_values [n_images, C, H, W] or None.

    Static: cfg; L is the static bucket length. The prompt encoder's per-layer hook keeps A_s, mean
    over every query head: returns [num_layers, B, L] float32, 0 at padding.
    """
    x, is_image = llava.embed(cfg, params, input_ids, pixel_values)  # [B, L, H], [B, L]

    def received(q, k, v, stats, index):  # A_s [B, Hkv, L] -> mean over every query head [B, L]
        return scores_from_stats(stats).mean(axis=1)

    positions, _ = llava.rope_positions(cfg, input_ids, valid, pixel_values)  # M-RoPE for Qwen2-VL
    text = llava.decoder_params(params, is_image)
    return llama.encode(llava.text_config(cfg), text, x, valid, (SUMS,), received, positions)[1]


def attention_received(model, input_ids, pixel_values=None) -> np.ndarray:
    """One prompt: ids [1, L] or [L] (images expanded, as ``Model.encode_chat`` gives them) and its
    pixel_values -> A_s of each of its L tokens in every layer, [num_layers, L] float32.

    Each layer's row sums to L (every query's softmax row sums to one).
    """
    ids = np.asarray(input_ids)
    if ids.ndim not in (1, 2) or (ids.ndim == 2 and ids.shape[0] != 1):
        raise ValueError(f"attention_received takes one prompt, ids [L] or [1, L]; got shape {ids.shape}")
    ids, _ = inputs.forward_ids(model, ids.reshape(1, -1))
    packed, valid = gen.pack_prompts(ids, None, model.buckets)
    pixels = inputs.pixel_values(model.config, model.dtype, packed, valid, pixel_values)
    received = attention_received_padded(model.config, model.params, jnp.asarray(packed), jnp.asarray(valid), pixels)
    return np.asarray(received[:, 0, : ids.shape[1]], np.float32)


def _mean(x: np.ndarray) -> np.ndarray:
    """Mean over the last axis; NaN where it is empty."""
    return x.mean(axis=-1) if x.shape[-1] else np.full(x.shape[:-1], np.nan, np.float32)


def modality_summary(received: np.ndarray, is_image: np.ndarray) -> dict:
    """Where one prompt's attention goes, per layer, by modality.

    received [N, L] (``attention_received``), is_image [L] bool. The first token is kept apart
    (it is usually the attention sink); "image" and "text" mean positions 1..L-1 of that modality.
    Returns {image_share, text_share, first_share: [N], each modality's share of the layer's A_s
    mass (the three sum to 1); image_per_query, text_per_query: [N], mean over the modality's
    tokens of A_s[j] / (L - j), the attention a token gets per query that sees it;
    image_token_share: float, image tokens / L}.
    """
    received = np.asarray(received, np.float64)
    is_image = np.asarray(is_image, bool)
    length = received.shape[1]
    total = received.sum(axis=1)  # [N]
    rest = np.arange(length) > 0
    image, text = rest & is_image, rest & ~is_image
    per_query = received / (length - np.arange(length))  # [N, L]
    return {"image_share": received[:, image].sum(1) / total, "text_share": received[:, text].sum(1) / total,
            "first_share": received[:, 0] / total, "image_per_query": _mean(per_query[:, image]),
            "text_per_query": _mean(per_query[:, text]), "image_token_share": float(is_image.mean())}


def _prefill_and_compress(model, input_ids, pixel_values, attention_mask, method):
    """(prefilled states, the cache `method` compresses them to) for one right-padded batch."""
    prompt = inputs.prepare(model, input_ids, pixel_values, attention_mask, 1, [method])
    bucket = prompt.ids.shape[1]
    prefilled = gen.prefill_states(model.config, model.params, jnp.asarray(prompt.ids), jnp.asarray(prompt.valid),
                                   prompt.pixel_values, jax.random.key(0), statistics=method.statistics,
                                   window=gen.query_window(method, bucket), sampling=gen.Sampling())
    return prefilled, gen.compress_prefilled(prefilled, method=method, max_new_tokens=1)


def kept_per_picture(model, input_ids, pixel_values, attention_mask, method) -> np.ndarray:
    """How many slots of each picture a scoring `method` keeps, for one right-padded batch: [N, B, Hkv,
    P] int, P the most pictures of a row (runs of image tokens, `compression.select.picture_ids`),
    counted per layer, row and KV head; 0 for a row's missing pictures. Uniform-head layouts only."""
    from lookm_jax.compression.select import picture_ids

    if getattr(method, "head_split", "uniform") != "uniform":
        raise ValueError(f"kept_per_picture reads per-head slots; {method} pools its heads (head_split='adaptive')")
    prefilled, cache = _prefill_and_compress(model, input_ids, pixel_values, attention_mask, method)
    positions = np.asarray(cache.positions[..., :-1])  # [N, B, Hkv, S]: the prompt's slots (the last is decode's)
    pictures = np.asarray(picture_ids(prefilled.is_image & prefilled.valid))  # [B, L]
    rows = np.arange(positions.shape[1])[None, :, None, None]
    kept_picture = np.where(positions >= 0, pictures[rows, np.maximum(positions, 0)], 0)  # [N, B, Hkv, S]
    return (kept_picture[..., None] == np.arange(1, int(pictures.max()) + 1)).sum(-2)


def merge_traffic(model, input_ids, pixel_values, attention_mask, method) -> dict:
    """Where a merging LOOK-M `method` folds the evicted pairs of one right-padded batch.

    Runs the method's selection (its budget and text-prior, merge off), then eq. 9's assignment of
    every evicted key to its most cosine-similar kept key, per layer and KV head. Returns counts
    over rows, layers and heads (`traffic_shares` turns them into shares): kept slots, text_slots,
    evicted pairs, evicted_image pairs, image_into_text (evicted image pairs whose slot holds text),
    image_into_recent_text (... a text slot in the recent window), absorbed_by_text (evicted pairs
    folded into text slots), absorbed_max (the most one slot absorbs), and the cosine sums of the
    image pairs merged into text and into image slots.
    """
    import dataclasses

    from lookm_jax.compression import merge

    if getattr(method, "merge", None) is None:
        raise ValueError(f"merge_traffic needs a merging LOOK-M method, got {method}")
    prefilled, cache = _prefill_and_compress(model, input_ids, pixel_values, attention_mask,
                                             dataclasses.replace(method, merge=None))
    positions = cache.positions[..., :-1]  # [N, B, Hkv, S]: the prompt's slots (the last is decode's)
    kept_keys = cache.keys[..., :-1, :]
    target, cos = jax.vmap(functools.partial(merge.assign, block=128))(prefilled.keys, kept_keys, positions >= 0)
    positions, target, cos = (np.asarray(a) for a in (positions, target, cos))
    valid, is_image = np.asarray(prefilled.valid), np.asarray(prefilled.is_image)
    n_layers, b, h, length = target.shape
    lengths = valid.sum(1)
    n_recent = np.asarray(method.budgets(jnp.asarray(valid))[0])  # [B] M
    slot = positions >= 0
    kept = np.zeros((*target.shape[:-1], length + 1), bool)  # [N, B, Hkv, L + 1]; column L: empty slots
    np.put_along_axis(kept, np.where(slot, positions, length), True, axis=-1)
    kept = kept[..., :length]
    evicted = valid[None, :, None, :] & ~kept
    target_position = np.take_along_axis(positions, target, axis=-1)  # [N, B, Hkv, L]
    rows = np.arange(b)[None, :, None, None]
    target_image = is_image[rows, np.maximum(target_position, 0)]
    target_recent = target_position >= (lengths - n_recent)[None, :, None, None]
    source_image = np.broadcast_to(is_image[None, :, None, :], evicted.shape)
    image_moves = evicted & source_image
    into_text, into_image = image_moves & ~target_image, image_moves & target_image
    slots = positions.shape[-1]
    head = np.arange(n_layers * b * h).reshape(n_layers, b, h, 1)  # each (layer, row, head) its own S slots
    absorbed = np.bincount((head * slots + target)[evicted], minlength=head.size * slots).reshape(positions.shape)
    slot_image = is_image[rows, np.maximum(positions, 0)] & slot
    slot_text = slot & ~slot_image

    return {"kept": int(slot.sum()), "text_slots": int(slot_text.sum()), "evicted": int(evicted.sum()),
            "evicted_image": int(image_moves.sum()), "image_into_text": int(into_text.sum()),
            "image_into_recent_text": int((into_text & target_recent).sum()),
            "absorbed_by_text": int((absorbed * slot_text).sum()), "absorbed_max": int(absorbed.max()),
            "cosine_image_text_sum": float(cos[into_text].sum()), "cosine_image_image_sum": float(cos[into_image].sum())}


def traffic_shares(counts: dict) -> dict:
    """`merge_traffic` counts (summed over batches: every key adds, but absorbed_max takes the max) ->
    {"evicted_image": share of evicted pairs that are image; "text_slots": share of kept slots
    holding text; "image_into_text" / "image_into_recent_text": share of evicted image pairs folded
    into a text slot / one in the recent window; "absorbed_text", "absorbed_image": mean evicted
    pairs per kept text / image slot; "absorbed_max"; "cosine_image_text", "cosine_image_image": mean
    cosine of the image pairs merged into text / image slots (NaN when there are none)}."""
    def ratio(part, whole) -> float:
        return part / whole if whole else float("nan")

    c = counts
    image_into_image = c["evicted_image"] - c["image_into_text"]
    return {"evicted_image": ratio(c["evicted_image"], c["evicted"]), "text_slots": ratio(c["text_slots"], c["kept"]),
            "image_into_text": ratio(c["image_into_text"], c["evicted_image"]),
            "image_into_recent_text": ratio(c["image_into_recent_text"], c["evicted_image"]),
            "absorbed_text": ratio(c["absorbed_by_text"], c["text_slots"]),
            "absorbed_image": ratio(c["evicted"] - c["absorbed_by_text"], c["kept"] - c["text_slots"]),
            "absorbed_max": c["absorbed_max"],
            "cosine_image_text": ratio(c["cosine_image_text_sum"], c["image_into_text"]),
            "cosine_image_image": ratio(c["cosine_image_image_sum"], image_into_image)}
