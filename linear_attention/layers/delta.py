"""The delta-rule mixers: DeltaNet and Gated DeltaNet.

    q, k, v = silu(conv(x W_qkv))                 (the conv's SiLU; applied directly without conv)
    q ← l2norm(q) · Dk^-½,  k ← l2norm(k)         per head, in float32
    β_t = sigmoid(x_t W_β)  per head              (2·sigmoid with `allow_neg_eigval`)
    S_t = γ_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,    o_t = S_tᵀ q_t
    y   = (RMSNorm(o) ⊙ silu(x W_g)) W_o

| name             | γ_t (decay)                                        | conv | norm+gate |
| ---------------- | -------------------------------------------------- | ---- | --------- |
| `deltanet`       | 1                                                  | yes  | yes       |
| `gated_deltanet` | exp(−softplus(x·w_h + b_h) e^A_h), as the `gated` mixer | yes  | yes       |

(defaults; `conv`, `out_norm`, `out_gate` override them; `out_norm_eps` is the RMSNorm's eps.)
In `gated_deltanet` (and `kda`) the q/k width Dk is `state_dim` (None: head_dim, the value width
Dv): OLMo Hybrid's Gated DeltaNet has values twice as wide as its keys. The sequence paths call
`kernels.delta_rule` (`method` "chunk" or "scan", `chunk_size`), `step` calls
`kernels.delta_rule_step`; the state is `LinearAttentionState(kv [B, H, Dk, Dv], k_sum=None)`,
float32, whatever the context length.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention import kernels as K
from linear_attention.layers.base import Mixer
from linear_attention.layers.decays import ScalarDecay, per_token
from linear_attention.layers.options import (
    ALLOW_NEG_EIGVAL,
    CHUNK_SIZE,
    CONV,
    CONV_BIAS,
    METHOD,
    NUM_VALUE_HEADS,
    OUT_NORM_EPS,
    OUT_NORM_SHARED,
    STATE_DIM,
    GatedOutputConfig,
)
from linear_attention.layers.sequence import sequence_axis

L2_EPS = 1e-6  # inside the square root of the q/k L2 norm


@dataclasses.dataclass(frozen=True)
class DeltaConfig(GatedOutputConfig):
    """The delta-rule family: the short conv, the output norm and gate on; β's range."""

    conv: bool | int | None = CONV.field(True)
    method: str = METHOD.field(choices=K.DELTA_RULE.supported)
    chunk_size: int = CHUNK_SIZE.field()
    allow_neg_eigval: bool = ALLOW_NEG_EIGVAL.field()
    conv_bias: bool = CONV_BIAS.field()
    out_norm_shared: bool = OUT_NORM_SHARED.field()
    out_norm_eps: float = OUT_NORM_EPS.field()


@dataclasses.dataclass(frozen=True)
class GroupedDeltaConfig(DeltaConfig):
    """A delta rule with grouped value heads, and keys narrower or wider than the values."""

    num_value_heads: int | None = NUM_VALUE_HEADS.field()
    state_dim: int | None = STATE_DIM.field()


def l2norm(x):
    """x / sqrt(Σx² + L2_EPS) over the last axis, in float32."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + L2_EPS)


class DeltaNetMixer(Mixer):
    """The delta-rule family, and DeltaNet itself: β = sigmoid(x W_β) per head, no decay.

    Parts: the q/k/v projection with the short conv (on by default), L2-normalised q and k, a
    β gate, a decay part (`DECAY`, None for none), the kernel `delta_rule` / `delta_rule_step`,
    per-head norm and output gate. Grouped value heads (`num_value_heads` HV, where a mixer
    declares it): v, β, the decay and the state have HV heads, value head j reads q/k head
    j // (HV / H).
    """

    NAME = "deltanet"
    FAMILY = K.DELTA_RULE
    SEQUENCE_PARALLEL = True
    OPTIONS = DeltaConfig
    DECAY: ClassVar[type | None] = None
    KERNEL = staticmethod(K.delta_rule)
    KERNEL_STEP = staticmethod(K.delta_rule_step)

    @classmethod
    def _check_family_options(cls, num_heads, options) -> None:
        cls._check_conv_and_norm(options)
        hv = options.get("num_value_heads")
        if hv is not None and hv % num_heads:
            raise ValueError(
                f"num_value_heads={hv} must be a multiple of num_heads={num_heads} "
                f"(mixer {cls.NAME!r})"
            )

    @classmethod
    def _check_conv_and_norm(cls, options) -> None:
        """conv_bias=False and out_norm_shared=True change parts that must be on."""
        if not options["conv_bias"] and not options["conv"]:
            raise ValueError(f"conv_bias=False needs the short conv on (mixer {cls.NAME!r})")
        if options["out_norm_shared"] and not options["out_norm"]:
            raise ValueError(f"out_norm_shared=True needs out_norm on (mixer {cls.NAME!r})")

    @classmethod
    def _qk_dim(cls, head_dim, options):
        return options.get("state_dim") or head_dim

    def _input_options(self) -> dict:
        return dict(conv_bias=self.options["conv_bias"])

    def _output_options(self) -> dict:
        opts = self.options
        return dict(norm_shared=opts["out_norm_shared"], norm_eps=opts["out_norm_eps"])

    def _build(self, rngs) -> None:
        opts = self.options
        self.method = opts["method"]
        self.chunk_size = opts["chunk_size"]
        self.allow_neg_eigval = opts["allow_neg_eigval"]
        self.conv_silu = self.inputs.conv is not None  # the conv applies the SiLU itself
        # β is a gate: float32 whatever `dtype`
        lin = dict(use_bias=False, dtype=jnp.float32, param_dtype=self.param_dtype, rngs=rngs)
        width = self.num_value_heads * (self._num_keys() or 1)  # one β per value head and key
        self.beta_proj = nnx.Linear(self.d_model, width, **lin)
        self.decay = self._build_decay(rngs)

    def _build_decay(self, rngs):
        if self.DECAY is None:
            return None
        return self.DECAY(
            self.d_model,
            self.num_value_heads,
            self.qk_dim,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )

    def _log_decay(self, x_BTD):
        """log γ `[B, T, HV]` or `[B, T, HV, K]` (≤ 0, float32), or None (no decay)."""
        return None if self.decay is None else self.decay(x_BTD)

    def beta(self, x_BTD):
        """β `[..., HV]` float32: sigmoid(x W_β), or 2·sigmoid with `allow_neg_eigval`."""
        beta_BTH = jax.nn.sigmoid(self.beta_proj(x_BTD).astype(jnp.float32))
        return 2.0 * beta_BTH if self.allow_neg_eigval else beta_BTH

    def prepare(self, q, k, v):
        """The q, k, v the kernel receives, from the input part's: SiLU (unless the conv
        applied it), q L2-normalised and scaled by Dk^-½, k L2-normalised (unit keys)."""
        if not self.conv_silu:
            q, k, v = jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
        dtype = v.dtype
        q = (l2norm(q) * self.qk_dim**-0.5).astype(dtype)
        return q, l2norm(k).astype(dtype), v

    def _init_core(self, batch_size: int, max_length: int) -> K.LinearAttentionState:
        del max_length  # the state does not grow with the context
        shape = (batch_size, self.num_value_heads, self.qk_dim, self.head_dim)
        return K.LinearAttentionState(kv=jnp.zeros(shape, jnp.float32), k_sum=None)

    def write_keys(self, x_BTD):
        q_BTHK, k_BTHK, v_BTHD, _ = self.inputs(x_BTD, None, 0)
        _, k_BTHK, _ = self.prepare(q_BTHK, k_BTHK, v_BTHD)
        return k_BTHK.astype(jnp.float32)

    def _mix(self, x_BTD, q_BTHK, k_BTHK, v_BTHD, core, position, segments=None):
        del position
        q, k, v = self.prepare(q_BTHK, k_BTHK, v_BTHD)
        options = dict(
            log_decay=self._log_decay(x_BTD),
            method=self.method,
            chunk_size=self.chunk_size,
            segment_ids=segments,  # checked once per model call: the kernel reads it as is
            axis_name=sequence_axis(),
        )
        beta = self.beta(x_BTD)
        if core is None:
            return self.KERNEL(q, k, v, beta, **options), None
        return self.KERNEL(q, k, v, beta, initial_state=core, return_state=True, **options)

    def _mix_step(self, x_BD, q_BHK, k_BHK, v_BHD, core, position):
        del position
        q, k, v = self.prepare(q_BHK, k_BHK, v_BHD)
        log_decay = per_token(self._log_decay(x_BD[:, None]))
        return self.KERNEL_STEP(core, q, k, v, self.beta(x_BD), log_decay=log_decay)


class GatedDeltaNetMixer(DeltaNetMixer):
    """Gated DeltaNet: DeltaNet with the `gated` mixer's decay part (`decays.ScalarDecay`),
    log γ_{t,h} = −softplus(x_t·w_h + b_h)·exp(A_h), Mamba-2 init (A_h ~ U[1, 16],
    softplus(b_h) ~ logU[1e-3, 1e-1])."""

    NAME = "gated_deltanet"
    OPTIONS = GroupedDeltaConfig
    DECAY = ScalarDecay
