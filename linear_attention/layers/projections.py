"""Input parts of a mixer: the q/k/v projection (optional short conv and rotary) and token shift.

`QKVProjection` maps `x[B, T, d_model]` to

    q, k = split(conv?(x W))            q [B, T, H, Dk], k [B, T, HK, Dk]
    q, k ← RMSNorm(q), RMSNorm(k)?      (`qk_norm`: one scale [Dk] shared by the heads; with
                                         `qk_norm_all_heads` over each one's H·Dk / HK·Dk
                                         channels at once, scales [H·Dk] and [HK·Dk])
    q, k ← rope?(q), rope?(k)           (at absolute positions; `rotary_dim`: first channels)
    v                                   [B, T, HV, Dv]     (HV = H, or grouped value heads)

(HK = H, or fewer key heads for grouped-query attention: softmax's `num_kv_heads`)

(with `num_keys` n, Gated DeltaProduct's n keys and values per token: k `[B, T, H, n, Dk]`,
v `[B, T, HV, n, Dv]`, the n axis kept for n = 1 too; `num_keys=None`, the default: one key
without that axis)

with one fused projection `qkv_proj` (a depthwise conv over its channels is the same as one conv
per q, k and v). Its decoding state is the conv tail `[B, K−1, C]` float32 (None without conv).
Positions: `position + t` on a whole sequence or a decode step, the shard's global offset when
time is split (`layers.sequence`), within-document positions for packed rows when
`reset_positions`.

`TokenShift` gives each token the previous token's input (RWKV's time shift): x_{t−1}, zero before
the first token and at every document start; its decoding state is the last input `[B, 1, D]`.
`ShiftedInputs` is RWKV's input part on top of it, one learned interpolation per branch c,
x_c = x_t + (x_{t−1} − x_t) ⊙ μ_c (RWKV-7's static `lerp`, no data-dependent mix as RWKV-6).

`LowRank` is the small bottleneck projection RWKV-7 uses for its decay, in-context rate and
value-residual gates: `b + act(x W₁) W₂` (RWKV's "LoRA").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention.layers.conv import ShortConv
from linear_attention.layers.norm import RMSNorm
from linear_attention.layers.rotary import apply_rotary
from linear_attention.layers.segments import Segments
from linear_attention.layers.sequence import previous_tail, sequence_axis


class QKVProjection(nnx.Module):
    """q `[B, T, H, Dk]`, k `[B, T, HK, Dk]` and v `[B, T, HV, Dv]` from one projection, conv,
    q/k norm and rotary."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        qk_dim: int,
        v_dim: int,
        *,
        num_value_heads: int | None = None,
        num_key_heads: int | None = None,
        num_keys: int | None = None,
        conv: int = 0,
        conv_bias: bool = True,
        qk_norm: bool = False,
        qk_norm_all_heads: bool = False,
        rope: bool = False,
        rope_base: float = 10000.0,
        rotary_dim: int | None = None,
        reset_positions: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.num_heads, self.qk_dim, self.v_dim = num_heads, qk_dim, v_dim
        self.num_value_heads = num_value_heads or num_heads
        self.num_key_heads = num_key_heads or num_heads
        self.num_keys = num_keys
        self.rope, self.rope_base, self.reset_positions = rope, rope_base, reset_positions
        self.rotary_dim = rotary_dim
        n = num_keys or 1
        hk = self.num_key_heads
        width = (num_heads + n * hk) * qk_dim + n * self.num_value_heads * v_dim
        self.qkv_proj = nnx.Linear(
            d_model, width, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.conv = (
            ShortConv(
                width, conv, use_bias=conv_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs
            )
            if conv
            else None
        )
        norm = dict(eps=1e-6, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.qk_norm_all_heads = qk_norm_all_heads
        q_width, k_width = (
            (num_heads * qk_dim, n * hk * qk_dim) if qk_norm_all_heads else (qk_dim,) * 2
        )
        self.q_norm = RMSNorm(q_width, **norm) if qk_norm else None
        self.k_norm = RMSNorm(k_width, **norm) if qk_norm else None

    def init_state(self, batch_size: int) -> jax.Array | None:
        return None if self.conv is None else self.conv.init_state(batch_size)

    def __call__(self, x_BTD, conv_tail, position, segments: Segments | None = None):
        """`(q, k, v, new conv tail)`. `conv_tail=None` on a whole sequence (zeros, or the
        previous shard's inputs when time is split); `segments` only on a whole sequence."""
        b, t, _ = x_BTD.shape
        h, hk, hv, dk, dv, n = (
            self.num_heads,
            self.num_key_heads,
            self.num_value_heads,
            self.qk_dim,
            self.v_dim,
            self.num_keys or 1,
        )
        qkv = self.qkv_proj(x_BTD)
        if self.conv is not None:
            ids = None if segments is None else segments.ids  # (packed rows: from empty)
            qkv, conv_tail = self.conv.sequence(qkv, conv_tail, ids)
        q_BTF, k_BTF = qkv[..., : h * dk], qkv[..., h * dk : (h + n * hk) * dk]
        if self.q_norm is not None and self.qk_norm_all_heads:
            q_BTF, k_BTF = self.q_norm(q_BTF), self.k_norm(k_BTF)
        q_BTHK = q_BTF.reshape(b, t, h, dk)
        k_BTHK = k_BTF.reshape(b, t, hk * n, dk)
        v_BTHD = qkv[..., (h + n * hk) * dk :].reshape(b, t, hv * n, dv)
        if self.q_norm is not None and not self.qk_norm_all_heads:
            q_BTHK, k_BTHK = self.q_norm(q_BTHK), self.k_norm(k_BTHK)
        if self.rope:
            positions = position + jnp.arange(t, dtype=jnp.int32)
            if segments is not None and self.reset_positions:
                positions = segments.positions  # [B, T]
            rotary = dict(base=self.rope_base, rotary_dim=self.rotary_dim)
            q_BTHK = apply_rotary(q_BTHK, positions, **rotary)
            k_BTHK = apply_rotary(k_BTHK, positions, **rotary)
        if self.num_keys is not None:  # an n axis, also for n = 1 (DeltaProduct's kernels)
            k_BTHK = k_BTHK.reshape(b, t, hk, n, dk)
            v_BTHD = v_BTHD.reshape(b, t, hv, n, dv)
        return q_BTHK, k_BTHK, v_BTHD, conv_tail


class TokenShift(nnx.Module):
    """`x_{t−1}` for every token (zeros before the first token and at document starts)."""

    def __init__(self, d_model: int):
        self.d_model = d_model

    def init_state(self, batch_size: int) -> jax.Array:
        """The last input `[B, 1, D]` float32 (zeros: nothing before)."""
        return jnp.zeros((batch_size, 1, self.d_model), jnp.float32)

    def __call__(self, x_BTD, tail_B1D, segments: Segments | None = None):
        """`(x_prev [B, T, D], new tail)`; `tail=None` on a whole sequence (zeros, or the
        previous shard's last token when time is split)."""
        if tail_B1D is None:
            axis = sequence_axis()
            tail_B1D = self.init_state(x_BTD.shape[0]) if axis is None else previous_tail(x_BTD, 1)
        xp_BSD = jnp.concatenate([tail_B1D.astype(x_BTD.dtype), x_BTD], axis=1)
        prev_BTD = xp_BSD[:, :-1]
        if segments is not None:  # a document's first token has nothing before it
            prev_BTD = jnp.where(segments.starts[..., None], jnp.zeros((), x_BTD.dtype), prev_BTD)
        return prev_BTD, xp_BSD[:, -1:].astype(jnp.float32)


class ShiftedInputs(nnx.Module):
    """RWKV's token-shifted inputs: for each of `num_branches` branches c,

        x_c = x_t + (x_{t−1} − x_t) ⊙ μ_c        μ: [num_branches, D], float32 parameters

    `mu_init` `[num_branches, D]` gives μ at init. The decoding state is `TokenShift`'s."""

    def __init__(self, d_model: int, mu_init, *, param_dtype=jnp.float32):
        mu_init = np.asarray(mu_init, np.float32)
        if mu_init.ndim != 2 or mu_init.shape[1] != d_model:
            raise ValueError(f"mu_init must be [branches, {d_model}], got shape {mu_init.shape}")
        self.shift = TokenShift(d_model)
        self.mu = nnx.Param(jnp.asarray(mu_init, param_dtype))

    def init_state(self, batch_size: int) -> jax.Array:
        return self.shift.init_state(batch_size)

    def __call__(self, x_BTD, tail_B1D, segments: Segments | None = None):
        """`(tuple of the branches' x_c [B, T, D] in x's dtype, new tail)`."""
        prev_BTD, tail_B1D = self.shift(x_BTD, tail_B1D, segments)
        delta_BTD = prev_BTD - x_BTD
        mu_ND = self.mu[...].astype(x_BTD.dtype)
        return tuple(x_BTD + delta_BTD * mu_ND[i] for i in range(mu_ND.shape[0])), tail_B1D


def float32_init(init):
    """``init`` computed in float32 and cast to the parameter dtype: QR (the orthogonal
    initialiser) has no bfloat16 kernel, and bfloat16 parameters then equal the float32 model's,
    rounded."""

    def wrapped(key, shape, dtype=jnp.float32):
        return init(key, shape, jnp.float32).astype(dtype)

    return wrapped


class LowRank(nnx.Module):
    """`b + act(x W₁) W₂`, W₁: [d_in, rank], W₂: [rank, d_out] (`nnx.Linear` kernels, counted
    as matmuls by the FLOPs count), computed in float32: the mixer's gates and decays are
    float32 whatever its compute dtype. As RWKV-7 initialises them: W₁ = 0 (the output starts at
    b), W₂ orthogonal with scale `w2_scale`; `bias` is b at init (an array `[d_out]`, or None:
    no bias)."""

    ACTIVATIONS = {"tanh": jnp.tanh, "none": None}

    def __init__(
        self,
        d_in: int,
        d_out: int,
        rank: int,
        *,
        activation: str = "none",
        bias=None,
        w2_scale: float = 0.1,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if activation not in self.ACTIVATIONS:
            raise ValueError(
                f"unknown activation {activation!r}; allowed: {sorted(self.ACTIVATIONS)}"
            )
        self.activation = activation
        common = dict(dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)
        zeros = nnx.initializers.zeros_init()
        self.down = nnx.Linear(d_in, rank, use_bias=False, kernel_init=zeros, **common)
        self.up = nnx.Linear(
            rank,
            d_out,
            use_bias=bias is not None,
            kernel_init=float32_init(nnx.initializers.orthogonal(scale=w2_scale)),
            **common,
        )
        if bias is not None:
            self.up.bias[...] = jnp.broadcast_to(jnp.asarray(bias, param_dtype), (d_out,))

    def __call__(self, x):
        z = self.down(x.astype(jnp.float32))
        act = self.ACTIVATIONS[self.activation]
        return self.up(z if act is None else act(z))
