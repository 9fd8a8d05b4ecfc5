"""RWKV-7 "Goose" time mixing (`rwkv7`, Peng et al. 2025) on the DPLR delta rule.

Per token, with x_{t−1} from the token shift (zero at a document start) and one learned
interpolation per branch c ∈ {r, w, k, v, a, g}, x_c = x_t + (x_{t−1} − x_t) ⊙ μ_c:

    r = x_r W_r,  k = x_k W_k,  v = x_v W_v                         per head [H, K], [H, Dv]
    log γ = −e^(−½)·sigmoid(w₀ + tanh(x_w W₁) W₂)   per key channel, in (−0.61, 0)  (`RWKV7Decay`)
    a = sigmoid(a₀ + x_a A₁ A₂)                     the in-context learning rate, per channel
    κ̂ = l2norm(k ⊙ k_k)  per head                   the removal key
    k̃ = k ⊙ (1 + (a − 1) ⊙ k_a)                     the written key
    S_t = Diag(γ_t) S_{t−1} + (κ̂_t ⊙ a_t)(−κ̂_tᵀ S_{t−1}) + k̃_t v_tᵀ,    o_t = S_tᵀ r_t
    y = ((GroupNorm(o) + (Σ_K r ⊙ k̃ ⊙ r_k) v) ⊙ (sigmoid(x_g G₁) G₂)) W_o

The recurrence is `kernels.dplr_delta_rule` with a = −κ̂, b = κ̂ ⊙ a (chunked, or by `scan`)
and `dplr_delta_rule_step` for decoding; the state is `LinearAttentionState(kv [B, H, K, Dv],
k_sum=None)`, float32, plus the token shift's last input `[B, 1, D]`.

Parts: `projections.ShiftedInputs` (token shift and the six interpolations),
`decays.RWKV7Decay`, `projections.LowRank` for a, the delta family's `l2norm`, and the shared
`OutputStage` with a per-head LayerNorm (GroupNorm, eps 64e-5 as RWKV-7), the bonus added after
it and the low-rank gate with its sigmoid between the factors. `out_norm` / `out_gate` turn the
norm and the gate off; `conv` and `rope` are not taken (`NOT_TAKEN`: the token shift is this
mixer's local context and RWKV has no positions): the mixer refuses them, and in a hybrid model
they apply to the other layers only (`ModelConfig.mixer_options`).

Taken from RWKV-7 (BlinkDL's x070 time mix): all of the above, the LoRA ranks
(max(32, round(1.8·√D/32)·32) for w and a, max(32, round(0.6·D^0.8/32)·32) for g) and the
shapes of the inits: μ_c = 1 − (i/D)^(p_c/2) with p = (0.2, 0.9, 0.7, 0.7, 0.9, 0.2) for
(r, w, k, v, a, g), w₀ (`RWKV7Decay`), a₀ = 0, zero first factors and orthogonal × 0.1 second
factors, k_k = 0.85, k_a = 1, r_k = −0.04. Where it differs: RWKV-7 scales its inits by the
layer's depth (layer index / number of layers); a mixer does not know its depth, so every
layer takes a middle layer's. Not taken: the value residual (v mixed toward the first layer's
v: state that crosses layers, which the model's blocks do not pass), RWKV's channel mixing (the
project's MLP is used), and RWKV's initialisation of the r/k/v/output matrices (uniform ±0.5/√D,
±0.05/√D, zero output): they keep the project's defaults, as every other mixer.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention import kernels as K
from linear_attention.layers.base import Mixer
from linear_attention.layers.decays import RWKV7Decay
from linear_attention.layers.delta import l2norm
from linear_attention.layers.options import CHUNK_SIZE, CONV, METHOD, GatedOutputConfig
from linear_attention.layers.projections import LowRank, ShiftedInputs
from linear_attention.layers.sequence import sequence_axis

# RWKV-7's exponents of its token-shift inits, branches r, w, k, v, a, g:
# μ_c = 1 − (i/D)^(p_c · (1 − layer ratio))
SHIFT_POWERS = (0.2, 0.9, 0.7, 0.7, 0.9, 0.2)
LAYER_RATIO = 0.5  # a middle layer's init (see the module docstring)
GROUP_NORM_EPS = 64e-5  # RWKV-7's ln_x: 1e-5 · head_size_divisor² with divisor 8


def lora_rank(d_model: int, factor: float, power: float) -> int:
    """RWKV-7's bottleneck width: max(32, round(factor · d_model^power / 32) · 32)."""
    return max(32, int(round(factor * d_model**power / 32)) * 32)


@dataclasses.dataclass(frozen=True)
class RWKV7Config(GatedOutputConfig):
    conv: bool | int | None = CONV.field(False)
    method: str = METHOD.field(choices=K.DPLR.supported)
    chunk_size: int = CHUNK_SIZE.field()


class TokenShiftMixer(Mixer):
    """RWKV's frame (rwkv7, rwkv6): token-shifted inputs, one interpolation per branch with
    μ_c = 1 − (i/D)^(p_c·(1 − layer ratio)) at init (`SHIFT_POWERS` p), no conv, no positions,
    a `[B, H, K, Dv]` float32 state."""

    SEQUENCE_PARALLEL = True
    NOT_TAKEN = dict(conv="its local context is the token shift", rope="it has no positions")
    SHIFT_POWERS: ClassVar[tuple[float, ...]] = SHIFT_POWERS

    def _build_inputs(self, rngs: nnx.Rngs) -> nnx.Module:
        ratio_D = np.arange(self.d_model) / self.d_model
        mu = [1.0 - ratio_D ** (p * (1.0 - LAYER_RATIO)) for p in self.SHIFT_POWERS]
        return ShiftedInputs(self.d_model, np.stack(mu), param_dtype=self.param_dtype)

    def _init_core(self, batch_size: int, max_length: int) -> K.LinearAttentionState:
        del max_length  # the state does not grow with the context
        shape = (batch_size, self.num_heads, self.qk_dim, self.head_dim)
        return K.LinearAttentionState(kv=jnp.zeros(shape, jnp.float32), k_sum=None)


class RWKV7Mixer(TokenShiftMixer):
    """RWKV-7 time mixing: token shift, per-channel decay, in-context rate, DPLR state."""

    NAME = "rwkv7"
    FAMILY = K.DPLR
    OPTIONS = RWKV7Config

    def _output_options(self) -> dict:
        return dict(
            gate_activation="sigmoid",
            gate_rank=lora_rank(self.d_model, 0.6, 0.8),
            gate_inside=True,
            norm_type="layer",
            norm_eps=GROUP_NORM_EPS,
        )

    def _build(self, rngs) -> None:
        opts = self.options
        self.method, self.chunk_size = opts["method"], opts["chunk_size"]
        h, dk, dv = self.num_heads, self.qk_dim, self.head_dim
        lin = dict(use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, rngs=rngs)
        self.receptance = nnx.Linear(self.d_model, h * dk, **lin)
        self.key = nnx.Linear(self.d_model, h * dk, **lin)
        self.value = nnx.Linear(self.d_model, h * dv, **lin)
        rank = lora_rank(self.d_model, 1.8, 0.5)
        self.decay = RWKV7Decay(
            self.d_model, h, dk, rank=rank, param_dtype=self.param_dtype, rngs=rngs
        )
        self.rate = LowRank(
            self.d_model,
            h * dk,
            rank,
            bias=jnp.zeros(h * dk),
            param_dtype=self.param_dtype,
            rngs=rngs,
        )
        full = lambda value: nnx.Param(jnp.full((h, dk), value, self.param_dtype))  # noqa: E731
        self.k_k, self.k_a, self.r_k = full(0.85), full(1.0), full(-0.04)

    def dplr_inputs(self, x_BTD, tail, segments=None):
        """The kernel's inputs and the rest of the output's: `(r, k̃, v, a, b, log γ, x_g, new
        tail)`, with r, k̃, v `[B, T, H, ·]` in the compute dtype and a = −κ̂, b = κ̂ ⊙ a and
        log γ `[B, T, H, K]` float32."""
        b, t, _ = x_BTD.shape
        h, dk, dv = self.num_heads, self.qk_dim, self.head_dim
        (x_r, x_w, x_k, x_v, x_a, x_g), tail = self.inputs(x_BTD, tail, segments)
        r = self.receptance(x_r).reshape(b, t, h, dk)
        k32 = self.key(x_k).reshape(b, t, h, dk).astype(jnp.float32)
        v = self.value(x_v).reshape(b, t, h, dv)
        rate = jax.nn.sigmoid(self.rate(x_a)).reshape(b, t, h, dk)  # float32
        kappa = l2norm(k32 * self.k_k[...].astype(jnp.float32))
        k_written = k32 * (1.0 + (rate - 1.0) * self.k_a[...].astype(jnp.float32))
        log_decay = self.decay(x_w)
        return r, k_written.astype(r.dtype), v, -kappa, kappa * rate, log_decay, x_g, tail

    def bonus(self, r, k, v):
        """RWKV-7's current-token term (Σ_K r ⊙ k̃ ⊙ r_k) v per head, float32 `[B, T, H, Dv]`."""
        r_k = self.r_k[...].astype(jnp.float32)
        weight = jnp.sum(r.astype(jnp.float32) * k.astype(jnp.float32) * r_k, -1, keepdims=True)
        return weight * v.astype(jnp.float32)

    def _forward(self, x_BTD, tail, core, position, segments=None, *, step: bool = False):
        del position  # no positions
        r, k, v, a, b, log_decay, x_g, tail = self.dplr_inputs(x_BTD, tail, segments)
        if step:
            first = lambda z: z[:, 0]  # noqa: E731
            o, core = K.dplr_delta_rule_step(
                core, *map(first, (r, k, v, a, b)), log_decay=log_decay[:, 0]
            )
            o = o[:, None]
        else:
            options = dict(
                log_decay=log_decay,
                method=self.method,
                chunk_size=self.chunk_size,
                segment_ids=segments,
                axis_name=sequence_axis(),
            )
            if core is None:
                o = K.dplr_delta_rule(r, k, v, a, b, **options)
            else:
                o, core = K.dplr_delta_rule(
                    r, k, v, a, b, initial_state=core, return_state=True, **options
                )
        return self.output(x_g, o, self.bonus(r, k, v)), core, tail


__all__ = ["RWKV7Mixer", "TokenShiftMixer", "lora_rank"]
