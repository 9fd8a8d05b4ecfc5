"""Kimi Delta Attention (`kda`, Kimi Linear, 2025): the delta rule with a decay per key channel.

    q, k, v = silu(conv(x W_qkv))                 short conv (kernel 4) on q, k and v
    q ← l2norm(q) · Dk^-½,  k ← l2norm(k)         per head, float32
    β_t = sigmoid(x_t W_β)                        per value head (2·sigmoid: `allow_neg_eigval`)
    log γ_{t,h,c} = −softplus((x_t W₁ W₂)_{h,c} + b_{h,c}) · exp(A_h)      (`decays.ChannelDecay`)
    S_t = (I − β_t k_t k_tᵀ) Diag(γ_t) S_{t−1} + β_t k_t v_tᵀ,    o_t = S_tᵀ q_t
    y   = (RMSNorm(o) ⊙ sigmoid(x W_g↓ W_g↑ + b)) W_o           the gated RMSNorm output
                                                  (`gate_bias=False`: no b, as transformers'
                                                  Kimi Linear; FLA's KDA has b)

W₁ and W_g↓ have rank `head_dim` (as Kimi Linear). Grouped value heads (`num_value_heads` HV, a
multiple of H): v, β, the decay, the norm and the state have HV heads and value head j reads
q/k head j // (HV / H). The parts are the delta-rule family's (`layers.delta`) with the
per-channel decay and the sigmoid low-rank output gate; the kernels are `kernels.delta_rule` /
`delta_rule_step` with a `[B, T, HV, K]` log decay. The state is
`LinearAttentionState(kv [B, HV, K, Dv], k_sum=None)`, float32.
"""

from __future__ import annotations

import dataclasses

from linear_attention.layers.decays import ChannelDecay
from linear_attention.layers.delta import DeltaNetMixer, GroupedDeltaConfig
from linear_attention.layers.options import option

GATE_BIAS = option(True, "the low-rank output gate has a bias b (kda; False: none)")


@dataclasses.dataclass(frozen=True)
class KDAConfig(GroupedDeltaConfig):
    """KDA's options: the grouped delta rule's and the output gate's bias."""

    gate_bias: bool = GATE_BIAS.field()


class KDAMixer(DeltaNetMixer):
    """KDA: per-channel decay from a low-rank projection, sigmoid-gated RMSNorm output."""

    NAME = "kda"
    OPTIONS = KDAConfig

    @classmethod
    def _check_family_options(cls, num_heads, options) -> None:
        super()._check_family_options(num_heads, options)
        if not options["gate_bias"] and not options["out_gate"]:
            raise ValueError(f"gate_bias=False needs out_gate on (mixer {cls.NAME!r})")

    def _build_decay(self, rngs):
        return ChannelDecay(
            self.d_model,
            self.num_value_heads,
            self.qk_dim,
            rank=self.head_dim,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )

    def _output_options(self) -> dict:
        return dict(
            super()._output_options(),
            gate_activation="sigmoid",
            gate_rank=self.head_dim,
            gate_bias=self.options["gate_bias"],
        )
