"""Gated DeltaNet-2 (`gdn2`): KDA with its β split into a channel-wise erase gate and a separate
write gate, over the DPLR delta rule.

    S_t = (I − k_t (b_t ⊙ k_t)ᵀ) Diag(γ_t) S_{t−1} + k_t (w_t ⊙ v_t)ᵀ,    o_t = S_tᵀ q_t
    b_t = sigmoid(x_t W_b) [H, K] (2·sigmoid: `allow_neg_eigval`),  w_t = sigmoid(x_t W_w) [H, Dv]

with KDA's parts otherwise (`layers.kda`): the short conv with SiLU on q, k, v, unit q and k
(q scaled by Dk^-½), the decay per key channel log γ = −softplus(x W₁ W₂ + b)·exp(A), the
sigmoid-gated RMSNorm output. b = w = β recovers KDA. As FLA's `GatedDeltaNet2` (fla/layers/
gdn2.py), whose recurrence `naive_recurrent_gdn2` decays the state, reads the erase at b ⊙ k
from the decayed state and writes w ⊙ v minus it.

The DPLR kernel, S_t = Diag(γ_t) S_{t−1} + β_t (α_tᵀ S_{t−1}) + k_t v_tᵀ, reads its low-rank term
from the state before the decay; the decay is folded into that read, α = −b ⊙ k ⊙ γ (≤ 1 in
size: no overflow), with β = k and the value w ⊙ v (`gdn2_attention`). Grouped value heads
(`num_value_heads` HV): the decay and both gates have HV heads, as KDA's decay here, and q, k are
repeated to them (FLA's decay and erase gate are per q/k head, repeated). The state is
`LinearAttentionState(kv [B, HV, K, Dv], k_sum=None)`, float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention import kernels as K
from linear_attention.layers.decays import per_token
from linear_attention.layers.kda import KDAConfig, KDAMixer
from linear_attention.layers.options import METHOD
from linear_attention.layers.sequence import sequence_axis


def _dplr_terms(k, erase, log_decay):
    """(α, β) of the DPLR kernel: −b ⊙ k ⊙ γ and k, in k's dtype."""
    decayed = erase * k.astype(jnp.float32) * jnp.exp(log_decay)
    return (-decayed).astype(k.dtype), k


def gdn2_attention(
    q, k, v, log_decay, erase, write, *, method="chunk", chunk_size=64, initial_state=None,
    segments=None,
):  # fmt: skip
    """GDN-2's recurrence (module docstring) over `kernels.dplr_delta_rule`: q, k `[B, T, H, K]`
    as the kernel takes them (no scaling here), v `[B, T, H, Dv]`, log γ and the erase gate b
    `[B, T, H, K]`, the write gate w `[B, T, H, Dv]` (float32); time split over
    `sequence_axis()` when one is set. Returns o, and with `initial_state` the final state."""
    a, b = _dplr_terms(k, erase, log_decay)
    value = (write * v.astype(jnp.float32)).astype(v.dtype)
    options = dict(
        log_decay=log_decay,
        method=method,
        chunk_size=chunk_size,
        segment_ids=segments,
        axis_name=sequence_axis(),
    )
    if initial_state is None:
        return K.dplr_delta_rule(q, k, value, a, b, **options)
    return K.dplr_delta_rule(
        q, k, value, a, b, initial_state=initial_state, return_state=True, **options
    )


def gdn2_step(state, q, k, v, log_decay, erase, write):
    """One token of `gdn2_attention` (q, k, log γ, b `[B, H, K]`; v, w `[B, H, Dv]`)."""
    a, b = _dplr_terms(k, erase, log_decay)
    value = (write * v.astype(jnp.float32)).astype(v.dtype)
    return K.dplr_delta_rule_step(state, q, k, value, a, b, log_decay=log_decay)


@dataclasses.dataclass(frozen=True)
class GDN2Config(KDAConfig):
    method: str = METHOD.field(choices=K.DPLR.supported)


class GDN2Mixer(KDAMixer):
    """Gated DeltaNet-2: KDA's parts with a channel-wise erase gate and a write gate."""

    NAME = "gdn2"
    FAMILY = K.DPLR
    OPTIONS = GDN2Config

    def _build(self, rngs) -> None:
        opts = self.options
        self.method, self.chunk_size = opts["method"], opts["chunk_size"]
        self.allow_neg_eigval = opts["allow_neg_eigval"]
        self.conv_silu = self.inputs.conv is not None  # the conv applies the SiLU itself
        # the gates are float32 whatever `dtype`
        lin = dict(use_bias=False, dtype=jnp.float32, param_dtype=self.param_dtype, rngs=rngs)
        hv = self.num_value_heads
        self.erase_proj = nnx.Linear(self.d_model, hv * self.qk_dim, **lin)
        self.write_proj = nnx.Linear(self.d_model, hv * self.head_dim, **lin)
        self.decay = self._build_decay(rngs)

    def gates(self, x):
        """(b `[..., HV, K]`, w `[..., HV, Dv]`), float32: sigmoid (b: 2·sigmoid with
        `allow_neg_eigval`) of x W_b, x W_w."""
        shape = x.shape[:-1] + (self.num_value_heads, -1)
        erase = jax.nn.sigmoid(self.erase_proj(x.astype(jnp.float32))).reshape(shape)
        write = jax.nn.sigmoid(self.write_proj(x.astype(jnp.float32))).reshape(shape)
        return (2.0 * erase if self.allow_neg_eigval else erase), write

    def _grouped(self, q, k):
        """q, k repeated from the H q/k heads to the HV value heads."""
        repeat = self.num_value_heads // self.num_heads
        return jnp.repeat(q, repeat, axis=-2), jnp.repeat(k, repeat, axis=-2)

    def _mix(self, x_BTD, q_BTHK, k_BTHK, v_BTHD, core, position, segments=None):
        del position
        q, k, v = self.prepare(q_BTHK, k_BTHK, v_BTHD)
        q, k = self._grouped(q, k)
        args = (q, k, v, self._log_decay(x_BTD), *self.gates(x_BTD))
        options = dict(method=self.method, chunk_size=self.chunk_size, segments=segments)
        if core is None:
            return gdn2_attention(*args, **options), None
        return gdn2_attention(*args, initial_state=core, **options)

    def _mix_step(self, x_BD, q_BHK, k_BHK, v_BHD, core, position):
        del position
        q, k, v = self.prepare(q_BHK, k_BHK, v_BHD)
        q, k = self._grouped(q, k)
        log_decay = per_token(self._log_decay(x_BD[:, None]))
        return gdn2_step(core, q, k, v, log_decay, *self.gates(x_BD))


__all__ = ["GDN2Mixer", "gdn2_attention", "gdn2_step"]
