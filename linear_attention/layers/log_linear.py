"""Log-linear attention mixers (Guo et al. 2025): `kernels.log_linear_attention`, a Fenwick tree
of O(log T) level states per head, each read with a data-dependent weight λ_t^ℓ; and
`log_linear_gated_deltanet` (`LogLinearGatedDeltaNetMixer` below: Gated DeltaNet's parts,
every level a delta-rule state, `kernels.log_linear_delta_rule`).

    q, k, v = (conv(x W_qkv)),  k ← k · Dk^-½                  (as the `gated` mixer)
    log γ_t = −softplus(x_t·w_h + b_h) · exp(A_h)              (`decays.ScalarDecay`, Mamba-2)
    λ_t^ℓ   = softplus(s_{h,ℓ} · (x_t W_λ + b_λ)_{h,ℓ})        ℓ = 0..L − 1 (`LevelWeights`)
    o_t     = Σ_{j ≤ t} λ_t^{ℓ(t,j)} exp(Σ_{j<u≤t} log γ_u) (q_t·k_j) v_j,   ℓ(t, j) = |t ⊕ j|₂
    y       = (RMSNorm(o) ⊙ silu(x W_g)) W_o

(|n|₂: the bit length of n.) `log_linear_mamba2` is Mamba-2's layer as the `gated` mixer has
it (identity features, the scalar decay per head, per-head norm and output gate) plus the
projection to the L = `num_levels` level weights of FLA's `LogLinearMamba2` (a linear map of
x per head and level, scaled by a learned s_{h,ℓ} that starts at 1, through softplus; FLA's
default L = 15 covers 16,384 positions). With every λ = 1 it is the `gated` mixer.

The whole-sequence paths call the kernel (`method`, `chunk_size`); `step` calls
`log_linear_attention_step`. The decoding state is a `LogLinearState`: the level states
`[B, H, L, Dk, Dv]` float32 (L matrices per head, O(log T)) and their position; a prefill from a
state reads it and returns the next one in parallel. A sequence must stay below position
2^(L−1): the kernel refuses a longer row, `init_state` a longer `max_length`, a prefill or step
a state that would pass it (when the state's position is concrete: eagerly; under `jit` the
outputs past it are NaN, as the kernel's), and `ModelConfig` a `max_length` that `num_levels`
does not cover. Packed rows start
a new sequence (empty levels, positions from 0) at each document start. `log_linear_mamba2`
splits time (`mesh.seq > 1`: the kernel's position prefix and level-state combine); the delta
variant does not.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention import kernels as K
from linear_attention.kernels.log_linear.fenwick import capacity
from linear_attention.layers.base import Mixer
from linear_attention.layers.decays import ScalarDecay, per_token
from linear_attention.layers.delta import DeltaConfig, GatedDeltaNetMixer
from linear_attention.layers.options import (
    CHUNK_SIZE,
    METHOD,
    NUM_LEVELS,
    GatedOutputConfig,
)
from linear_attention.layers.sequence import sequence_axis


@dataclasses.dataclass(frozen=True)
class LogLinearConfig(GatedOutputConfig):
    """The output norm and gate on (as `gated`); the kernel's method, chunk and levels."""

    method: str = METHOD.field(choices=K.LOG_LINEAR.supported)
    chunk_size: int = CHUNK_SIZE.field()
    num_levels: int = NUM_LEVELS.field()


def check_room(num_levels: int, position, new: int) -> None:
    """Raise when `new` tokens after `position` (the state's, when concrete) pass the positions
    `num_levels` levels cover."""
    if isinstance(position, jax.core.Tracer):
        return
    end = int(position) + new
    if end > capacity(num_levels):
        raise ValueError(
            f"cannot take {new} token(s) after position {int(position)}: num_levels="
            f"{num_levels} covers positions below 2^(num_levels-1) = {capacity(num_levels)} "
            "(init_state's max_length is at most that); raise num_levels"
        )


class LevelWeights(nnx.Module):
    """λ `[B, T, H, L]` float32: softplus(s ⊙ (x W + b)) per head and level, s `[H, L]` from 1
    (FLA's `L` parameter), W and b in float32 whatever the compute dtype."""

    def __init__(self, d_model: int, num_heads: int, num_levels: int, *, param_dtype, rngs):
        self.num_heads, self.num_levels = num_heads, num_levels
        self.proj = nnx.Linear(
            d_model,
            num_heads * num_levels,
            dtype=jnp.float32,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.scale = nnx.Param(jnp.ones((num_heads, num_levels), param_dtype))

    def __call__(self, x_BTD):
        z = self.proj(x_BTD).astype(jnp.float32)
        z = z.reshape(*z.shape[:-1], self.num_heads, self.num_levels)
        return jax.nn.softplus(self.scale[...].astype(jnp.float32) * z)


class LogLinearMamba2Mixer(Mixer):
    """Log-linear Mamba-2: the `gated` mixer's parts with Fenwick level states (see the module)."""

    NAME = "log_linear_mamba2"
    FAMILY = K.LOG_LINEAR
    SEQUENCE_PARALLEL = True
    OPTIONS = LogLinearConfig

    def _flops_sizes(self) -> dict:
        return dict(num_levels=self.options["num_levels"])

    def _build(self, rngs) -> None:
        opts = self.options
        self.method = opts["method"]
        self.chunk_size = opts["chunk_size"]
        self.num_levels = opts["num_levels"]
        h = self.num_heads
        self.decay = ScalarDecay(
            self.d_model, h, self.qk_dim, param_dtype=self.param_dtype, rngs=rngs
        )
        self.levels = LevelWeights(
            self.d_model, h, self.num_levels, param_dtype=self.param_dtype, rngs=rngs
        )

    def _init_core(self, batch_size: int, max_length: int):
        if max_length > capacity(self.num_levels):
            raise ValueError(
                f"max_length={max_length} exceeds what num_levels={self.num_levels} covers "
                f"(positions below 2^(num_levels-1) = {capacity(self.num_levels)}); raise "
                "num_levels"
            )
        h, L = self.num_heads, self.num_levels
        return K.LogLinearState.zeros(batch_size, h, L, self.qk_dim, self.head_dim)

    def _scale_keys(self, k):
        return k * jnp.asarray(self.qk_dim**-0.5, k.dtype)

    def _mix(self, x_BTD, q_BTHK, k_BTHK, v_BTHD, core, position, segments=None):
        # (the kernel reads the state's own positions: per head, a reset restarts a head's
        # levels; `position`, the tokens seen, bounds them)
        if core is not None:
            check_room(self.num_levels, position, q_BTHK.shape[1])
        args = (q_BTHK, self._scale_keys(k_BTHK), v_BTHD, self.decay(x_BTD), self.levels(x_BTD))
        options = dict(method=self.method, chunk_size=self.chunk_size, segment_ids=segments)
        if core is None:
            return K.log_linear_attention(*args, axis_name=sequence_axis(), **options), None
        return K.log_linear_attention(*args, initial_state=core, return_state=True, **options)

    def _mix_step(self, x_BD, q_BHK, k_BHK, v_BHD, core, position):
        check_room(self.num_levels, position, 1)
        log_decay = per_token(self.decay(x_BD[:, None]))
        lam_BHL = self.levels(x_BD)
        k_BHK = self._scale_keys(k_BHK)
        return K.log_linear_attention_step(core, q_BHK, k_BHK, v_BHD, log_decay, lam_BHL)


@dataclasses.dataclass(frozen=True)
class LogLinearDeltaConfig(DeltaConfig):
    """Gated DeltaNet's options (conv, norm and gate on; β's range) with the log-linear
    kernel's methods (the chunk-rematerialised scan by default) and levels."""

    method: str = METHOD.field(choices=K.LOG_LINEAR_DELTA.supported)
    num_levels: int = NUM_LEVELS.field()


class LogLinearGatedDeltaNetMixer(GatedDeltaNetMixer):
    """Log-linear Gated DeltaNet: Gated DeltaNet's parts (`layers.delta`: the short conv, SiLU,
    L2-normalised q·Dk^-½ and k, β = sigmoid(x W_β) (×2 with `allow_neg_eigval`), the Mamba-2
    decay, per-head norm and output gate) with `LevelWeights`, on
    `kernels.log_linear_delta_rule`: every level state follows the delta transition, each level
    is read with its weight λ_t^ℓ. One value head per q/k head. `method`: "chunk" (the WY form
    per chunk), "scan" (a `lax.scan` in rematerialised chunks of `chunk_size` tokens) or
    "quadratic" (the reference, whole-sequence path only: a prefill from a state uses "chunk")."""

    NAME = "log_linear_gated_deltanet"
    FAMILY = K.LOG_LINEAR_DELTA
    SEQUENCE_PARALLEL = False
    OPTIONS = LogLinearDeltaConfig

    def _flops_sizes(self) -> dict:
        return dict(num_levels=self.options["num_levels"])

    def _build(self, rngs) -> None:
        super()._build(rngs)
        self.num_levels = self.options["num_levels"]
        self.levels = LevelWeights(
            self.d_model, self.num_heads, self.num_levels, param_dtype=self.param_dtype, rngs=rngs
        )

    def _init_core(self, batch_size: int, max_length: int):
        if max_length > capacity(self.num_levels):
            raise ValueError(
                f"max_length={max_length} exceeds what num_levels={self.num_levels} covers "
                f"(positions below 2^(num_levels-1) = {capacity(self.num_levels)}); raise "
                "num_levels"
            )
        h, L = self.num_heads, self.num_levels
        return K.LogLinearState.zeros(batch_size, h, L, self.qk_dim, self.head_dim)

    def _mix(self, x_BTD, q_BTHK, k_BTHK, v_BTHD, core, position, segments=None):
        if core is not None:  # (the kernel reads the state's own positions)
            check_room(self.num_levels, position, q_BTHK.shape[1])
        q, k, v = self.prepare(q_BTHK, k_BTHK, v_BTHD)
        args = (q, k, v, self.beta(x_BTD), self._log_decay(x_BTD), self.levels(x_BTD))
        options = dict(chunk_size=self.chunk_size, segment_ids=segments)
        if core is None:
            return K.log_linear_delta_rule(*args, method=self.method, **options), None
        method = "chunk" if self.method == "quadratic" else self.method
        return K.log_linear_delta_rule(
            *args, method=method, initial_state=core, return_state=True, **options
        )

    def _mix_step(self, x_BD, q_BHK, k_BHK, v_BHD, core, position):
        check_room(self.num_levels, position, 1)
        q, k, v = self.prepare(q_BHK, k_BHK, v_BHD)
        log_decay = per_token(self._log_decay(x_BD[:, None]))
        lam_BHL = self.levels(x_BD)
        return K.log_linear_delta_rule_step(core, q, k, v, self.beta(x_BD), log_decay, lam_BHL)
