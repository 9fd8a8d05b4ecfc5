"""Comba (Hu et al. 2025, "Comba: Improving Bilinear RNNs with Closed-loop Control"): Gated
DeltaNet whose removal reads the state through its own key p, with an output correction.

    q, k, v = silu(conv(x W_qkv))                 short conv (kernel 4) on q, k and v
    p  = l2norm(σ(d_h) k)                         the read key (σ(d_h): the "inner decay")
    q ← l2norm(q − D_h σ(d_h) k) · Dk^-½,  k ← l2norm(k)      per head, float32
    β_t = sigmoid(x_t W_β)                        per value head (2·sigmoid: `allow_neg_eigval`)
    log γ_t = −softplus(x_t·w_h + b_h)·exp(A_h)   per value head (`decays.ScalarDecay`)
    S_t = γ_t S_{t−1} + β_t k_t (v_t − γ_t S_{t−1}ᵀ p_t)ᵀ,    o_t = S_tᵀ q_t
    y   = (RMSNorm(o) ⊙ sigmoid(x W_g)) W_o       the gated RMSNorm output (eps 1e-5)

As FLA's `Comba` layer (fla/layers/comba.py) with its defaults (`use_inner_decay`,
`use_output_correction`, the kernel's `use_qk_l2norm_in_kernel`, which normalises p too): d_h
starts at 1 and D_h at `correction_factor` (`output_correction=False`: no correction, no D). The
correction is closed-loop control on the output: q reads the state minus what p would remove.
Since p is L2-normalised, σ(d_h) only matters inside the correction. FLA draws A ~ U[0, 16];
this uses the library's Mamba-2 init, A ~ U[1, 16]; FLA's conv has no bias (`conv_bias=False`
here).

Grouped value heads (`num_value_heads` HV, a multiple of H): v, β, the decay, the norm and
the state have HV heads; q, k and p are repeated to them (FLA repeats q and k only). The
kernels are `kernels.comba` / `comba_step` (Comba reduced exactly onto the DPLR delta rule:
"chunk" or "scan", `segment_ids` resets, the affine time split). The state is
`LinearAttentionState(kv [B, HV, K, Dv], k_sum=None)`, float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention import kernels as K
from linear_attention.layers.decays import per_token
from linear_attention.layers.delta import GatedDeltaNetMixer, GroupedDeltaConfig, l2norm
from linear_attention.layers.options import METHOD, OUT_NORM_EPS, option
from linear_attention.layers.sequence import sequence_axis

OUTPUT_CORRECTION = option(True, "Comba's output correction q − D·σ(d)·k (False: q alone)")
CORRECTION_FACTOR = option(
    1.0, "initial D of Comba's output correction (FLA suggests also 0.02 for small models)"
)


@dataclasses.dataclass(frozen=True)
class CombaConfig(GroupedDeltaConfig):
    """Comba's options: the grouped delta rule's (the norm's eps 1e-5, FLA's), the DPLR-backed
    methods, the output correction and its initial D."""

    method: str = METHOD.field(choices=K.COMBA.supported)
    out_norm_eps: float = OUT_NORM_EPS.field(1e-5)
    output_correction: bool = OUTPUT_CORRECTION.field()
    correction_factor: float = CORRECTION_FACTOR.field()


class CombaMixer(GatedDeltaNetMixer):
    """Comba: Gated DeltaNet's parts, a read key p = l2norm(σ(d) k), the output correction
    q − D σ(d) k and the sigmoid-gated RMSNorm output."""

    NAME = "comba"
    FAMILY = K.COMBA
    OPTIONS = CombaConfig

    @classmethod
    def _check_family_options(cls, num_heads, options) -> None:
        super()._check_family_options(num_heads, options)
        default = CombaConfig.correction_factor
        if not options["output_correction"] and options["correction_factor"] != default:
            raise ValueError(
                f"correction_factor={options['correction_factor']} needs output_correction on "
                f"(mixer {cls.NAME!r})"
            )

    def _build(self, rngs) -> None:
        super()._build(rngs)
        h, opts = self.num_heads, self.options
        self.inner_decay = nnx.Param(jnp.ones((h,), self.param_dtype))
        self.correction = nnx.data(None)  # a Param or None: pytree data either way
        if opts["output_correction"]:
            factor = opts["correction_factor"]
            self.correction = nnx.Param(jnp.full((h,), factor, self.param_dtype))

    def _output_options(self) -> dict:
        return dict(super()._output_options(), gate_activation="sigmoid")

    def comba_inputs(self, q, k, v):
        """(q, k, v, p) the kernel receives, q/k/p repeated to the value heads, from the input
        part's q, k `[..., H, K]` (module docstring; float32 inside, v's dtype out)."""
        if not self.conv_silu:
            q, k, v = jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
        dtype = v.dtype
        q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
        p32 = k32 * jax.nn.sigmoid(self.inner_decay[...].astype(jnp.float32))[:, None]
        if self.correction is not None:
            q32 = q32 - self.correction[...].astype(jnp.float32)[:, None] * p32
        q = (l2norm(q32) * self.qk_dim**-0.5).astype(dtype)
        repeat = self.num_value_heads // self.num_heads
        q, k, p = (
            jnp.repeat(z.astype(dtype), repeat, axis=-2) for z in (q, l2norm(k32), l2norm(p32))
        )
        return q, k, v, p

    def _mix(self, x_BTD, q_BTHK, k_BTHK, v_BTHD, core, position, segments=None):
        del position
        options = dict(
            log_decay=self._log_decay(x_BTD),
            scale=1.0,  # q carries Dk^-½
            method=self.method,
            chunk_size=self.chunk_size,
            segment_ids=segments,
            axis_name=sequence_axis(),
        )
        args = (*self.comba_inputs(q_BTHK, k_BTHK, v_BTHD), self.beta(x_BTD))
        if core is None:
            return K.comba(*args, **options), None
        return K.comba(*args, initial_state=core, return_state=True, **options)

    def _mix_step(self, x_BD, q_BHK, k_BHK, v_BHD, core, position):
        del position
        log_decay = per_token(self._log_decay(x_BD[:, None]))
        args = (*self.comba_inputs(q_BHK, k_BHK, v_BHD), self.beta(x_BD))
        return K.comba_step(core, *args, log_decay=log_decay, scale=1.0)


__all__ = ["CombaMixer"]
