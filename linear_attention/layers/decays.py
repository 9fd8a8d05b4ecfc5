"""Decay parts of a mixer: `decay(x[B, T, d_model]) -> log γ` (float32, ≤ 0).

| part           | log γ                                                  | shape          |
| -------------- | ------------------------------------------------------ | -------------- |
| `FixedDecay`   | log(1 − 2^(−5−h)), one per head (RetNet)               | `[H]`          |
| `ScalarDecay`  | −softplus(x·w_h + b_h)·exp(A_h)  (Mamba-2)             | `[B, T, H]`    |
| `KeyDecay`     | logsigmoid(x W₁W₂ + b)/16, low rank 16  (GLA)          | `[B, T, H, K]` |
| `ChannelDecay` | −softplus(x W₁W₂ + b_{h,c})·exp(A_h)  (KDA)            | `[B, T, H, K]` |
| `RWKV7Decay`   | −e^(−½)·sigmoid(w₀ + tanh(x W₁) W₂)  (RWKV-7)         | `[B, T, H, K]` |

(retnet; gated, gated_deltanet, gated_deltaproduct; gla; kda; rwkv7.)
Inits: A_h ~ U[1, 16] and softplus(b) ~ logU[1e-3, 1e-1] (Mamba-2's, per channel for KDA), so a
token's −log γ starts in about [1e-3, 1.6]. Decays are float32 end to end: the projections
compute in float32 whatever the mixer's compute dtype. A decay is called on a whole sequence;
the decode step calls it on `x[:, None]` (`per_token`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention.layers.projections import LowRank


def mamba2_init(rngs: nnx.Rngs, num_a: int, num_dt: int, param_dtype):
    """`(a_log [num_a], dt_bias [num_dt])`: A ~ U[1, 16], softplus(dt_bias) ~ logU[1e-3, 1e-1]."""
    a = jax.random.uniform(rngs.params(), (num_a,), jnp.float32, 1.0, 16.0)
    dt = jnp.exp(
        jax.random.uniform(rngs.params(), (num_dt,), jnp.float32, jnp.log(1e-3), jnp.log(1e-1))
    )
    # inverse softplus, so that softplus(dt_bias) = dt at init
    dt_bias = dt + jnp.log(-jnp.expm1(-dt))
    return nnx.Param(jnp.log(a).astype(param_dtype)), nnx.Param(dt_bias.astype(param_dtype))


class FixedDecay(nnx.Module):
    """RetNet's multi-scale decay γ_h = 1 − 2^(−5−h), h = 0..H−1 (no parameters)."""

    def __init__(self, d_model: int, num_heads: int, key_dim: int, *, param_dtype, rngs):
        del d_model, key_dim, param_dtype, rngs
        self.num_heads = num_heads

    def __call__(self, x_BTD):
        gamma_H = 1.0 - 2.0 ** (-5.0 - jnp.arange(self.num_heads, dtype=jnp.float32))
        return jnp.log(gamma_H)


class ScalarDecay(nnx.Module):
    """Mamba-2 / simple GLA: a data-dependent scalar decay per head and token,
    log γ = −dt·exp(A) with the step dt = softplus(x·w + b) (`step_size`; Mamba-2 also scales
    its input by dt: the `gated` mixer's `dt_input`)."""

    def __init__(self, d_model: int, num_heads: int, key_dim: int, *, param_dtype, rngs):
        del key_dim
        self.proj = nnx.Linear(
            d_model,
            num_heads,
            use_bias=False,
            dtype=jnp.float32,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.a_log, self.dt_bias = mamba2_init(rngs, num_heads, num_heads, param_dtype)

    def step_size(self, x_BTD):
        """dt = softplus(x·w + b) `[B, T, H]` float32 (> 0)."""
        z_BTH = self.proj(x_BTD).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        return jax.nn.softplus(z_BTH)

    def from_step(self, dt_BTH):
        """log γ = −dt·exp(A) for the step `dt`."""
        return -dt_BTH * jnp.exp(self.a_log[...].astype(jnp.float32))

    def __call__(self, x_BTD):
        return self.from_step(self.step_size(x_BTD))


class KeyDecay(nnx.Module):
    """GLA: a decay per key dimension from a rank-16 gate, log γ = logsigmoid(x W₁W₂ + b)/τ with
    τ = 16 (keeps γ near 1, a long memory, at init)."""

    RANK = 16
    TEMPERATURE = 16.0

    def __init__(self, d_model: int, num_heads: int, key_dim: int, *, param_dtype, rngs):
        self.num_heads, self.key_dim = num_heads, key_dim
        lin = dict(dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)
        self.down = nnx.Linear(d_model, self.RANK, use_bias=False, **lin)
        self.up = nnx.Linear(self.RANK, num_heads * key_dim, **lin)

    def __call__(self, x_BTD):
        b, t, _ = x_BTD.shape
        z_BTF = self.up(self.down(x_BTD.astype(jnp.float32)))
        log_gamma_BTF = jax.nn.log_sigmoid(z_BTF) / self.TEMPERATURE
        return log_gamma_BTF.reshape(b, t, self.num_heads, self.key_dim)


class ChannelDecay(nnx.Module):
    """KDA (Kimi Linear): a decay per head and key channel,

        log γ_{t,h,c} = −softplus((x_t W₁ W₂)_{h,c} + b_{h,c}) · exp(A_h)

    with W₁: [d_model, r] (r = `rank`, Kimi Linear's head_dim), W₂: [r, H·K], Mamba-2's init of A
    and b per channel."""

    def __init__(self, d_model: int, num_heads: int, key_dim: int, *, rank: int, param_dtype, rngs):
        self.num_heads, self.key_dim = num_heads, key_dim
        lin = dict(use_bias=False, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)
        self.down = nnx.Linear(d_model, rank, **lin)
        self.up = nnx.Linear(rank, num_heads * key_dim, **lin)
        self.a_log, self.dt_bias = mamba2_init(rngs, num_heads, num_heads * key_dim, param_dtype)

    def __call__(self, x_BTD):
        b, t, _ = x_BTD.shape
        z_BTF = self.up(self.down(x_BTD.astype(jnp.float32))) + self.dt_bias[...].astype(
            jnp.float32
        )
        z_BTHK = z_BTF.reshape(b, t, self.num_heads, self.key_dim)
        a_H1 = jnp.exp(self.a_log[...].astype(jnp.float32))[:, None]
        return -jax.nn.softplus(z_BTHK) * a_H1


class RWKV7Decay(nnx.Module):
    """RWKV-7's decay per head and key channel, from the token-shifted input x_w:

        ω = −softplus(−(w₀ + tanh(x W₁) W₂)) − ½          RWKV-7's soft clamp to (−∞, −½)
        γ = exp(−exp(ω)),  so  log γ = −e^(−½)·sigmoid(w₀ + tanh(x W₁) W₂)  ∈ (−e^(−½), 0)

    (exp(−softplus(−z)) = sigmoid(z); the sigmoid form is computed, exact and free of overflow.)
    Every token keeps at least e^(−e^(−½)) ≈ 0.545 of each state row. W₁: [d_model, `rank`]
    starts at zero, W₂ orthogonal × 0.1 (`projections.LowRank`); w₀ per channel follows RWKV-7's
    init at a middle layer (the mixer does not know its depth), w₀_i = −6.5 + 5·(i/(HK−1))^1.56
    over the H·K channels, so log γ starts in about [−0.11, −0.001]: a long memory."""

    def __init__(self, d_model: int, num_heads: int, key_dim: int, *, rank: int, param_dtype, rngs):
        self.num_heads, self.key_dim = num_heads, key_dim
        n = num_heads * key_dim
        ratio = jnp.arange(n, dtype=jnp.float32) / max(n - 1, 1)
        # RWKV-7: −7 + 5·ratio^(0.85 + (layer ratio)^½) + ½; a layer ratio of ½ here
        w0 = -7.0 + 5.0 * ratio ** (0.85 + 0.5**0.5) + 0.5
        self.lora = LowRank(
            d_model, n, rank, activation="tanh", bias=w0, param_dtype=param_dtype, rngs=rngs
        )

    def __call__(self, x_BTD):
        b, t, _ = x_BTD.shape
        z_BTF = self.lora(x_BTD)
        log_gamma_BTF = -jnp.exp(-0.5) * jax.nn.sigmoid(z_BTF)
        return log_gamma_BTF.reshape(b, t, self.num_heads, self.key_dim)


def per_token(log_decay):
    """A decay computed on `x[:, None]` for one decode step: `[B, 1, H(, K)]` -> `[B, H(, K)]`;
    a fixed `[H]` decay or None stays as it is."""
    if log_decay is None or log_decay.ndim < 3:
        return log_decay
    return log_decay[:, 0]
