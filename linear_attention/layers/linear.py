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
| `hgrn2`    | silu(q)·Dk^-½; k = 1 − γ_t             | σ(x W_f), vector             | norm only |

¹ of `feature_scale`·q and `feature_scale`·k (default 1; Zoology's `temp`): elu+1 is not
scale-invariant, and at the scale of q, k at init (std ~0.3) it is ≈ 1 + x, so φ(q)·φ(k) ≈
Dk + Σq + Σk + q·k is nearly constant and attention nearly uniform (docs/studies/mqar.md).

(`norm+gate` are defaults; `out_norm` / `out_gate` override them. `gla`'s decay is a vector,
one per key dimension: `S_t = diag(γ_t) S_{t−1} + φ(k_t) v_tᵀ`, a rank-4 `[B, T, H, M]` log
decay for the kernels.) The whole-sequence paths call `kernels.causal_linear_attention` with
`method` / `chunk_size`; `step` calls `kernels.recurrent_step`. The state
`LinearAttentionState(kv [B,H,M,Dv], k_sum [B,H,M])` is float32 and its size does not depend on
the context length.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention import kernels as K
from linear_attention.layers.base import Mixer
from linear_attention.layers.decays import FixedDecay, KeyDecay, ScalarDecay, per_token
from linear_attention.layers.feature_maps import (
    FIXED_FEATURE_MAPS,
    FavorFeatures,
    FixedFeatureMap,
    HedgehogFeatures,
)
from linear_attention.layers.options import (
    CHUNK_SIZE,
    CONV_BIAS,
    D_SKIP,
    DT_INPUT,
    EPS,
    FEATURE_DIM,
    FEATURE_MAP,
    FEATURE_SCALE,
    GATE_BEFORE_NORM,
    METHOD,
    NUM_VALUE_HEADS,
    OUT_GATE,
    OUT_NORM_EPS,
    OUT_NORM_GROUPS,
    STATE_DIM,
    GatedOutputConfig,
    MixerConfig,
)
from linear_attention.layers.sequence import sequence_axis

# The kernel methods of the linear family (the Pallas form included).
LINEAR_METHODS = K.LINEAR.supported
# The sweep label of elu+1 with q and k scaled by 8.
SCALED_LABEL = "linear_scale8"


@dataclasses.dataclass(frozen=True)
class LinearConfig(MixerConfig):
    """`linear`: a fixed feature map of scaled q and k, the causal kernel, its epsilon."""

    feature_map: str = FEATURE_MAP.field("elu_plus_one", choices=FIXED_FEATURE_MAPS)
    feature_scale: float | None = FEATURE_SCALE.field()
    method: str = METHOD.field(choices=LINEAR_METHODS)
    chunk_size: int = CHUNK_SIZE.field()
    eps: float = EPS.field()


@dataclasses.dataclass(frozen=True)
class FeatureConfig(MixerConfig):
    """A feature map of its own width (favor, taylor, hedgehog; None: the mixer's default)."""

    feature_dim: int | None = FEATURE_DIM.field()
    method: str = METHOD.field(choices=LINEAR_METHODS)
    chunk_size: int = CHUNK_SIZE.field()
    eps: float = EPS.field()


@dataclasses.dataclass(frozen=True)
class FavorConfig(FeatureConfig):
    feature_dim: int | None = FEATURE_DIM.field(64)


@dataclasses.dataclass(frozen=True)
class TaylorConfig(FeatureConfig):
    feature_dim: int | None = FEATURE_DIM.field(16)


@dataclasses.dataclass(frozen=True)
class DecayConfig(GatedOutputConfig):
    """retnet and gated: identity features by default (any fixed map may be chosen)."""

    feature_map: str = FEATURE_MAP.field("identity", choices=FIXED_FEATURE_MAPS)
    method: str = METHOD.field(choices=LINEAR_METHODS)
    chunk_size: int = CHUNK_SIZE.field()


@dataclasses.dataclass(frozen=True)
class GatedConfig(DecayConfig):
    """gated: DecayConfig with the parts of Mamba-2's layer (all off by default)."""

    num_value_heads: int | None = NUM_VALUE_HEADS.field()
    state_dim: int | None = STATE_DIM.field()
    dt_input: bool = DT_INPUT.field()
    d_skip: bool = D_SKIP.field()
    conv_bias: bool = CONV_BIAS.field()
    gate_before_norm: bool = GATE_BEFORE_NORM.field()
    out_norm_groups: int | None = OUT_NORM_GROUPS.field()
    out_norm_eps: float = OUT_NORM_EPS.field()


@dataclasses.dataclass(frozen=True)
class GLAConfig(GatedOutputConfig):
    method: str = METHOD.field(choices=LINEAR_METHODS)
    chunk_size: int = CHUNK_SIZE.field()


class LinearMixer(Mixer):
    """The linear-attention family (and the `linear` mixer itself: a fixed feature map).

    Parts: a feature map (`_build_feature_map`), a decay part (`DECAY`, None for none), the
    kernel `causal_linear_attention` / `recurrent_step`. `NORMALIZE` divides by φ(q)ᵀz;
    `K_SCALE` scales k by Dk^-½ before φ. `feature_scale` c (the `linear` mixer only): φ(c·q),
    φ(c·k) instead of φ(q), φ(k).
    """

    NAME = "linear"
    FAMILY = K.LINEAR
    SEQUENCE_PARALLEL = True
    OPTIONS = LinearConfig
    # (docs/studies/mqar.md, `linear_scale8`: q and k scaled by 8 before elu+1)
    SWEEP_LABELS = {SCALED_LABEL: {"feature_scale": 8.0}}
    NORMALIZE: ClassVar[bool] = True
    K_SCALE: ClassVar[bool] = False
    DECAY: ClassVar[type | None] = None

    def _flops_sizes(self) -> dict:
        return dict(dk=self.state_feature_dim)  # (the feature width: the state's first axis)

    def _build(self, rngs) -> None:
        opts = self.options
        self.method = opts["method"]
        self.chunk_size = opts["chunk_size"]
        self.eps = opts.get("eps", EPS.default)  # (no eps: the mixer does not normalise)
        scale = opts.get("feature_scale")
        self.feature_scale = 1.0 if scale is None else scale
        self.feature_map = self._build_feature_map(rngs)
        self.decay = (
            None
            if self.DECAY is None
            else self.DECAY(
                self.d_model,
                self.num_value_heads,
                self.qk_dim,
                param_dtype=self.param_dtype,
                rngs=rngs,
            )
        )

    def _build_feature_map(self, rngs) -> nnx.Module:
        return FixedFeatureMap(self.options["feature_map"], self.qk_dim)

    def _log_decay(self, x_BTD: jax.Array) -> jax.Array | None:
        """log γ (≤ 0, float32): None (no decay), `[H]` (fixed), `[B, T, H]` or `[B, T, H, M]`."""
        return None if self.decay is None else self.decay(x_BTD)

    @property
    def state_feature_dim(self) -> int:
        """M, the width of φ(q), φ(k) and the first state axis."""
        return self.feature_map.feature_dim

    def featurize(self, q, k):
        """(φ(q), φ(k)) as the kernel takes them (feature scale and k scaling included)."""
        if self.feature_scale != 1.0:
            q = q * jnp.asarray(self.feature_scale, q.dtype)
            k = k * jnp.asarray(self.feature_scale, k.dtype)
        if self.K_SCALE:
            k = k * jnp.asarray(self.qk_dim**-0.5, k.dtype)
        return self.feature_map(q, is_query=True), self.feature_map(k, is_query=False)

    def _kernel_options(self) -> dict:
        options = dict(normalize=self.NORMALIZE)
        if self.NORMALIZE:
            options["eps"] = self.eps
        return options

    def _init_core(self, batch_size: int, max_length: int) -> K.LinearAttentionState:
        del max_length  # the state does not grow with the context
        return K.LinearAttentionState.zeros(
            batch_size, self.num_value_heads, self.state_feature_dim, self.head_dim
        )

    def kernel_terms(self, x, q, k):
        """(φ(q), φ(k), log γ) the kernel takes, on a sequence (x `[B, T, D]`, q, k `[B, T, H,
        K]`) or for a step (x `[B, D]`, q, k `[B, H, K]`: the decay per token, `[B, H(, M)]`);
        a family whose decay comes from its q/k projection (hgrn2) overrides it."""
        phi_q, phi_k = self.featurize(q, k)
        if x.ndim == 2:
            return phi_q, phi_k, per_token(self._log_decay(x[:, None]))
        return phi_q, phi_k, self._log_decay(x)

    def attends_with(self, x_BTD):
        q_BTHK, k_BTHK, v_BTHD, _ = self.inputs(x_BTD, None, 0)
        phi_q_BTHM, phi_k_BTHM, log_decay = self.kernel_terms(x_BTD, q_BTHK, k_BTHK)
        if log_decay is not None:  # [H] (fixed) or [B, T, H] -> [B, T, H]; [B, T, H, M] as is
            b, t, h = q_BTHK.shape[:3]
            shape = (b, t, h) if log_decay.ndim < 4 else (b, t, h, log_decay.shape[-1])
            log_decay = jnp.broadcast_to(log_decay, shape)
        return phi_q_BTHM, phi_k_BTHM, v_BTHD, log_decay

    def _mix(self, x_BTD, q_BTHK, k_BTHK, v_BTHD, core, position, segments=None):
        del position
        phi_q_BTHM, phi_k_BTHM, log_decay = self.kernel_terms(x_BTD, q_BTHK, k_BTHK)
        options = dict(
            log_decay=log_decay,
            method=self.method,
            chunk_size=self.chunk_size,
            axis_name=sequence_axis(),
            **self._kernel_options(),
        )
        if segments is not None:
            options["segment_ids"] = segments
        if core is None:
            return K.causal_linear_attention(phi_q_BTHM, phi_k_BTHM, v_BTHD, **options), None
        return K.causal_linear_attention(
            phi_q_BTHM, phi_k_BTHM, v_BTHD, initial_state=core, return_state=True, **options
        )

    def _mix_step(self, x_BD, q_BHK, k_BHK, v_BHD, core, position):
        del position
        phi_q_BHM, phi_k_BHM, log_decay = self.kernel_terms(x_BD, q_BHK, k_BHK)
        return K.recurrent_step(
            core, phi_q_BHM, phi_k_BHM, v_BHD, log_decay=log_decay, **self._kernel_options()
        )


class FavorMixer(LinearMixer):
    """Performer FAVOR+: positive orthogonal random features (`feature_dim` of them, default 64),
    redrawn by `redraw(key)` (training calls it every `redraw_interval` steps)."""

    NAME = "favor"
    OPTIONS = FavorConfig
    REDRAWS = True

    def _build_feature_map(self, rngs):
        return FavorFeatures(self.qk_dim, self.options["feature_dim"], rngs=rngs)

    def redraw(self, key: jax.Array) -> None:
        """Draw a new random projection from `key`."""
        self.feature_map.redraw(key)


class TaylorMixer(LinearMixer):
    """Based: q, k projected to `feature_dim` d (default 16) per head, then the 2nd-order Taylor
    feature map `[1, x/c₁, upper triangle of (x⊗x)/c₂]` (`kernels.feature_maps.taylor2`):
    M = 1 + d + d(d+1)/2 (153 at d = 16); normalized."""

    NAME = "taylor"
    OPTIONS = TaylorConfig
    SWEEP_FIELDS = {"feature_dim": "taylor_dim"}

    @classmethod
    def _qk_dim(cls, head_dim, options):
        return options["feature_dim"]

    def _build_feature_map(self, rngs):
        return FixedFeatureMap("taylor2", self.qk_dim)


class HedgehogMixer(LinearMixer):
    """Hedgehog: learnable per-head feature map `[softmax(xW), softmax(−xW)]`, `W: [Dk, F]`
    (F = `feature_dim`, default Dk); normalized."""

    NAME = "hedgehog"
    OPTIONS = FeatureConfig

    def _build_feature_map(self, rngs):
        return HedgehogFeatures(
            self.num_heads,
            self.qk_dim,
            self.options["feature_dim"] or self.qk_dim,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )


class RetNetMixer(LinearMixer):
    """Retention: fixed multi-scale decay γ_h = 1 − 2^(−5−h) per head h = 0..H−1, no
    denominator, per-head RMSNorm of the output and a swish output gate."""

    NAME = "retnet"
    OPTIONS = DecayConfig
    NORMALIZE = False
    K_SCALE = True
    DECAY = FixedDecay


class GatedMixer(LinearMixer):
    """Data-dependent scalar decay per head and token (Mamba-2 / simple gated linear attention):

        log γ_{t,h} = −softplus(x_t · w_h + b_h) · exp(A_h)            (`decays.ScalarDecay`)

    with `A_h ~ U[1, 16]` and `softplus(b_h) ~ logU[1e-3, 1e-1]` at init (as Mamba-2); no
    denominator, per-head RMSNorm and swish output gate.

    Mamba-2's layer (`Mamba2Mixer`, transformers' torch path) is this mixer with its options:
    with q = C, k = B, v = x, the step dt_{t,h} = softplus(x_t·w_h + b_h) and a_h = −exp(A_h),

        S_{t,h} = exp(dt_{t,h} a_h) S_{t−1,h} + dt_{t,h} B_{t,g} x_{t,h}ᵀ       g = h // (H/G)
        y_{t,h} = S_{t,h}ᵀ C_{t,g} + D_h x_{t,h}
        out     = RMSNorm_G(y ⊙ silu(z_t)) W_o     (over G groups of the H·P channels)

    - `num_value_heads` H with `num_heads` G: B and C (q and k) have G heads shared by groups of
      H/G value heads; the decay, the state and v have H heads (value head h reads group
      h // (H/G), as Mamba-2's `repeat_interleave`);
    - `state_dim` N: the width of q and k, the state `[H, N, P]` (None: head_dim P);
    - `dt_input`: k_{t,h} = dt_{t,h}·k_{t,g} (the discretised input; k is then not scaled by
      Dk^-½), the same dt as the decay's;
    - `d_skip`: D `[H]`, o_{t,h} += D_h·v_{t,h} (v after the conv);
    - `gate_before_norm`, `out_norm_groups`, `out_norm_eps`: the gated RMSNorm above
      (`layers.output.OutputStage`); `conv_bias` as the delta rules'.
    """

    NAME = "gated"
    OPTIONS = GatedConfig
    NORMALIZE = False
    K_SCALE = True
    DECAY = ScalarDecay

    @classmethod
    def check_config(cls, d_model, num_heads, config) -> None:
        super().check_config(d_model, num_heads, config)
        hv = config.num_value_heads or num_heads
        if hv % num_heads:
            raise ValueError(
                f"num_value_heads={hv} must be a multiple of num_heads={num_heads} (mixer "
                f"{cls.NAME!r}: B and C are shared by groups of value heads)"
            )
        channels = hv * (config.head_dim or d_model // num_heads)
        groups = config.out_norm_groups
        if groups is not None and (not config.out_norm or channels % groups):
            raise ValueError(
                f"out_norm_groups={groups} needs out_norm on and must divide the {channels} "
                f"output channels (mixer {cls.NAME!r})"
            )
        if config.gate_before_norm and not (config.out_norm and config.out_gate):
            raise ValueError(f"gate_before_norm needs out_norm and out_gate (mixer {cls.NAME!r})")
        if not config.conv_bias and not config.conv:
            raise ValueError(f"conv_bias=False needs the short conv on (mixer {cls.NAME!r})")

    @classmethod
    def _qk_dim(cls, head_dim, options):
        return options.get("state_dim") or head_dim

    def _input_options(self) -> dict:
        return dict(conv_bias=self.options["conv_bias"])

    def _output_options(self) -> dict:
        opts = self.options
        return dict(
            norm_groups=opts["out_norm_groups"],
            gate_before_norm=opts["gate_before_norm"],
            norm_eps=opts["out_norm_eps"],
        )

    def _build(self, rngs) -> None:
        super()._build(rngs)
        self.dt_input = self.options["dt_input"]
        if self.options["d_skip"]:  # Mamba-2 starts at D = 1
            self.skip = nnx.Param(jnp.ones((self.num_value_heads,), self.param_dtype))
        else:
            self.skip = None

    def featurize(self, q, k):
        if not self.dt_input:
            return super().featurize(q, k)
        return self.feature_map(q, is_query=True), self.feature_map(k, is_query=False)

    def attends_with(self, x_BTD):
        """Grouped q/k heads, k scaled by dt (Mamba-2's options); none with `d_skip`."""
        if self.skip is not None:
            raise ValueError(
                "a gated mixer with d_skip adds D·v to the weighted sum: no attention_inputs"
            )
        q_BTHK, k_BTHK, v_BTHD, _ = self.inputs(x_BTD, None, 0)
        phi_q_BTHM, phi_k_BTHM = self.featurize(q_BTHK, k_BTHK)
        phi_q_BTHM, phi_k_BTHM, log_decay = self.per_value_head(x_BTD, phi_q_BTHM, phi_k_BTHM)
        return phi_q_BTHM, phi_k_BTHM, v_BTHD, log_decay

    def _mix(self, x_BTD, q_BTHK, k_BTHK, v_BTHD, core, position, segments=None):
        del position
        phi_q, phi_k = self.featurize(q_BTHK, k_BTHK)
        phi_q, phi_k, log_decay = self.per_value_head(x_BTD, phi_q, phi_k)
        options = dict(
            log_decay=log_decay,
            method=self.method,
            chunk_size=self.chunk_size,
            axis_name=sequence_axis(),
            normalize=False,
        )
        if segments is not None:
            options["segment_ids"] = segments
        if core is None:
            o = K.causal_linear_attention(phi_q, phi_k, v_BTHD, **options)
        else:
            o, core = K.causal_linear_attention(
                phi_q, phi_k, v_BTHD, initial_state=core, return_state=True, **options
            )
        return self._skip(o, v_BTHD), core

    def _mix_step(self, x_BD, q_BHK, k_BHK, v_BHD, core, position):
        del position
        phi_q, phi_k = self.featurize(q_BHK, k_BHK)
        phi_q, phi_k, log_decay = self.per_value_head(x_BD[:, None], phi_q, phi_k, step=True)
        o, core = K.recurrent_step(core, phi_q, phi_k, v_BHD, log_decay=log_decay, normalize=False)
        return self._skip(o, v_BHD), core

    def per_value_head(self, x_BTD, phi_q, phi_k, *, step: bool = False):
        """φ(q), φ(k) repeated from the G q/k heads to the H value heads (each group's to its
        H/G heads), k scaled by dt with `dt_input`, and log γ (`[B, H]` for a `step`): what the
        kernel attends with (`layers.analysis.attention_inputs` reads it too)."""
        repeat = self.num_value_heads // self.num_heads
        if repeat > 1:
            phi_q = jnp.repeat(phi_q, repeat, axis=-2)
            phi_k = jnp.repeat(phi_k, repeat, axis=-2)
        dt_BTH = self.decay.step_size(x_BTD)
        log_decay = self.decay.from_step(dt_BTH)
        if step:
            dt_BTH, log_decay = dt_BTH[:, 0], log_decay[:, 0]
        if self.dt_input:
            phi_k = (phi_k * dt_BTH[..., None]).astype(phi_k.dtype)
        return phi_q, phi_k, log_decay

    def _skip(self, o, v):
        """o + D_h·v with `d_skip` (in o's dtype)."""
        if self.skip is None:
            return o
        d_H1 = self.skip[...].astype(jnp.float32)[:, None]
        return (o.astype(jnp.float32) + d_H1 * v.astype(jnp.float32)).astype(o.dtype)


@dataclasses.dataclass(frozen=True)
class HGRN2Config(GLAConfig):
    """hgrn2: the output norm (over all heads' channels at once) on, no output gate."""

    out_gate: bool = OUT_GATE.field(False)


def hgrn2_terms(q, f, key_dim: int):
    """HGRN2's kernel inputs from its query and forget-gate projections q, f `[..., H, K]`:
    `(silu(q)·K^-½, 1 − γ in q's dtype, log γ float32)` with γ = sigmoid(f) (1 − γ computed
    as sigmoid(−f), exact where γ rounds to 1); the scale on q keeps the state FLA's."""
    f32 = f.astype(jnp.float32)
    q = jax.nn.silu(q) * jnp.asarray(key_dim**-0.5, q.dtype)
    return q, jax.nn.sigmoid(-f32).astype(q.dtype), jax.nn.log_sigmoid(f32)


class GLAMixer(LinearMixer):
    """Gated linear attention (GLA, Yang et al. 2023): a data-dependent decay per key dimension
    from a low-rank gate projection (`decays.KeyDecay`),

        log γ_t = logsigmoid(x_t W₁ W₂ + b) / τ        W₁: [d_model, 16], W₂: [16, H·Dk], τ = 16
        S_t = diag(γ_t) S_{t−1} + k_t v_tᵀ,    o_t = S_tᵀ q_t         (q·k scaled by Dk^-½)

    no denominator, per-head RMSNorm of the output and a swish output gate (as published; q, k
    and v share `head_dim` here, where the paper halves the key width)."""

    NAME = "gla"
    OPTIONS = GLAConfig
    NORMALIZE = False
    K_SCALE = True
    DECAY = KeyDecay

    def _build_feature_map(self, rngs):
        return FixedFeatureMap("identity", self.qk_dim)


class HGRN2Mixer(GLAMixer):
    """HGRN2 (Qin et al. 2024, "Gated linear RNNs with state expansion"): GLA with its keys tied
    to the forget gate. From the q, f and input projections (the q/k/v slots of the projection),

        γ_t = sigmoid(x_t W_f),  S_t = Diag(γ_t) S_{t−1} + (1 − γ_t) i_tᵀ,  o_t = S_tᵀ silu(q_t)/√K
        y   = RMSNorm(o over all H·Dv channels) W_o                  (eps 1e-5; no output gate)

    as FLA's `HGRN2Attention` (`hgrn2_terms`: the kernel's inputs; the same state); K is
    `head_dim` (FLA's `expand_ratio`). Not taken: the learned lower bound on γ that rises with
    depth (state that crosses layers, which the model's blocks do not pass), and `rope` (no
    positions). `conv` puts the projection's short conv (with its silu) on q, f and i, where
    FLA's optional conv has no activation."""

    NAME = "hgrn2"
    OPTIONS = HGRN2Config
    DECAY = None
    NOT_TAKEN = dict(rope="it has no positions")

    def _output_options(self) -> dict:
        return dict(norm_groups=1, norm_eps=1e-5)

    def kernel_terms(self, x, q, k):
        del x  # the decay is the forget gate, from the k slot of the projection
        return hgrn2_terms(q, k, self.qk_dim)
