"""Gated DeltaProduct (`gated_deltaproduct`, Siems et al. 2025): n delta steps per token.

    q ← l2norm(q)·Dk^-½;  k_j ← l2norm(k_j), v_j  for j = 1..n   (n = `num_householder`, 2)
    β_tj = sigmoid(x_t W_β)_j   per head (2·sigmoid with `allow_neg_eigval`)
    S ← γ_t S_{t−1};  S ← (I − β_tj k_tj k_tjᵀ) S + β_tj k_tj v_tjᵀ for j = 1..n;  o_t = S_tᵀ q_t
    y = (RMSNorm(o) ⊙ silu(x W_g)) W_o

with Gated DeltaNet's decay part (`decays.ScalarDecay`, Mamba-2) and short conv. The transition is
a product of n generalised Householder matrices (with `allow_neg_eigval` it can track
permutations one step cannot). The input part projects n keys and values per head
(`QKVProjection(num_keys=n)`); the kernels are `kernels.delta_product` / `delta_product_step`;
the state is `LinearAttentionState(kv [B, H, K, Dv], k_sum=None)`, float32.
"""

from __future__ import annotations

import dataclasses

from linear_attention import kernels as K
from linear_attention.layers.decays import ScalarDecay
from linear_attention.layers.delta import DeltaConfig, DeltaNetMixer
from linear_attention.layers.options import NUM_HOUSEHOLDER


@dataclasses.dataclass(frozen=True)
class DeltaProductConfig(DeltaConfig):
    num_householder: int = NUM_HOUSEHOLDER.field()


class GatedDeltaProductMixer(DeltaNetMixer):
    """Gated DeltaProduct: Gated DeltaNet with `num_householder` delta steps per token."""

    NAME = "gated_deltaproduct"
    FAMILY = K.DELTA_PRODUCT
    OPTIONS = DeltaProductConfig
    SWEEP_COUNT = "num_householder"
    DECAY = ScalarDecay
    KERNEL = staticmethod(K.delta_product)
    KERNEL_STEP = staticmethod(K.delta_product_step)

    def _num_keys(self) -> int:
        return self.options["num_householder"]

    def _flops_sizes(self) -> dict:
        return dict(num_keys=self._num_keys())

    def _build(self, rngs) -> None:
        super()._build(rngs)
        self.num_householder = self.options["num_householder"]

    def beta(self, x_BTD):
        """β `[..., H, n]` float32."""
        beta = super().beta(x_BTD)
        return beta.reshape(*beta.shape[:-1], self.num_heads, self.num_householder)
