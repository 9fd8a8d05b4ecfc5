"""The linear-attention mixers: one base class; the families differ only in φ, decay, norm, gate.

    S_t = γ_t S_{t−1} + φ(k_t) v_tᵀ,    z_t = γ_t z_{t−1} + φ(k_t)
    o_t = φ(q_t)ᵀ S_t / (φ(q_t)ᵀ z_t + eps)     (retnet, gated, gla: no denominator)

| name       | φ                                      | γ_t (decay)                  | norm+gate |
| ---------- | -------------------------------------- | ---------------------------- | --------- |
| `linear`   | fixed map (`elu_plus_one` default)¹    | 1                            | no        |
| `favor`    | FAVOR+ random features (redrawable)    | 1                            | no        |
| `taylor`   | `taylor2` of q, k projected to 16 dims | 1                            | no        |
| `hedgehog` | learned `[softmax(xW), softmax(−xW)]`  | 1                            | no        |
| `retnet`   | identity (k scaled by Dk^-½)           | fixed γ_h = 1 − 2^(−5−h)     | yes       |
| `gated`    | identity (k scaled by Dk^-½)           | exp(−softplus(x·w_h+b_h)e^A) | yes       |
| `gla`      | identity (k scaled by Dk^-½)           | σ(x W₁W₂ + b)^(1/16), vector | yes       |

¹ of `feature_scale`·q and `feature_scale`·k (default 1; Zoology's `temp`): elu+1 is not
scale-invariant, and at the scale of q, k at init (std ~0.3) it is ≈ 1 + x, so φ(q)·φ(k) ≈
Dk + Σq + Σk + q·k is nearly constant and attention nearly uniform (EXPERIMENTS.md, section 1).

(`norm+gate` are defaults; `out_norm` / `out_gate` override them. `gla`'s decay is a vector,
one per key dimension: `S_t = diag(γ_t) S_{t−1} + φ(k_t) v_tᵀ`, a rank-4 `[B, T, H, M]` log
decay for the kernels.) The whole-sequence paths call `kernels.causal_linear_attention` with
`method` / `chunk_size`; `step` calls `kernels.recurrent_step`. The state
`LinearAttentionState(kv [B,H,M,Dv], k_sum [B,H,M])` is float32 and its size does not depend on
the context length.
"""

from __future__ import annotations

import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention import kernels as K
from linear_attention.layers.base import AttentionInputs, Mixer, _check_int, _check_method
from linear_attention.layers.feature_maps import (
    FIXED_FEATURE_MAPS,
    FavorFeatures,
    FixedFeatureMap,
    HedgehogFeatures,
)
from linear_attention.layers.sequence import sequence_axis


class LinearMixer(Mixer):
    """Base of the linear-attention family (and the `linear` mixer itself: a fixed feature map).

    `feature_scale` c (the `linear` mixer only): φ(c·q), φ(c·k) instead of φ(q), φ(k).

    Subclass knobs: `NORMALIZE` (divide by φ(q)ᵀz), `K_SCALE` (scale k by Dk^-½ before φ),
    `FEATURE_MAPS` / `DEFAULT_FEATURE_MAP` (for a fixed φ), `_build_feature_map`, `_log_decay`.
    """

    NAME = "linear"
    SEQUENCE_PARALLEL = True
    USES = frozenset({"feature_map", "feature_scale", "method", "chunk_size", "eps"})
    NORMALIZE: ClassVar[bool] = True
    K_SCALE: ClassVar[bool] = False
    FEATURE_MAPS: ClassVar[tuple[str, ...]] = FIXED_FEATURE_MAPS
    DEFAULT_FEATURE_MAP: ClassVar[str] = "elu_plus_one"
    DEFAULT_FEATURE_DIM: ClassVar[int | None] = None

    @classmethod
    def _check_family_options(
        cls, *, feature_map, feature_dim, feature_scale, method, chunk_size, eps
    ) -> None:
        if feature_map is not None and feature_map not in cls.FEATURE_MAPS:
            raise ValueError(
                f"unknown feature_map {feature_map!r} for mixer {cls.NAME!r}; allowed: "
                f"{', '.join(cls.FEATURE_MAPS)}"
            )
        if feature_dim is not None:
            _check_int("feature_dim", feature_dim)
        if feature_scale is not None and not (
            isinstance(feature_scale, int | float)
            and not isinstance(feature_scale, bool)
            and math.isfinite(feature_scale)
            and feature_scale > 0
        ):
            raise ValueError(f"feature_scale must be a finite number > 0, got {feature_scale!r}")
        _check_method(cls.NAME, method, K.METHODS)
        if chunk_size is not None:
            _check_int("chunk_size", chunk_size)
        if eps is not None and not (isinstance(eps, int | float) and eps > 0):
            raise ValueError(f"eps must be a number > 0, got {eps!r}")

    def _build(
        self, *, rngs, feature_map, feature_dim, feature_scale, method, chunk_size, eps
    ) -> None:
        self.method = method or "chunk"
        self.feature_scale = 1.0 if feature_scale is None else float(feature_scale)
        self.chunk_size = chunk_size or 64
        self.eps = 1e-6 if eps is None else float(eps)
        self.feature_map = self._build_feature_map(
            feature_map or self.DEFAULT_FEATURE_MAP,
            feature_dim or self.DEFAULT_FEATURE_DIM,
            rngs=rngs,
        )
        self._build_decay(rngs=rngs)

    def _build_feature_map(self, name, feature_dim, *, rngs) -> nnx.Module:
        return FixedFeatureMap(name, self.qk_dim)

    def _build_decay(self, *, rngs) -> None:
        """Subclass hook: create decay parameters."""

    def _log_decay(self, x_BTD: jax.Array) -> jax.Array | None:
        """log γ (≤ 0, float32): None (no decay), `[H]` (fixed) or `[B, T, H]` (per token)."""
        return None

    @property
    def state_feature_dim(self) -> int:
        """M, the width of φ(q), φ(k) and the first state axis."""
        return self.feature_map.feature_dim

    def _featurize(self, q, k):
        if self.feature_scale != 1.0:
            q = q * jnp.asarray(self.feature_scale, q.dtype)
            k = k * jnp.asarray(self.feature_scale, k.dtype)
        if self.K_SCALE:
            k = k * jnp.asarray(self.qk_dim**-0.5, k.dtype)
        return self.feature_map(q, is_query=True), self.feature_map(k, is_query=False)

    def _attention_inputs(self, x_BTD, q_BTHK, k_BTHK, v_BTHD):
        phi_q_BTHM, phi_k_BTHM = self._featurize(q_BTHK, k_BTHK)
        log_decay = self._log_decay(x_BTD)
        if log_decay is not None:  # [H] (fixed) or [B, T, H] -> [B, T, H]; [B, T, H, M] as is
            b, t, h = q_BTHK.shape[:3]
            shape = (b, t, h) if log_decay.ndim < 4 else (b, t, h, log_decay.shape[-1])
            log_decay = jnp.broadcast_to(log_decay, shape)
        return AttentionInputs(phi_q_BTHM, phi_k_BTHM, v_BTHD, log_decay)

    def _kernel_options(self) -> dict:
        options = dict(normalize=self.NORMALIZE)
        if self.NORMALIZE:
            options["eps"] = self.eps
        return options

    def _init_core(self, batch_size: int, max_length: int) -> K.LinearAttentionState:
        del max_length  # the state does not grow with the context
        return K.LinearAttentionState.zeros(
            batch_size, self.num_heads, self.state_feature_dim, self.head_dim
        )

    def _mix(self, x_BTD, q_BTHK, k_BTHK, v_BTHD, core, position, segment_ids=None):
        del position
        phi_q_BTHM, phi_k_BTHM = self._featurize(q_BTHK, k_BTHK)
        options = dict(
            log_decay=self._log_decay(x_BTD),
            method=self.method,
            chunk_size=self.chunk_size,
            axis_name=sequence_axis(),
            **self._kernel_options(),
        )
        if segment_ids is not None:
            options["segment_ids"] = segment_ids
        if core is None:
            return K.causal_linear_attention(phi_q_BTHM, phi_k_BTHM, v_BTHD, **options), None
        return K.causal_linear_attention(
            phi_q_BTHM, phi_k_BTHM, v_BTHD, initial_state=core, return_state=True, **options
        )

    def _mix_step(self, x_BD, q_BHK, k_BHK, v_BHD, core, position):
        del position
        phi_q_BHM, phi_k_BHM = self._featurize(q_BHK, k_BHK)
        log_decay = self._log_decay(x_BD[:, None])
        if log_decay is not None and log_decay.ndim >= 3:
            log_decay = log_decay[:, 0]  # [B, 1, H(, M)] -> [B, H(, M)]
        return K.recurrent_step(
            core, phi_q_BHM, phi_k_BHM, v_BHD, log_decay=log_decay, **self._kernel_options()
        )


class FavorMixer(LinearMixer):
    """Performer FAVOR+: positive orthogonal random features (`feature_dim` of them, default 64),
    redrawn by `redraw(key)` (training calls it every `redraw_interval` steps)."""

    NAME = "favor"
    USES = frozenset({"feature_dim", "method", "chunk_size", "eps"})
    FEATURE_MAPS = ()
    DEFAULT_FEATURE_DIM = 64

    def _build_feature_map(self, name, feature_dim, *, rngs):
        return FavorFeatures(self.qk_dim, feature_dim, rngs=rngs)

    def redraw(self, key: jax.Array) -> None:
        """Draw a new random projection from `key`."""
        self.feature_map.redraw(key)


class TaylorMixer(LinearMixer):
    """Based: q, k projected to `feature_dim` d (default 16) per head, then the 2nd-order Taylor
    feature map `[1, x/c₁, upper triangle of (x⊗x)/c₂]` (`kernels.feature_maps.taylor2`):
    M = 1 + d + d(d+1)/2 (153 at d = 16); normalized."""

    NAME = "taylor"
    USES = frozenset({"feature_dim", "method", "chunk_size", "eps"})
    FEATURE_MAPS = ()
    DEFAULT_FEATURE_MAP = "taylor2"
    DEFAULT_FEATURE_DIM = 16

    @classmethod
    def _qk_dim(cls, head_dim, feature_dim):
        return feature_dim or cls.DEFAULT_FEATURE_DIM


class HedgehogMixer(LinearMixer):
    """Hedgehog: learnable per-head feature map `[softmax(xW), softmax(−xW)]`, `W: [Dk, F]`
    (F = `feature_dim`, default Dk); normalized."""

    NAME = "hedgehog"
    USES = frozenset({"feature_dim", "method", "chunk_size", "eps"})
    FEATURE_MAPS = ()

    def _build_feature_map(self, name, feature_dim, *, rngs):
        return HedgehogFeatures(
            self.num_heads,
            self.qk_dim,
            feature_dim or self.qk_dim,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )


class RetNetMixer(LinearMixer):
    """Retention: fixed multi-scale decay γ_h = 1 − 2^(−5−h) per head h = 0..H−1, no
    denominator, per-head RMSNorm of the output and a swish output gate."""

    NAME = "retnet"
    USES = frozenset({"feature_map", "method", "chunk_size"})
    NORMALIZE = False
    K_SCALE = True
    DEFAULT_FEATURE_MAP = "identity"
    DEFAULT_OUT_NORM = True
    DEFAULT_OUT_GATE = True

    def _log_decay(self, x_BTD):
        gamma_H = 1.0 - 2.0 ** (-5.0 - jnp.arange(self.num_heads, dtype=jnp.float32))
        return jnp.log(gamma_H)


class GatedMixer(LinearMixer):
    """Data-dependent scalar decay per head and token (Mamba-2 / simple gated linear attention):

        log γ_{t,h} = −softplus(x_t · w_h + b_h) · exp(A_h)

    with `A_h ~ U[1, 16]` and `softplus(b_h) ~ logU[1e-3, 1e-1]` at init (as Mamba-2); no
    denominator, per-head RMSNorm and swish output gate."""

    NAME = "gated"
    USES = frozenset({"feature_map", "method", "chunk_size"})
    NORMALIZE = False
    K_SCALE = True
    DEFAULT_FEATURE_MAP = "identity"
    DEFAULT_OUT_NORM = True
    DEFAULT_OUT_GATE = True

    def _build_decay(self, *, rngs):
        h = self.num_heads
        # decays are float32 end to end: the projection computes in float32 whatever `dtype`
        self.decay_proj = nnx.Linear(
            self.d_model,
            h,
            use_bias=False,
            dtype=jnp.float32,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )
        a_H = jax.random.uniform(rngs.params(), (h,), jnp.float32, 1.0, 16.0)
        dt_H = jnp.exp(
            jax.random.uniform(rngs.params(), (h,), jnp.float32, jnp.log(1e-3), jnp.log(1e-1))
        )
        self.a_log = nnx.Param(jnp.log(a_H).astype(self.param_dtype))
        # inverse softplus, so that softplus(dt_bias) = dt at init
        self.dt_bias = nnx.Param((dt_H + jnp.log(-jnp.expm1(-dt_H))).astype(self.param_dtype))

    def _log_decay(self, x_BTD):
        z_BTH = self.decay_proj(x_BTD).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        return -jax.nn.softplus(z_BTH) * jnp.exp(self.a_log[...].astype(jnp.float32))


class GLAMixer(LinearMixer):
    """Gated linear attention (GLA, Yang et al. 2023): a data-dependent decay per key dimension
    from a low-rank gate projection,

        log γ_t = logsigmoid(x_t W₁ W₂ + b) / τ        W₁: [d_model, 16], W₂: [16, H·Dk], τ = 16
        S_t = diag(γ_t) S_{t−1} + k_t v_tᵀ,    o_t = S_tᵀ q_t         (q·k scaled by Dk^-½)

    no denominator, per-head RMSNorm of the output and a swish output gate (as published; q, k
    and v share `head_dim` here, where the paper halves the key width)."""

    NAME = "gla"
    USES = frozenset({"method", "chunk_size"})
    NORMALIZE = False
    K_SCALE = True
    DEFAULT_FEATURE_MAP = "identity"
    DEFAULT_OUT_NORM = True
    DEFAULT_OUT_GATE = True
    GATE_RANK: ClassVar[int] = 16
    GATE_TEMPERATURE: ClassVar[float] = 16.0  # τ: keeps γ near 1 (long memory) at init

    def _build_decay(self, *, rngs):
        # float32 end to end (decays), whatever the compute dtype
        lin = dict(dtype=jnp.float32, param_dtype=self.param_dtype, rngs=rngs)
        self.gate_down = nnx.Linear(self.d_model, self.GATE_RANK, use_bias=False, **lin)
        self.gate_up = nnx.Linear(self.GATE_RANK, self.num_heads * self.qk_dim, **lin)

    def _log_decay(self, x_BTD):
        b, t, _ = x_BTD.shape
        z_BTF = self.gate_up(self.gate_down(x_BTD.astype(jnp.float32)))
        log_gamma_BTF = jax.nn.log_sigmoid(z_BTF) / self.GATE_TEMPERATURE
        return log_gamma_BTF.reshape(b, t, self.num_heads, self.qk_dim)  # [B, T, H, M]
