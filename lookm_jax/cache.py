"""The KV cache pytree: fixed shapes, masks for empty slots, a write cursor.

Layout: one stacked array per quantity over layers, so the decoder's layer `scan` indexes it and
decode writes one slot in place (the jitted decode donates the cache, so XLA updates its buffers
rather than copying them every step).

Slots [0, cursor) hold the (possibly compressed) prompt; decode appends at `cursor`. A slot is valid
iff its `positions` entry is >= 0, so padding, evicted and not-yet-written slots never get attended.
Compression keeps different slots per layer and KV head, hence positions per [layer, row, head].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    keys: jax.Array  # [N, B, Hkv, S, D], RoPE-rotated at each token's original position
    values: jax.Array  # [N, B, Hkv, S, D]
    positions: jax.Array  # [N, B, Hkv, S] int32 original token position, -1 = empty slot
    cursor: jax.Array  # [] int32, next slot decode writes (shared by all rows)
    next_position: jax.Array  # [B] int32, RoPE position of each row's next token

    @property
    def mask(self) -> jax.Array:
        """[N, B, Hkv, S] bool: slot holds a real token."""
        return self.positions >= 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values (what decode reads each step)."""
        return self.keys.nbytes + self.values.nbytes

    @classmethod
    def empty(cls, num_layers: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int,
              dtype) -> "KVCache":
        kv_shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        return cls(keys=jnp.zeros(kv_shape, dtype), values=jnp.zeros(kv_shape, dtype),
                   positions=jnp.full(kv_shape[:-1], -1, jnp.int32), cursor=jnp.zeros((), jnp.int32),
                   next_position=jnp.zeros((batch,), jnp.int32))
