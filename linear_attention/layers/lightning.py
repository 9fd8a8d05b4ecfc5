"""MiniMax's lightning attention (`lightning`, MiniMax-01, 2025): linear attention with a fixed
decay per head, an RMSNorm over all heads and a sigmoid output gate.

    q, k, v = silu(x W_qkv)                        per head [H, Dk], [H, Dk], [H, Dv]
    S_t = e^(−s_h) S_{t−1} + k_t v_tᵀ,    o_t = S_tᵀ q_t        (no scale, no denominator)
    y   = (RMSNorm(o over all H·Dv channels) ⊙ sigmoid(x W_g)) W_o      (eps 1e-6)

with the slope rate s_h = 2^(−8(h+1)/H) · (1 − l/(L − 1) + 1e-5) of head h = 0..H−1 in layer l
of L, as transformers' `MiniMaxLightningAttention` (its block-wise form and its decoding loop
both compute this recurrence). The kernels are `causal_linear_attention` / `recurrent_step`
with a `[H]` log decay −s; the state is `LinearAttentionState(kv [B, H, Dk, Dv], k_sum=None)`,
float32.

The slope depends on the layer's depth, which a mixer does not know: `SlopeDecay` holds s as a
parameter `[H]` that starts at a middle layer's (l/(L − 1) = ½) and that the forward pass stops
the gradient of (and, being 1-D, the optimizer does not decay), so it stays fixed in training,
as MiniMax's buffer, while a checkpoint import writes each layer's own. transformers' fused
`qkv_proj` interleaves q, k and v per head ([q_h, k_h, v_h] for each h); this projection's
columns are all q, then all k, then all v (an import permutes them). `conv` and `rope` are
refused: MiniMax's linear layers have neither.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention.layers.feature_maps import FixedFeatureMap
from linear_attention.layers.linear import LINEAR_METHODS, LinearMixer
from linear_attention.layers.options import CHUNK_SIZE, CONV, METHOD, GatedOutputConfig

MIDDLE_LAYER = 0.5  # l / (L − 1) of the slopes at init
NORM_EPS = 1e-6  # MiniMaxRMSNorm's


def lightning_slopes(num_heads: int, depth: float) -> np.ndarray:
    """MiniMax's slope rates s_h = 2^(−8(h+1)/H) · (1 − depth + 1e-5), h = 0..H−1, for a layer
    at `depth` = l / (L − 1 + 1e-5) (0: the first layer, about 1: the last), float64 `[H]`."""
    return (2.0 ** (-8.0 / num_heads)) ** (np.arange(num_heads) + 1.0) * (1.0 - depth + 1e-5)


class SlopeDecay(nnx.Module):
    """log γ_h = −s_h, a fixed decay per head held as a parameter (module docstring)."""

    def __init__(self, d_model: int, num_heads: int, key_dim: int, *, param_dtype, rngs):
        del d_model, key_dim, rngs
        slopes = lightning_slopes(num_heads, MIDDLE_LAYER)
        self.slope = nnx.Param(jnp.asarray(slopes, param_dtype))

    def __call__(self, x_BTD):
        del x_BTD  # (fixed: the same for every token)
        return -jax.lax.stop_gradient(self.slope[...].astype(jnp.float32))


class SiluInputs(nnx.Module):
    """MiniMax's act(x W_qkv): the q/k/v projection with silu on q, k and v."""

    def __init__(self, qkv: nnx.Module):
        self.qkv = qkv

    def init_state(self, batch_size: int):
        return self.qkv.init_state(batch_size)

    def __call__(self, x_BTD, tail, position, segments=None):
        q, k, v, tail = self.qkv(x_BTD, tail, position, segments)
        return jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v), tail


@dataclasses.dataclass(frozen=True)
class LightningConfig(GatedOutputConfig):
    conv: bool | int | None = CONV.field(False)
    method: str = METHOD.field(choices=LINEAR_METHODS)
    chunk_size: int = CHUNK_SIZE.field()


class LightningMixer(LinearMixer):
    """Lightning attention: silu q, k, v; a fixed per-head decay; RMSNorm and sigmoid gate."""

    NAME = "lightning"
    OPTIONS = LightningConfig
    NORMALIZE = False
    DECAY = SlopeDecay
    NOT_TAKEN = dict(conv="MiniMax's linear layers have none", rope="it has no positions")

    def _build_inputs(self, rngs: nnx.Rngs) -> nnx.Module:
        return SiluInputs(super()._build_inputs(rngs))

    def _build_feature_map(self, rngs):
        return FixedFeatureMap("identity", self.qk_dim)

    def _output_options(self) -> dict:
        return dict(gate_activation="sigmoid", norm_groups=1, norm_eps=NORM_EPS)


__all__ = ["LightningMixer", "lightning_slopes"]
