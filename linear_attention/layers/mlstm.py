"""xLSTM's matrix memory (`mlstm`, Beck et al. 2024; the xLSTM-7B layer) over the linear-attention
kernel.

    q, k, v = x W_q, x W_k, x W_v           q, k [H, Dk] (Dk = `state_dim`, default Dv/2), v [H, Dv]
    ĩ_t = c·tanh((x W_i + b_i)/c),  f̃_t likewise                per head, soft cap c = 15
    C_t = σ(f̃_t) C_{t−1} + e^{ĩ_t} k_t v_tᵀ,   n_t = σ(f̃_t) n_{t−1} + e^{ĩ_t} k_t
    m_t = max(log σ(f̃_t) + m_{t−1}, ĩ_t)                         the stabiliser, m = 0 at start
    h_t = C_tᵀ q̂_t / (max(|n_tᵀ q̂_t|, 1) + ε e^{m_t}),   q̂ = q / √Dk,  ε = 1e-6
    y   = (LayerNorm_per_head(h) ⊙ sigmoid(x W_o)) W_out              (eps 1e-6)

xLSTM keeps the stabilised C̃ = C e^{−m}, ñ = n e^{−m} and divides by max(|ñᵀq̂|, e^{−m}) + ε
(transformers' `mlstm_recurrent_step_native`); multiplied through by e^{m} that is the form
above, whose C and n are a linear-attention state: one `causal_linear_attention` call (log
decay log σ(f̃) per head, keys e^{ĩ} k, no denominator) on values [v, 1], whose last column is
n_tᵀ q̂_t. The soft cap bounds e^{ĩ} by e^{15} ≈ 3.3e6, well inside float32, so the state needs
no stabilising; m itself (it weighs ε) is a max-plus scan, `lax.associative_scan` over (a, b) =
(log σ(f̃), ĩ) with (a₁, b₁)∘(a₂, b₂) = (a₁ + a₂, max(b₁ + a₂, b₂)), restarting at 0 at each
document start (`mlstm_attention`). The decoding state is `MLSTMState(kv [B, H, Dk, Dv + 1]
(C and n), m [B, H])`, float32 (C̃ = C e^{−m}, ñ = n e^{−m} are xLSTM's).

Taken from transformers' `xLSTMLayer` (weight_mode "single"): the projections, the gates' init
(W_i = W_f = 0, b_i = −10, b_f = linspace(3, 6) over the heads), the soft cap, the per-head
LayerNorm and the sigmoid output gate. Not taken: the layer's biases (`use_bias`, off in
xLSTM-7B; the LayerNorm's bias here starts at 0). The stabiliser's scan does not split over
a mesh axis (no sequence parallelism); `rope` is refused (no positions).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention import kernels as K
from linear_attention.layers.base import Mixer
from linear_attention.layers.linear import LINEAR_METHODS
from linear_attention.layers.options import (
    CHUNK_SIZE,
    METHOD,
    STATE_DIM,
    GatedOutputConfig,
)

SOFT_CAP = 15.0
EPS = 1e-6
NORM_EPS = 1e-6


class MLSTMState(NamedTuple):
    """The mLSTM's state: C and n as one linear-attention state (n the last value column),
    and the stabiliser m `[B, H]`, float32."""

    kv: K.LinearAttentionState
    m: jax.Array


def soft_cap(x, cap: float = SOFT_CAP):
    """c·tanh(x/c), float32."""
    return cap * jnp.tanh(x.astype(jnp.float32) / cap)


def _stabiliser(a_BTH, b_BTH, m0_BH, starts_BT):
    """m_t = max(a_t + m_{t−1}, b_t) from m0 (0 again at each document start), float32."""
    if starts_BT is not None:  # m_{t−1} = 0 there: the pair becomes the constant max(a_t, b_t)
        s = starts_BT[..., None]
        a_BTH, b_BTH = jnp.where(s, -jnp.inf, a_BTH), jnp.where(s, jnp.maximum(a_BTH, b_BTH), b_BTH)

    def combine(first, second):  # (a reset keeps nothing before it, not even a NaN)
        (a1, b1), (a2, b2) = first, second
        reset = a2 == -jnp.inf
        return jnp.where(reset, a2, a1 + a2), jnp.where(reset, b2, jnp.maximum(b1 + a2, b2))

    a_cum, b_cum = jax.lax.associative_scan(combine, (a_BTH, b_BTH), axis=1)
    return jnp.maximum(a_cum + m0_BH[:, None], b_cum)


def _read(o_BTHX, m_BTH, dtype):
    """h = C q̂ / (max(|n q̂|, 1) + ε e^m) from the kernel's [C q̂, n q̂] columns."""
    o = o_BTHX.astype(jnp.float32)
    denominator = jnp.maximum(jnp.abs(o[..., -1:]), 1.0) + EPS * jnp.exp(m_BTH)[..., None]
    return (o[..., :-1] / denominator).astype(dtype)


def mlstm_attention(
    q, k, v, i_pre, f_pre, *, method="chunk", chunk_size=64, initial_state=None, segments=None
):
    """The mLSTM cell (module docstring) on q, k `[B, T, H, Dk]`, v `[B, T, H, Dv]` and the
    soft-capped gate pre-activations ĩ, f̃ `[B, T, H]`; `segments` restarts at each document
    (only without `initial_state`). Returns h in v's dtype, and with `initial_state` (an
    `MLSTMState`) the state after the last token."""
    b, t, h, dk = k.shape
    log_f = jax.nn.log_sigmoid(f_pre.astype(jnp.float32))
    i32 = i_pre.astype(jnp.float32)
    q_hat = q * jnp.asarray(dk**-0.5, q.dtype)
    k_in = (k.astype(jnp.float32) * jnp.exp(i32)[..., None]).astype(k.dtype)
    v_in = jnp.concatenate([v, jnp.ones((b, t, h, 1), v.dtype)], axis=-1)
    m0 = jnp.zeros((b, h), jnp.float32) if initial_state is None else initial_state.m
    m = _stabiliser(log_f, i32, m0, None if segments is None else segments.starts)
    options = dict(
        log_decay=log_f, normalize=False, method=method, chunk_size=chunk_size, segment_ids=segments
    )
    if initial_state is None:
        o = K.causal_linear_attention(q_hat, k_in, v_in, **options)
        return _read(o, m, v.dtype)
    o, kv = K.causal_linear_attention(
        q_hat, k_in, v_in, initial_state=initial_state.kv, return_state=True, **options
    )
    return _read(o, m, v.dtype), MLSTMState(kv, m[:, -1])


def mlstm_step(state: MLSTMState, q, k, v, i_pre, f_pre):
    """One token of `mlstm_attention`: q, k `[B, H, Dk]`, v `[B, H, Dv]`, ĩ, f̃ `[B, H]`."""
    log_f = jax.nn.log_sigmoid(f_pre.astype(jnp.float32))
    i32 = i_pre.astype(jnp.float32)
    m = jnp.maximum(log_f + state.m, i32)
    q_hat = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    k_in = (k.astype(jnp.float32) * jnp.exp(i32)[..., None]).astype(k.dtype)
    v_in = jnp.concatenate([v, jnp.ones(v.shape[:-1] + (1,), v.dtype)], axis=-1)
    o, kv = K.recurrent_step(state.kv, q_hat, k_in, v_in, log_decay=log_f, normalize=False)
    return _read(o, m, v.dtype), MLSTMState(kv, m)


@dataclasses.dataclass(frozen=True)
class MLSTMConfig(GatedOutputConfig):
    state_dim: int | None = STATE_DIM.field()
    method: str = METHOD.field(choices=LINEAR_METHODS)
    chunk_size: int = CHUNK_SIZE.field()


class MLSTMMixer(Mixer):
    """xLSTM's mLSTM layer: exponential input gate, sigmoid forget gate, normaliser state."""

    NAME = "mlstm"
    FAMILY = K.LINEAR
    OPTIONS = MLSTMConfig
    NOT_TAKEN = dict(rope="it has no positions")

    @classmethod
    def _qk_dim(cls, head_dim, options):
        return options.get("state_dim") or max(1, head_dim // 2)  # xLSTM's qk_dim_factor ½

    def _flops_sizes(self) -> dict:
        return dict(dv=self.head_dim + 1)  # (n rides along as one more value column)

    def _output_options(self) -> dict:
        return dict(norm_type="layer", norm_eps=NORM_EPS, gate_activation="sigmoid")

    def _build(self, rngs) -> None:
        self.method, self.chunk_size = self.options["method"], self.options["chunk_size"]
        h = self.num_heads
        gate = dict(
            kernel_init=nnx.initializers.zeros_init(),
            dtype=jnp.float32,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )
        self.igate = nnx.Linear(self.d_model, h, **gate)
        self.fgate = nnx.Linear(self.d_model, h, **gate)
        self.igate.bias[...] = jnp.full((h,), -10.0, self.param_dtype)
        self.fgate.bias[...] = jnp.asarray(np.linspace(3.0, 6.0, h), self.param_dtype)

    def gates(self, x):
        """The soft-capped pre-activations (ĩ, f̃), float32 `[..., H]`."""
        x32 = x.astype(jnp.float32)
        return soft_cap(self.igate(x32)), soft_cap(self.fgate(x32))

    def _init_core(self, batch_size: int, max_length: int) -> MLSTMState:
        del max_length  # the state does not grow with the context
        h = self.num_heads
        kv = K.LinearAttentionState.zeros(batch_size, h, self.qk_dim, self.head_dim + 1)
        return MLSTMState(kv._replace(k_sum=None), jnp.zeros((batch_size, h), jnp.float32))

    def _mix(self, x_BTD, q_BTHK, k_BTHK, v_BTHD, core, position, segments=None):
        del position
        options = dict(method=self.method, chunk_size=self.chunk_size, segments=segments)
        if core is None:
            return mlstm_attention(q_BTHK, k_BTHK, v_BTHD, *self.gates(x_BTD), **options), None
        return mlstm_attention(
            q_BTHK, k_BTHK, v_BTHD, *self.gates(x_BTD), initial_state=core, **options
        )

    def _mix_step(self, x_BD, q_BHK, k_BHK, v_BHD, core, position):
        del position
        return mlstm_step(core, q_BHK, k_BHK, v_BHD, *self.gates(x_BD))


__all__ = ["MLSTMMixer", "MLSTMState", "mlstm_attention", "mlstm_step"]
