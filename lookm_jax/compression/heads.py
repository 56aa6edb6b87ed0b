"""Head-adaptive layout: a layer's kept slots of all KV heads in one pool, with a head index per slot.

AdaKV's heads keep different numbers of slots (`select.adaptive_head_slots`). Laid out per head,
each head's buffer would need the largest head's size; the pool instead stores exactly the
allocated slots: per row and head group (the H_g = Hkv / G heads one device holds on a mesh,
G = the "model" shards), H_g x C slots, head 0's kept slots first, then head 1's, ..., each head's
in original-position order, empty slots (head -1) last. Decode attends over it per query head with
a mask of its KV head's slots (`models.llama.attend_step`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

UNIFORM, ADAPTIVE = "uniform", "adaptive"
HEAD_SPLITS = (UNIFORM, ADAPTIVE)
MODEL_AXIS = "model"  # the mesh axis KV heads are split over (`lookm_jax.sharding.MODEL`)


def mesh_groups() -> int:
    """Head groups of the mesh being traced under (`jax.set_mesh`): its "model" shards; 1 without one."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or MODEL_AXIS not in mesh.axis_names else mesh.shape[MODEL_AXIS]


def pool_layout(mask: jax.Array, groups: int, size: int) -> tuple[jax.Array, jax.Array]:
    """Where each pool slot comes from. mask [B, H, S] bool (each head's occupied slots first)
    -> (index [B, G, P] int32 into the group's head-major H_g x S slots, head [B, G, P] int32 within
    the group, -1 = empty), P = `size`."""
    b, h, s = mask.shape
    hg = h // groups
    counts = mask.sum(-1).reshape(b, groups, hg)  # [B, G, H_g]
    ends = jnp.cumsum(counts, -1)
    slot = jnp.arange(size)
    head = (slot[:, None] >= ends[..., None, :]).sum(-1)  # [B, G, P] in [0, H_g]
    start = jnp.take_along_axis(ends - counts, jnp.minimum(head, hg - 1), axis=-1)
    occupied = head < hg
    return jnp.where(occupied, head * s + slot - start, 0), jnp.where(occupied, head, -1).astype(jnp.int32)


def pool(x: jax.Array, index: jax.Array, head: jax.Array) -> jax.Array:
    """x [B, H, S, ...] per head -> [B, G, P, ...] pooled by `pool_layout`'s (index, head); empty slots 0."""
    b, groups, size = index.shape
    h, s = x.shape[1:3]
    flat = x.reshape(b, groups, h // groups * s, *x.shape[3:])
    extra = (1,) * (x.ndim - 3)
    out = jnp.take_along_axis(flat, index.reshape(index.shape + extra), axis=2)
    return jnp.where((head >= 0).reshape(head.shape + extra), out, jnp.zeros((), x.dtype))


def unpool(x: jax.Array, head: jax.Array, num_heads: int, width: int, fill=0) -> jax.Array:
    """The inverse view: pooled x [B, G, P, ...] with head [B, G, P] -> [B, num_heads, width, ...], each
    head's slots first in their pool order, the rest `fill` (width >= the largest head's slots)."""
    b, groups, size = head.shape
    hg = num_heads // groups
    local = jnp.arange(hg)
    counts = (head[..., None, :] == local[:, None]).sum(-1)  # [B, G, H_g]
    start = jnp.cumsum(counts, -1) - counts
    slot = jnp.arange(width)
    index = (start[..., None] + slot).reshape(b, groups, hg * width)  # [B, G, H_g * W]
    extra = (1,) * (x.ndim - 3)
    out = jnp.take_along_axis(x, jnp.minimum(index, size - 1).reshape(index.shape + extra), axis=2)
    occupied = (slot < counts[..., None]).reshape(b, groups, hg * width)
    out = jnp.where(occupied.reshape(occupied.shape + extra), out, jnp.asarray(fill, x.dtype))
    return out.reshape(b, num_heads, width, *x.shape[3:])


def slot_heads(head: jax.Array, num_heads: int) -> jax.Array:
    """Which pool slots each KV head attends: head [B, G, P] -> [B, num_heads, P] bool."""
    b, groups, size = head.shape
    hg = num_heads // groups
    return (head[:, :, None, :] == jnp.arange(hg)[:, None]).reshape(b, num_heads, size)
