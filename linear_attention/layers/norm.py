"""Norms over the last axis, computed in float32.

    RMSNorm:    y = x / sqrt(mean(x²) + eps) · scale
    LayerNorm:  y = (x − mean(x)) / sqrt(var(x) + eps) · scale + bias

With `features = (num_heads, head_dim)` each normalizes every head's channels on its own: RMSNorm
is the per-head norm of RetNet / Mamba-2 / the delta-rule mixers, LayerNorm per head is RWKV's
GroupNorm with one group per head (`ln_x`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def check_norm_arguments(features, eps) -> tuple[int, ...]:
    shape = (features,) if isinstance(features, int) else tuple(features)
    if not shape or any(not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"features must be positive ints, got {features!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    return shape


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis with a learned scale of shape `features`.

    `features` is an int (one scale per channel) or a tuple such as `(num_heads, head_dim)`: the
    per-head (group) norm of RetNet / Mamba-2, which normalizes each head's `head_dim` channels on
    its own. The statistics are float32; the output has the compute `dtype` (input dtype if None).
    """

    def __init__(
        self,
        features: int | tuple[int, ...],
        *,
        eps: float = 1e-6,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.shape = check_norm_arguments(features, eps)
        self.eps = float(eps)
        self.dtype = dtype
        self.scale = nnx.Param(jnp.ones(self.shape, param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        check_trailing(x, self.shape)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        y = y * self.scale[...].astype(jnp.float32)
        return y.astype(self.dtype or x.dtype)


def check_trailing(x: jax.Array, shape: tuple[int, ...]) -> None:
    if tuple(x.shape[-len(shape) :]) != shape:
        raise ValueError(f"x has shape {tuple(x.shape)}; its trailing axes must be {shape}")


class LayerNorm(nnx.Module):
    """Mean-centred norm over the last axis with a learned scale and bias of shape `features`
    (per head with `(num_heads, head_dim)`: a GroupNorm with one group per head). Statistics in
    float32; the output has the compute `dtype` (input dtype if None)."""

    def __init__(
        self,
        features: int | tuple[int, ...],
        *,
        eps: float = 1e-5,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.shape = check_norm_arguments(features, eps)
        self.eps = float(eps)
        self.dtype = dtype
        self.scale = nnx.Param(jnp.ones(self.shape, param_dtype))
        self.bias = nnx.Param(jnp.zeros(self.shape, param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        check_trailing(x, self.shape)
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        y = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(self.dtype or x.dtype)
