"""The KV cache pytree: fixed shapes, masks for empty slots, a write cursor; and its operations.

Layout: one array per layer and quantity (tuples of N arrays), so the decode loop, a Python loop
over layers, reads and writes each layer's own buffers: nothing is sliced out of a stacked
[N, ...] array, so no layer's K/V is copied on a decode step, and the jitted decode donates the
cache, so XLA updates the buffers in place.

Keys are stored [D, S] (slots minor), values [S, D]: a decode step's scores q . k contract D, and
on XLA:CPU that batch-1 product streams 1.2-1.5x faster with the slots on the minor axis (30
SmolLM2 layers, 576-4160 slots); the values' mix contracts S and is fastest as [S, D].

Slots [0, cursor) hold the (possibly compressed) prompt; decode appends at `cursor`. A slot is valid
iff its `positions` entry is >= 0, so padding, evicted and not-yet-written slots never get attended.
Compression keeps different slots per layer and KV head, hence positions per [layer, row, head].
A size-aware merge also stores each slot's log(tokens merged into it), added to the slot's logit at
every later query (`attend_bias`); other caches store none, so their programs are unchanged.

Per-layer budgets (`lookm_jax.compression.budgets`) give layer l its own P_l prompt slots, so its
buffers hold P_l + room slots. Slot indices (`cursor`, `capacity`, `truncate_rows`) count in the
largest layer's frame; layer l's buffer starts `layer_shifts[l]` = max P - P_l slots into it, so
every layer writes a new token at cursor - shift and decode reads only what each layer kept.

Head-adaptive budgets (AdaKV) keep different numbers of prompt slots per KV head: layer l's prompt
is then one pool per row and head group, exactly the allocated H_g x P_l slots with each slot's KV
head (`HeadPool`, `lookm_jax.compression.heads`), and its per-head buffers hold only the new tokens
(they start at the prompt's capacity, `layer_shifts`). Caches without pools carry None: their
programs are unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from lookm_jax.compression import heads as head_pool


@struct.dataclass
class HeadPool:
    """One layer's prompt slots of all KV heads, per row and head group G (the "model" shards)."""

    keys: jax.Array  # [B, G, D, P], RoPE-rotated at each token's original position
    values: jax.Array  # [B, G, P, D]
    positions: jax.Array  # [B, G, P] int32 original token position, -1 = empty slot
    heads: jax.Array  # [B, G, P] int32 the slot's KV head within its group, -1 = empty slot
    log_counts: jax.Array | None = None  # [B, G, P] fp32 log(tokens merged into the slot); None: all 0


@struct.dataclass
class KVCache:
    layer_keys: tuple[jax.Array, ...]  # N x [B, Hkv, D, S], RoPE-rotated at each token's original position
    layer_values: tuple[jax.Array, ...]  # N x [B, Hkv, S, D]
    layer_positions: tuple[jax.Array, ...]  # N x [B, Hkv, S] int32 original token position, -1 = empty slot
    cursor: jax.Array  # [] int32, next slot decode writes (shared by all rows)
    next_position: jax.Array  # [B] int32, RoPE position of each row's next token
    layer_log_counts: tuple[jax.Array, ...] | None = None  # N x [B, Hkv, S] fp32, 0 = one token; None: all 0
    layer_pools: tuple[HeadPool, ...] | None = None  # N head-adaptive prompt pools; None: prompt slots per head
    layer_shifts: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)  # static; None: all 0

    def shift(self, index: int) -> int:
        """Where layer `index`'s (static) buffer starts in the largest layer's slot frame."""
        return 0 if self.layer_shifts is None else self.layer_shifts[index]

    @property
    def num_layers(self) -> int:
        return len(self.layer_keys)

    @property
    def capacity(self) -> int:
        """Slots of the largest layer."""
        return self.layer_values[0].shape[2] + self.shift(0)

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values (what decode reads each step), pools included."""
        pools = () if self.layer_pools is None else tuple(a for p in self.layer_pools for a in (p.keys, p.values))
        return sum(a.nbytes for a in self.layer_keys + self.layer_values + pools)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot of every layer (keys and values): what one more token costs."""
        b, h, _, d = self.layer_values[0].shape
        return sum(b * h * d * v.dtype.itemsize * 2 for v in self.layer_values)  # keys and values the same size

    # Stacked [N, B, Hkv, S(, D)] views in the largest layer's frame (a smaller layer's missing slots
    # empty), for inspection and tests; each call builds a new array. With pools, each head's prompt
    # slots come first in H_g x max P_l slots (as many as one head may keep, `heads.unpool`), then its
    # new tokens.
    def _stacked(self, layers, field: str, slot_axis: int, fill) -> jax.Array:
        def framed(index, a):
            if self.layer_pools is not None:
                pool = self.layer_pools[index]
                pooled = getattr(pool, field)
                pooled = pooled.swapaxes(-1, -2) if field == "keys" else pooled
                width = max(p.heads.shape[2] for p in self.layer_pools)
                prompt = head_pool.unpool(pooled, pool.heads, a.shape[1], width, fill)
                return jnp.concatenate([prompt.swapaxes(-1, -2) if field == "keys" else prompt, a], axis=slot_axis)
            pad = [(0, 0)] * a.ndim
            pad[slot_axis] = (self.shift(index), 0)
            return jnp.pad(a, pad, constant_values=fill)
        return jnp.stack([framed(i, a) for i, a in enumerate(layers)])

    @property
    def keys(self) -> jax.Array:
        return self._stacked(self.layer_keys, "keys", 3, 0).swapaxes(-1, -2)

    @property
    def values(self) -> jax.Array:
        return self._stacked(self.layer_values, "values", 2, 0)

    @property
    def positions(self) -> jax.Array:
        return self._stacked(self.layer_positions, "positions", 2, -1)

    @classmethod
    def from_prompt(cls, keys: jax.Array, values: jax.Array, positions: jax.Array, next_position: jax.Array,
                    max_new_tokens: int, log_counts: jax.Array | None = None,
                    layer_slots: tuple[int, ...] | None = None, heads: jax.Array | None = None) -> "KVCache":
        """Write every layer's (compressed) prompt slots into a cache with room for the new tokens.

        keys/values [N, B, Hkv, P, D] and positions [N, B, Hkv, P] (as the prompt encoder's layer
        loop stacks them), next_position [B]: each row's first new RoPE position (its prompt length;
        M-RoPE's max prompt position + 1). Decode writes a token's RoPE position as its slot's position
        (only its sign, valid, is read after the prompt). log_counts [N, B, Hkv, P] of a size-aware
        merge, or None. layer_slots (static): each layer's P_l <= P, when layers keep different
        numbers (layer l's occupied slots must come first); None: P in every layer. Capacity
        max P_l + max_new_tokens, cursor max P_l.

        heads [N, B, G, H_g x P] (a head-adaptive method's pools, `compression.heads`; needs
        layer_slots): keys/values [N, B, G, H_g x P, D] and positions/log_counts [N, B, G, H_g x P]
        are pools; layer l keeps its first H_g x P_l pool slots and per-head buffers of
        max_new_tokens slots (Hkv = G x H_g).
        """
        if heads is not None:
            return cls._from_pools(keys, values, positions, next_position, max_new_tokens, log_counts,
                                   layer_slots, heads)
        n = keys.shape[0]
        layer_slots = (keys.shape[3],) * n if layer_slots is None else tuple(layer_slots)
        top = max(layer_slots)
        slots = ((0, 0),) * 2 + ((0, max_new_tokens),)

        def per_layer(a, fill=0):  # [N, B, Hkv, P(, D)] -> N x [B, Hkv, P_l + max_new_tokens(, D)]
            return tuple(jnp.pad(a[i, :, :, :layer_slots[i]], slots + ((0, 0),) * (a.ndim - 4),
                                 constant_values=fill) for i in range(n))

        return cls(layer_keys=tuple(k.swapaxes(-1, -2) for k in per_layer(keys)), layer_values=per_layer(values),
                   layer_positions=per_layer(positions, -1), cursor=jnp.asarray(top, jnp.int32),
                   next_position=next_position.astype(jnp.int32),
                   layer_log_counts=None if log_counts is None else per_layer(log_counts),
                   layer_shifts=None if len(set(layer_slots)) == 1 else tuple(top - s for s in layer_slots))

    @classmethod
    def _from_pools(cls, keys, values, positions, next_position, max_new_tokens, log_counts, layer_slots,
                    heads) -> "KVCache":
        n, b, groups, size, d = keys.shape
        if layer_slots is None:
            raise ValueError("pools need layer_slots (each layer's slots per head) to know their heads per group")
        top = max(layer_slots)
        hkv = groups * (size // top)

        def pools(i):
            cut = size // top * layer_slots[i]  # H_g x P_l: the layer's occupied slots come first
            return HeadPool(keys=keys[i, :, :, :cut].swapaxes(-1, -2), values=values[i, :, :, :cut],
                            positions=positions[i, :, :, :cut], heads=heads[i, :, :, :cut],
                            log_counts=None if log_counts is None else log_counts[i, :, :, :cut])

        new = (b, hkv, max_new_tokens)

        def per_layer(make):  # one buffer per layer (decode donates and updates each in place)
            return tuple(make() for _ in range(n))

        return cls(layer_keys=per_layer(lambda: jnp.zeros((b, hkv, d, max_new_tokens), keys.dtype)),
                   layer_values=per_layer(lambda: jnp.zeros(new + (d,), values.dtype)),
                   layer_positions=per_layer(lambda: jnp.full(new, -1, jnp.int32)),
                   cursor=jnp.asarray(top, jnp.int32), next_position=next_position.astype(jnp.int32),
                   layer_log_counts=None if log_counts is None else per_layer(lambda: jnp.zeros(new, jnp.float32)),
                   layer_pools=tuple(pools(i) for i in range(n)), layer_shifts=(top,) * n)

    def pool(self, index: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None] | None:
        """Layer `index`'s (static) prompt pool for attention: keys [B, G, D, P], values [B, G, P, D],
        each KV head's slots [B, Hkv, P] bool and their additive logits [B, G, P] (None: 0); None
        without pools."""
        if self.layer_pools is None:
            return None
        pool = self.layer_pools[index]
        return pool.keys, pool.values, head_pool.slot_heads(pool.heads, self.layer_values[index].shape[1]), \
            pool.log_counts

    def layer(self, index: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Layer `index` (static): keys [B, Hkv, D, S], values [B, Hkv, S, D] and the valid-slot mask
        [B, Hkv, S]."""
        return self.layer_keys[index], self.layer_values[index], self.layer_positions[index] >= 0

    def attend_bias(self, index: int) -> jax.Array | None:
        """Layer `index`'s (static) additive logits per slot [B, Hkv, S]: log(tokens merged into the
        slot), or None when no slot holds more than one (the attention adds nothing)."""
        return None if self.layer_log_counts is None else self.layer_log_counts[index]

    def append(self, index: int, k: jax.Array, v: jax.Array, after: jax.Array) -> "KVCache":
        """Write one token's k/v [B, Hkv, 1, D] of layer `index` (static) at the cursor, at each
        row's next position. Call `advance` once every layer is written.

        ``after`` [B, Hkv, 1, D]: a result computed from this layer's `layer` read (its attention
        output). The write gets an elementwise zero-valued data dependency on it, so XLA orders the
        read first and updates the buffers in place (unordered, it copies every layer's buffers on
        every decode step); elementwise, so on a mesh no device needs another's heads.
        """
        return self.write(index, k, v, self.next_position[:, None], after)

    def write(self, index: int, k: jax.Array, v: jax.Array, positions: jax.Array, after: jax.Array) -> "KVCache":
        """Write a block of W tokens' k/v [B, Hkv, W, D] of layer `index` (static) at slots
        [cursor, cursor + W), with original positions [B, W] (-1: an empty slot, e.g. padding).
        ``after`` [B, Hkv, W, D] orders the write after this layer's read, as in `append`."""
        zero = 0 * after  # 0 * x is not folded for floats
        positions = jnp.broadcast_to(positions[:, None, :], k.shape[:3])  # [B, Hkv, W]

        def put(layers, new, dep, slot_axis):  # new and dep shaped like the layer's buffer, W slots wide
            start = [0] * new.ndim
            start[slot_axis] = self.cursor - self.shift(index)
            new = new.astype(layers[index].dtype) + dep.astype(layers[index].dtype)
            updated = jax.lax.dynamic_update_slice(layers[index], new, start)
            return layers[:index] + (updated,) + layers[index + 1:]

        return self.replace(
            layer_keys=put(self.layer_keys, k.swapaxes(-1, -2), zero.swapaxes(-1, -2), 3),  # [B, Hkv, D, W]
            layer_values=put(self.layer_values, v, zero, 2),
            layer_positions=put(self.layer_positions, positions, zero[..., 0], 2))

    def advance(self, slots: int = 1, tokens: jax.Array | None = None) -> "KVCache":
        """Move the cursor on by `slots` (static) and each row's position by `tokens` [B] (default:
        `slots`; fewer where a written block ends in padding)."""
        return self.replace(cursor=self.cursor + slots,
                            next_position=self.next_position + (slots if tokens is None else tokens))

    def grow(self, slots: int) -> "KVCache":
        """The same cache with `slots` (static) more empty slots at the end of every layer (a copy)."""
        pad = ((0, 0), (0, 0), (0, slots))
        log_counts = self.layer_log_counts
        return self.replace(layer_keys=tuple(jnp.pad(k, pad[:2] + ((0, 0),) + pad[2:]) for k in self.layer_keys),
                            layer_values=tuple(jnp.pad(v, pad + ((0, 0),)) for v in self.layer_values),
                            layer_positions=tuple(jnp.pad(p, pad, constant_values=-1) for p in self.layer_positions),
                            layer_log_counts=None if log_counts is None else tuple(jnp.pad(c, pad) for c in log_counts))

    def truncate_rows(self, ends: jax.Array) -> "KVCache":
        """Row b keeps its slots below ends[b] [B]; its written slots from there to the cursor are
        emptied and its next position moves back by as many. The cursor stays (it is shared)."""
        def truncated(index, p):  # p [B, Hkv, S_l], its slots at shift + 0 .. in the largest layer's frame
            slots = self.shift(index) + jnp.arange(p.shape[-1])
            dropped = (slots[None] >= ends[:, None]) & (slots[None] < self.cursor)  # [B, S_l]
            return jnp.where(dropped[:, None], -1, p)

        return self.replace(layer_positions=tuple(truncated(i, p) for i, p in enumerate(self.layer_positions)),
                            next_position=self.next_position - (self.cursor - ends))

    @staticmethod
    def concat_rows(caches: list["KVCache"]) -> "KVCache":
        """Stack caches of equal capacity and cursor along the batch axis, so one decode serves them all."""
        if len({c.capacity for c in caches}) != 1 or len({int(c.cursor) for c in caches}) != 1:
            raise ValueError(f"caches need equal capacity and cursor to share a decode, got capacities "
                             f"{[c.capacity for c in caches]} and cursors {[int(c.cursor) for c in caches]}")
        if (len({c.layer_log_counts is None for c in caches}) != 1 or len({c.layer_shifts for c in caches}) != 1
                or len({c.layer_pools is None for c in caches}) != 1):
            raise ValueError("caches with and without size-aware slots, with different per-layer slots, or with "
                             "and without head pools cannot share a decode")

        def rows(field):
            return tuple(jnp.concatenate(layer) for layer in zip(*(getattr(c, field) for c in caches)))

        pools = None
        if caches[0].layer_pools is not None:
            pools = tuple(jax.tree.map(lambda *a: jnp.concatenate(a), *layer)
                          for layer in zip(*(c.layer_pools for c in caches)))

        return KVCache(layer_keys=rows("layer_keys"), layer_values=rows("layer_values"),
                       layer_positions=rows("layer_positions"), cursor=caches[0].cursor,
                       next_position=jnp.concatenate([c.next_position for c in caches]),
                       layer_log_counts=None if caches[0].layer_log_counts is None else rows("layer_log_counts"),
                       layer_pools=pools, layer_shifts=caches[0].layer_shifts)


@jax.jit
def kept_by_modality(positions: jax.Array, is_image: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Slots kept in a cache by modality, mean over layers and KV heads.

    positions [N, B, Hkv, S] (-1 = empty), is_image [B, L] of the prompt's positions; positions
    past the prompt (a question or an answer written after it) are text. -> (image [B], text [B]) float32.
    """
    kept = positions >= 0
    length = is_image.shape[-1]
    modality = jnp.broadcast_to(is_image[None, :, None, :], positions.shape[:3] + (length,))
    image = jnp.take_along_axis(modality, jnp.clip(positions, 0, length - 1), axis=-1) & kept & (positions < length)
    return image.sum(-1).mean(axis=(0, 2)), (kept & ~image).sum(-1).mean(axis=(0, 2))
