"""Small numerical building blocks shared by the ports (pure functions, no parameters of their own)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Llama RMSNorm as HF computes it: normalise in fp32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis, statistics in fp32."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype) * weight + bias


def quick_gelu(x: jax.Array) -> jax.Array:
    """CLIP's activation: x * sigmoid(1.702 x)."""
    return x * jax.nn.sigmoid(1.702 * x)


def gelu_exact(x: jax.Array) -> jax.Array:
    """Exact (erf) GELU, as torch.nn.GELU() / HF 'gelu'. jax.nn.gelu defaults to tanh: not this."""
    return jax.nn.gelu(x, approximate=False)


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """x [..., In] @ w [In, Out] (+ b [Out])."""
    y = x @ w
    return y if b is None else y + b
