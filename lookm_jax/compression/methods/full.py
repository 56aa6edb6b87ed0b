"""Full cache: keep every valid prompt token in place (the uncompressed baseline)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from lookm_jax.compression.compress import CompressedKV
from lookm_jax.compression.methods.base import Method


@dataclasses.dataclass(frozen=True)
class Full(Method):
    """Keeps all L slots; padding slots are masked empty and zeroed, as in every compressed cache."""

    def capacity(self, bucket_len: int) -> int:
        return bucket_len

    def queries_read(self, bucket_len: int) -> int:
        return 0

    def __call__(self, queries, keys, values, is_image, valid, stats=None, layer=None) -> CompressedKV:
        b, h, length, _ = keys.shape
        mask = jnp.broadcast_to(valid[:, None, :], (b, h, length))  # [B, Hkv, L]
        positions = jnp.where(mask, jnp.arange(length, dtype=jnp.int32), -1)
        return CompressedKV(
            keys=jnp.where(mask[..., None], keys, 0),
            values=jnp.where(mask[..., None], values, 0),
            positions=positions,
            mask=mask,
        )
