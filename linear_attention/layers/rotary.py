"""Rotary position embedding (RoPE), the half-split (GPT-NeoX) layout.

For a head vector x = [x₁, x₂] (halves of width D/2) at position p, with θ_i = base^(−i/(D/2)):

    rope(x, p) = [x₁ cos(pθ) − x₂ sin(pθ),  x₂ cos(pθ) + x₁ sin(pθ)]

so that rope(q, p)·rope(k, s) depends on p − s only. Partial rotary (`rotary_dim` R < D, as
Qwen3-Next / Qwen3.5's `partial_rotary_factor`): the first R channels rotate with
θ_i = base^(−i/(R/2)), the other D − R pass through. Angles are float32; positions are traced
integers, so a decoding step at any position reuses one compiled function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_rotary_dim(name: str, dim: int) -> None:
    """Raise unless `dim` is even (RoPE rotates pairs of channels)."""
    if dim % 2:
        raise ValueError(f"rotary embedding needs an even {name}, got {dim}")


def apply_rotary(
    x_BTHD: jax.Array,
    positions_T: jax.Array,
    *,
    base: float = 10000.0,
    rotary_dim: int | None = None,
) -> jax.Array:
    """Rotate `x[B, T, H, D]` by the angles of `positions` (token positions): `[T]`, shared by
    the batch, or `[B, T]` (per row, e.g. positions within packed documents); with
    `rotary_dim` R only the first R channels (even, ≤ D), the rest unchanged."""
    if rotary_dim is not None and rotary_dim != x_BTHD.shape[-1]:
        if not 0 < rotary_dim < x_BTHD.shape[-1]:
            raise ValueError(
                f"rotary_dim must be in [1, {x_BTHD.shape[-1]}] (the head dimension), "
                f"got {rotary_dim}"
            )
        rotated = apply_rotary(x_BTHD[..., :rotary_dim], positions_T, base=base)
        return jnp.concatenate([rotated, x_BTHD[..., rotary_dim:]], axis=-1)
    d = x_BTHD.shape[-1]
    check_rotary_dim("head dimension", d)
    half = d // 2
    inv_freq_F = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_TF = positions_T.astype(jnp.float32)[..., None] * inv_freq_F  # [T, F] or [B, T, F]
    cos_T1F, sin_T1F = jnp.cos(angle_TF)[..., None, :], jnp.sin(angle_TF)[..., None, :]
    x32 = x_BTHD.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos_T1F - x2 * sin_T1F, x2 * cos_T1F + x1 * sin_T1F], axis=-1)
    return out.astype(x_BTHD.dtype)
