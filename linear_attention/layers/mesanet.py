"""MesaNet (von Oswald et al. 2025): each head's output is the regularised least-squares read-out
of its decayed key statistics, `kernels.mesa_net`.

    q, k = silu(conv(x W_q)), silu(conv(x W_k)),  v = x W_v     (no conv on v, as FLA's layer)
    q ← l2norm(q),  k ← l2norm(k)                               per head, in float32
    log γ_t = logsigmoid(x_t·w_a + b_a),  β_t = sigmoid(x_t·w_b + b_b)     per head, float32
    λ = softplus(p) + 0.25  per head and key channel (p: a parameter; λ = 1 at init)
    H_kk,t = γ_t H_kk,t−1 + β_t k_t k_tᵀ,   H_kv,t = γ_t H_kv,t−1 + β_t k_t v_tᵀ
    o_t = H_kv,tᵀ (H_kk,t + diag(λ))⁻¹ q_t                       (`cg_steps` CG iterations)
    y   = RMSNorm(o) W_o            (with `out_gate`: (RMSNorm(o) ⊙ silu(x W_g)) W_o)

flash-linear-attention's `MesaNet` layer: its short conv on q and k only (kernel 4, SiLU), no
scaling of q after the L2 norm, the lower bound 0.25 on λ, 30 CG iterations, the output norm on
and the output gate off by default (`out_gate=True` is its `use_output_gate`). Without `conv`
the SiLU is applied directly (as the delta mixers do). Left as this library's parts have them:
the conv's bias (FLA's has none; here it starts at 0), the output RMSNorm's eps (1e-6, FLA's
1e-5) and the projections' initialisers (the gate biases start at 0, so γ ≈ σ(x·w_a) ≈ ½ on
average, as FLA's small uniform biases give). The sequence paths call
`kernels.mesa_net` (`method` "chunk", "scan" or "exact"; `chunk_size`; `cg_steps`), `step`
calls `kernels.mesa_net_step` with the same CG; the state is `MesaNetState(kk [B, H, Dk, Dk],
kv [B, H, Dk, Dv])`, float32, whatever the context length. Both statistics are affine in the
past, so a time split (`mesh.seq > 1`) is supported (the kernel's `axis_name`).

When to raise `cg_steps`: CG converges in about √κ iterations, κ the condition number of
H_kk + diag(λ); λ ≥ 0.25 bounds it by 1 + 4·λ_max(H_kk), and H_kk grows with slow decay
(γ near 1) over long documents. The default 30 reaches a relative residual below 1e-6 on random
unit keys (K up to 64, `kernels.mesa_net`'s docstring); raise it when
`kernels.mesa_net_residual` of the layer's inputs is not small (an eager call of the kernel
warns past 1e-3), as keys that fill few directions over long documents can make it
(`cg_steps` ≥ the head width is exact in exact arithmetic).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention import kernels as K
from linear_attention.layers.base import Mixer
from linear_attention.layers.delta import l2norm
from linear_attention.layers.options import (
    CHUNK_SIZE,
    CONV,
    METHOD,
    OUT_GATE,
    OUT_NORM,
    MixerConfig,
    conv_kernel_size,
    option,
)
from linear_attention.layers.projections import QKVProjection
from linear_attention.layers.sequence import sequence_axis

CG_STEPS = option(
    30,
    "conjugate-gradient iterations per solve (mesanet); raise it when "
    "kernels.mesa_net_residual is not small",
)
LAMBDA_FLOOR = 0.25  # λ = softplus(p) + LAMBDA_FLOOR > 0: H_kk + diag(λ) stays well conditioned
LAMBDA_INIT = 1.0


@dataclasses.dataclass(frozen=True)
class MesaNetConfig(MixerConfig):
    conv: bool | int | None = CONV.field(True)
    out_norm: bool = OUT_NORM.field(True)
    out_gate: bool = OUT_GATE.field(False)
    method: str = METHOD.field(choices=K.MESA_NET.supported)
    chunk_size: int = CHUNK_SIZE.field()
    cg_steps: int = CG_STEPS.field()


class MesaInputs(nnx.Module):
    """q, k `[B, T, H, Dk]` from a `QKVProjection` without values (its conv and rotary act on
    q and k only), v `[B, T, H, Dv]` from a projection of its own, unconvolved."""

    def __init__(self, d_model, num_heads, qk_dim, v_dim, *, dtype, param_dtype, rngs, **qk):
        self.num_heads, self.v_dim = num_heads, v_dim
        self.qk = QKVProjection(
            d_model, num_heads, qk_dim, 0, dtype=dtype, param_dtype=param_dtype, rngs=rngs, **qk
        )
        self.v_proj = nnx.Linear(
            d_model,
            num_heads * v_dim,
            use_bias=False,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def init_state(self, batch_size: int) -> jax.Array | None:
        return self.qk.init_state(batch_size)

    def __call__(self, x_BTD, conv_tail, position, segments=None):
        q_BTHK, k_BTHK, _, conv_tail = self.qk(x_BTD, conv_tail, position, segments)
        b, t, _ = x_BTD.shape
        v_BTHD = self.v_proj(x_BTD).reshape(b, t, self.num_heads, self.v_dim)
        return q_BTHK, k_BTHK, v_BTHD, conv_tail


class MesaNetMixer(Mixer):
    """MesaNet: the output of a locally optimal linear fit of the values, per head (module)."""

    NAME = "mesanet"
    FAMILY = K.MESA_NET
    OPTIONS = MesaNetConfig
    SEQUENCE_PARALLEL = True

    def _build_inputs(self, rngs: nnx.Rngs) -> nnx.Module:
        opts = self.options
        return MesaInputs(
            self.d_model,
            self.num_heads,
            self.qk_dim,
            self.head_dim,
            conv=conv_kernel_size(opts["conv"]),
            rope=opts["rope"],
            rope_base=opts["rope_base"],
            reset_positions=opts["reset_positions"],
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )

    def _build(self, rngs) -> None:
        opts = self.options
        self.method, self.chunk_size, self.cg_steps = (
            opts["method"],
            opts["chunk_size"],
            opts["cg_steps"],
        )
        self.conv_silu = self.inputs.qk.conv is not None  # the conv applies the SiLU itself
        # the gates are float32 whatever `dtype`
        lin = dict(use_bias=True, dtype=jnp.float32, param_dtype=self.param_dtype, rngs=rngs)
        self.decay_proj = nnx.Linear(self.d_model, self.num_heads, **lin)
        self.beta_proj = nnx.Linear(self.d_model, self.num_heads, **lin)
        p0 = math.log(math.expm1(LAMBDA_INIT - LAMBDA_FLOOR))  # softplus(p0) + floor = init
        shape = (self.num_heads, self.qk_dim)
        self.lambda_param = nnx.Param(jnp.full(shape, p0, jnp.float32).astype(self.param_dtype))

    def _flops_sizes(self) -> dict:
        return dict(cg_steps=self.cg_steps)

    def gates(self, x_BTD):
        """(log γ, β), float32 `[..., H]`, and λ `[H, Dk]` float32."""
        log_decay = jax.nn.log_sigmoid(self.decay_proj(x_BTD).astype(jnp.float32))
        beta = jax.nn.sigmoid(self.beta_proj(x_BTD).astype(jnp.float32))
        lam = jax.nn.softplus(self.lambda_param[...].astype(jnp.float32)) + LAMBDA_FLOOR
        return log_decay, beta, lam

    def prepare(self, q, k):
        """The q and k the kernel receives: SiLU (unless the conv applied it), L2-normalised."""
        if not self.conv_silu:
            q, k = jax.nn.silu(q), jax.nn.silu(k)
        return l2norm(q).astype(q.dtype), l2norm(k).astype(k.dtype)

    def _init_core(self, batch_size: int, max_length: int) -> K.MesaNetState:
        del max_length  # the state does not grow with the context
        return K.MesaNetState.zeros(batch_size, self.num_heads, self.qk_dim, self.head_dim)

    def _mix(self, x_BTD, q_BTHK, k_BTHK, v_BTHD, core, position, segments=None):
        del position
        q, k = self.prepare(q_BTHK, k_BTHK)
        log_decay, beta, lam = self.gates(x_BTD)
        options = dict(
            segment_ids=segments,
            method=self.method,
            chunk_size=self.chunk_size,
            cg_steps=self.cg_steps,
            axis_name=sequence_axis(),
        )
        if core is None:
            return K.mesa_net(q, k, v_BTHD, log_decay, beta, lam, **options), None
        return K.mesa_net(
            q, k, v_BTHD, log_decay, beta, lam, initial_state=core, return_state=True,
            **options,
        )  # fmt: skip

    def _mix_step(self, x_BD, q_BHK, k_BHK, v_BHD, core, position):
        del position
        q, k = self.prepare(q_BHK, k_BHK)
        log_decay, beta, lam = self.gates(x_BD)
        cg_steps = None if self.method == "exact" else self.cg_steps
        return K.mesa_net_step(core, q, k, v_BHD, log_decay, beta, lam, cg_steps=cg_steps)
