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

(defaults; `conv`, `out_norm`, `out_gate` override them.) The sequence paths call
`kernels.delta_rule` (`method` "chunk" or "scan", `chunk_size`), `step` calls
`kernels.delta_rule_step`; the state is `LinearAttentionState(kv [B, H, Dk, Dv], k_sum=None)`,
float32, whatever the context length.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention import kernels as K
from linear_attention.layers.base import Mixer, _check_int, _check_method
from linear_attention.layers.linear import GatedMixer
from linear_attention.layers.sequence import sequence_axis

L2_EPS = 1e-6  # inside the square root of the q/k L2 norm


def _l2norm(x):
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + L2_EPS)


class DeltaNetMixer(Mixer):
    """DeltaNet: the delta rule with β = sigmoid(x W_β) per head, no decay."""

    NAME = "deltanet"
    SEQUENCE_PARALLEL = True
    USES = frozenset({"method", "chunk_size", "allow_neg_eigval"})
    DEFAULT_OUT_NORM = True
    DEFAULT_OUT_GATE = True
    DEFAULT_CONV: ClassVar[bool | int] = True

    def __init__(self, d_model: int, num_heads: int, *, conv=None, allow_neg_eigval=False, **kw):
        """As `Mixer`, plus `allow_neg_eigval` (β = 2·sigmoid, in (0, 2)); `conv=None` means on
        (kernel 4)."""
        self._check_neg_eigval(allow_neg_eigval)
        self.allow_neg_eigval = bool(allow_neg_eigval)
        conv = self.DEFAULT_CONV if conv is None else conv
        super().__init__(d_model, num_heads, conv=conv, **kw)

    @staticmethod
    def _check_neg_eigval(value) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"allow_neg_eigval must be a bool, got {value!r}")

    @classmethod
    def check_options(cls, d_model, num_heads, *, allow_neg_eigval=False, **options) -> None:
        cls._check_neg_eigval(allow_neg_eigval)
        super().check_options(d_model, num_heads, **options)

    @classmethod
    def _check_family_options(cls, *, method, chunk_size, **_) -> None:
        _check_method(cls.NAME, method, K.DELTA_METHODS)
        if chunk_size is not None:
            _check_int("chunk_size", chunk_size)

    def _build(self, *, rngs, method, chunk_size, **_) -> None:
        self.method = method or "chunk"
        self.chunk_size = chunk_size or 64
        self.conv_silu = self.conv is not None  # the conv applies the SiLU itself
        # β is a gate: float32 whatever `dtype`
        lin = dict(use_bias=False, dtype=jnp.float32, param_dtype=self.param_dtype, rngs=rngs)
        self.beta_proj = nnx.Linear(self.d_model, self.num_heads, **lin)
        self._build_decay(rngs=rngs)

    def _build_decay(self, *, rngs) -> None:
        """Subclass hook: create decay parameters."""

    def _log_decay(self, x_BTD):
        """log γ `[B, T, H]` (≤ 0, float32), or None (no decay)."""
        return None

    def _beta(self, x_BTD):
        beta_BTH = jax.nn.sigmoid(self.beta_proj(x_BTD).astype(jnp.float32))
        return 2.0 * beta_BTH if self.allow_neg_eigval else beta_BTH

    def _prepare(self, q, k, v):
        if not self.conv_silu:
            q, k, v = jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
        dtype = v.dtype
        q = (_l2norm(q) * self.qk_dim**-0.5).astype(dtype)
        return q, _l2norm(k).astype(dtype), v

    def _init_core(self, batch_size: int, max_length: int) -> K.LinearAttentionState:
        del max_length  # the state does not grow with the context
        kv = jnp.zeros((batch_size, self.num_heads, self.qk_dim, self.head_dim), jnp.float32)
        return K.LinearAttentionState(kv=kv, k_sum=None)

    def _mix(self, x_BTD, q_BTHK, k_BTHK, v_BTHD, core, position, segment_ids=None):
        del position
        q, k, v = self._prepare(q_BTHK, k_BTHK, v_BTHD)
        options = dict(
            log_decay=self._log_decay(x_BTD),
            method=self.method,
            chunk_size=self.chunk_size,
            segment_ids=segment_ids,
            axis_name=sequence_axis(),
        )
        beta = self._beta(x_BTD)
        if core is None:
            return K.delta_rule(q, k, v, beta, **options), None
        return K.delta_rule(q, k, v, beta, initial_state=core, return_state=True, **options)

    def _mix_step(self, x_BD, q_BHK, k_BHK, v_BHD, core, position):
        del position
        q, k, v = self._prepare(q_BHK, k_BHK, v_BHD)
        log_decay = self._log_decay(x_BD[:, None])
        log_decay = None if log_decay is None else log_decay[:, 0]  # [B, 1, H] -> [B, H]
        return K.delta_rule_step(core, q, k, v, self._beta(x_BD), log_decay=log_decay)

    def _attention_inputs(self, x_BTD, q_BTHK, k_BTHK, v_BTHD):
        raise ValueError(
            f"mixer {self.NAME!r} has no attention_inputs: the delta rule's output is not a "
            "decayed sum of (q·k) v over past tokens"
        )


class GatedDeltaNetMixer(DeltaNetMixer):
    """Gated DeltaNet: DeltaNet with the `gated` mixer's data-dependent decay per head,
    log γ_{t,h} = −softplus(x_t·w_h + b_h)·exp(A_h), Mamba-2 init (A_h ~ U[1, 16],
    softplus(b_h) ~ logU[1e-3, 1e-1])."""

    NAME = "gated_deltanet"
    # the same parameters and formula as the `gated` mixer
    _build_decay = GatedMixer._build_decay
    _log_decay = GatedMixer._log_decay
