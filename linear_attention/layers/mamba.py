"""Mamba-1's block (`mamba`, Gu & Dao 2023) on the selective scan (`kernels.selective_scan`).

With E = expand · d_model channels, N = `state_dim` and R = `dt_rank`, per token:

    x, z = split(x_t W_in)                                      [E] each (`in_proj`)
    x    = silu(conv(x))                                         causal depthwise, kernel K = 4
    δ, B, C = split(x W_x)                                       [R], [N], [N]  (`x_proj`)
    Δ    = softplus(δ W_dt + b_dt)                               [E] > 0  (`dt_proj`, float32)
    h_t  = exp(Δ ⊙ A) ⊙ h_{t−1} + (Δ ⊙ x) ⊗ B,   A = −exp(A_log)  [E, N]
    y_t  = (h_t C + D ⊙ x) ⊙ silu(z)                            [E]
    out  = y_t W_out                                             (`out_proj`)

The parameters are transformers' `MambaMixer`'s, named as there (`in_proj` [D, 2E] with x's
columns first, `conv1d`, `x_proj` [E, R + 2N] with δ, B, C in that order, `dt_proj` with its
bias, `A_log` [E, N], `D` [E], `out_proj`; no bias on the in and out projections, as
`use_bias=False`, every released Mamba), so a checkpoint's tensors load as they are. Their
initialisation is also transformers': A_log = log(1..N) on every channel, D = 1, the dt_proj
kernel U(±R^−½) and its bias softplus⁻¹(dt) with dt = max(exp U(log 1e-3, log 1e-1), 1e-4), the
conv and out_proj U(±1/√fan_in) (torch's default); in_proj and x_proj the project's default.

The decoding state is the selective scan's `[B, E, N]` float32 and the conv's tail `[B, K−1, E]`
(`MixerState.conv`): O(1) in the context. Packed rows: the conv reads no other document and the
scan's state is zeroed at each document start (the kernel's `segment_ids`). Time splits over a
mesh axis: the conv's halo (`ShortConv.sequence`) and the scan's affine combine.

With `bcdt_norm_eps` set (Falcon-Mamba), δ, B and C are each divided by their root mean square
over their own width (plus eps), without a scale, before Δ's projection and the scan
(`FalconMambaWeightlessRMSNorm`, float32).

Not taken (`NOT_TAKEN`): `rope` (the recurrence orders the tokens), `out_norm`, `out_gate` (the
gate is silu(z) of the in-projection; Jamba's norms of δ, B and C, which have weights, are not
here) and `head_dim` (channels, not heads: `num_heads` is not read).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention import kernels as K
from linear_attention.fields import POSITIVE, spec_field
from linear_attention.layers.base import Mixer
from linear_attention.layers.conv import ShortConv
from linear_attention.layers.options import (
    CONV,
    CONV_BIAS,
    METHOD,
    STATE_DIM,
    MixerConfig,
    required_conv,
)
from linear_attention.layers.segments import Segments
from linear_attention.layers.sequence import sequence_axis

# The dt range at initialisation (transformers' time_step_min, time_step_max, time_step_floor).
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4
# torch's default Linear / Conv1d initialisation (kaiming uniform, a = √5): U(±1/√fan_in).
TORCH_DEFAULT = nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def dt_rank(d_model: int, rank: int | None) -> int:
    """The rank R of Δ's projection: `rank`, or transformers' "auto" ⌈d_model / 16⌉."""
    return rank or math.ceil(d_model / 16)


def inverse_softplus_dt(key, shape) -> jax.Array:
    """softplus⁻¹(dt), dt = max(exp U(log DT_MIN, log DT_MAX), DT_FLOOR), float32."""
    low, high = math.log(DT_MIN), math.log(DT_MAX)
    dt = jnp.maximum(jnp.exp(jax.random.uniform(key, shape, jnp.float32, low, high)), DT_FLOOR)
    return dt + jnp.log(-jnp.expm1(-dt))


@dataclasses.dataclass(frozen=True)
class MambaConfig(MixerConfig):
    conv: bool | int | None = CONV.field(4)
    conv_bias: bool = CONV_BIAS.field()
    method: str = METHOD.field("scan", choices=K.SELECTIVE_SCAN.supported)
    state_dim: int | None = STATE_DIM.field(16)
    expand: int = spec_field(2, "Mamba's channels per model dimension: E = expand · d_model")
    dt_rank: int | None = spec_field(
        None, "rank of Mamba's Δ projection (None: ⌈d_model / 16⌉, transformers' 'auto')"
    )
    bcdt_norm_eps: float | None = spec_field(
        None,
        "eps of weightless RMSNorms of δ, B and C before the scan (Falcon-Mamba's; None: none)",
        **POSITIVE,
    )


def _unit_rms(x, eps: float) -> jax.Array:
    """x / √(mean(x²) + eps) over the last axis without a scale, in float32, in x's dtype (as
    transformers' `FalconMambaWeightlessRMSNorm`)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class MambaInputs(nnx.Module):
    """`in_proj` and the causal conv: `(x [B, T, E] after conv and silu, z [B, T, E], tail)`."""

    def __init__(self, d_model, channels, conv, conv_bias, *, dtype, param_dtype, rngs):
        self.channels = channels
        self.in_proj = nnx.Linear(
            d_model, 2 * channels, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.conv1d = ShortConv(
            channels, conv, use_bias=conv_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )

    def init_state(self, batch_size: int) -> jax.Array:
        return self.conv1d.init_state(batch_size)

    def __call__(self, x_BTD, tail, segments: Segments | None = None):
        x_BTE, z_BTE = jnp.split(self.in_proj(x_BTD), 2, axis=-1)
        ids = None if segments is None else segments.ids
        x_BTE, tail = self.conv1d.sequence(x_BTE, tail, ids)
        return x_BTE, z_BTE, tail


class MambaMixer(Mixer):
    """Mamba-1's block: in_proj → conv → selective scan → silu(z) gate → out_proj (module)."""

    NAME = "mamba"
    FAMILY = K.SELECTIVE_SCAN
    OPTIONS = MambaConfig
    SEQUENCE_PARALLEL = True
    NOT_TAKEN = dict(
        rope="the recurrence orders the tokens (no positions)",
        out_norm="its output is gated by silu(z), not normalised",
        out_gate="its gate is silu(z) of in_proj, always on",
        head_dim="its E = expand · d_model channels have no heads",
    )

    @classmethod
    def _check_family_options(cls, num_heads, options) -> None:
        required_conv(cls.NAME, options["conv"])

    def _build_inputs(self, rngs: nnx.Rngs) -> nnx.Module:
        opts = self.options
        self.channels = opts["expand"] * self.d_model
        return MambaInputs(
            self.d_model,
            self.channels,
            required_conv(self.NAME, opts["conv"]),
            opts["conv_bias"],
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )

    def _build_output(self, rngs: nnx.Rngs) -> None:
        return None  # (`out_proj`, made in `_build`)

    def _build(self, rngs: nnx.Rngs) -> None:
        opts = self.options
        e, n = self.channels, opts["state_dim"]
        self.method, self.state_size = opts["method"], n
        self.bcdt_norm_eps = opts["bcdt_norm_eps"]
        self.dt_rank = r = dt_rank(self.d_model, opts["dt_rank"])
        common = dict(param_dtype=self.param_dtype, rngs=rngs)
        self.x_proj = nnx.Linear(e, r + 2 * n, use_bias=False, dtype=self.dtype, **common)
        bound = r**-0.5
        self.dt_proj = nnx.Linear(
            r,
            e,
            kernel_init=lambda key, shape, dtype: jax.random.uniform(
                key, shape, dtype, -bound, bound
            ),
            bias_init=lambda key, shape, dtype: inverse_softplus_dt(key, shape).astype(dtype),
            dtype=jnp.float32,  # Δ is a decay's step: float32 whatever the compute dtype
            **common,
        )
        a_log = jnp.log(jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.float32), (e, n)))
        self.A_log = nnx.Param(a_log.astype(self.param_dtype))
        self.D = nnx.Param(jnp.ones((e,), self.param_dtype))
        self.out_proj = nnx.Linear(
            e, self.d_model, use_bias=False, kernel_init=TORCH_DEFAULT, dtype=self.dtype, **common
        )

    def _flops_sizes(self) -> dict:
        return dict(width=self.channels, state_size=self.state_size)

    def _init_core(self, batch_size: int, max_length: int) -> jax.Array:
        del max_length  # the state does not grow with the context
        return jnp.zeros((batch_size, self.channels, self.state_size), jnp.float32)

    def scan_inputs(self, x_BTE):
        """`(Δ, A, B, C)` of the selective scan from the conv's output: Δ `[B, T, E]` and A
        `[E, N]` float32, B and C `[B, T, N]` in the compute dtype."""
        r, n = self.dt_rank, self.state_size
        dbc = self.x_proj(x_BTE)
        low_BTR, b_BTN, c_BTN = dbc[..., :r], dbc[..., r : r + n], dbc[..., r + n :]
        if self.bcdt_norm_eps is not None:
            low_BTR, b_BTN, c_BTN = (
                _unit_rms(t, self.bcdt_norm_eps) for t in (low_BTR, b_BTN, c_BTN)
            )
        delta_BTE = jax.nn.softplus(self.dt_proj(low_BTR.astype(jnp.float32)))
        a_EN = -jnp.exp(self.A_log[...].astype(jnp.float32))
        return delta_BTE, a_EN, b_BTN, c_BTN

    def _forward(self, x_BTD, tail, core, position, segments=None, *, step: bool = False):
        del position  # no positions
        x_BTE, z_BTE, tail = self.inputs(x_BTD, tail, segments)
        delta, a_EN, b, c = self.scan_inputs(x_BTE)
        d_E = self.D[...]
        if step:
            y_BE, core = K.selective_scan_step(
                x_BTE[:, 0], delta[:, 0], a_EN, b[:, 0], c[:, 0], d_E, core
            )
            y_BTE = y_BE[:, None]
        else:
            y_BTE, h_BEN = K.selective_scan(
                x_BTE, delta, a_EN, b, c, d_E,
                initial_state=core, segment_ids=segments, method=self.method,
                axis_name=sequence_axis(),
            )  # fmt: skip
            core = None if core is None else h_BEN
        return self.out_proj(y_BTE * jax.nn.silu(z_BTE)), core, tail


__all__ = ["MambaMixer", "dt_rank", "inverse_softplus_dt"]
