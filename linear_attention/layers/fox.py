"""Forgetting attention (FoX: Lin et al., ICLR 2025): causal softmax attention whose logits
carry a data-dependent forget gate, `kernels.forgetting_attention`.

    f_t = sigmoid(w_fᵀ x_t + b_f)  per head          (log f_t in float32)
    o_t = Σ_{s ≤ t} softmax_s(q_t·k_s / √Dk + Σ_{s<l≤t} log f_l) v_s

The paper's layer: q/k/v projections with no positional encoding (the gate orders the tokens:
`rope=False` by default, `rope=True` allowed), the forget gate, the output projection (its "Pro"
block adds the output gate and norm: `out_gate=True`, `out_norm=True`). `__call__` runs the
blockwise kernel (O(T) memory, FlashAttention-style gradient); `prefill` / `step` keep a
`ForgettingCache` (keys, values, and per slot the cumulative log gate and reset count) of
`max_length` slots and read all of it per token. Packed rows reset the gate sums at each
document start. The output is not an affine map of a carried state, so there is no time split.

`forget_bias` is the gate's initial bias b_f: 0, the paper's, starts every head at f ≈ 1/2 (a
key d tokens back is down by e^(−0.69·d)); a large one starts near softmax attention. On MQAR's
400-step CPU budget the paper's start does not learn recall and b_f = 5 does (docs/studies/mqar.md,
the ``fox_bias5`` rows).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention import kernels as K
from linear_attention.kernels.softmax.gated_cache import empty_cache
from linear_attention.layers.base import Mixer
from linear_attention.layers.options import METHOD, MixerConfig, option

# The paper's (and flash-linear-attention's) forget gate starts with a zero bias: f ≈ 1/2 per
# token, so a key 40 tokens back is down by e^-28 until the bias has grown. A positive bias
# starts the layer near plain softmax attention (f = sigmoid(b)).
FORGET_BIAS = option(0.0, "initial bias of the forget gate (fox; 0: the paper's f ≈ 1/2)")
OPEN_LABEL = "fox_bias5"  # the MQAR grid's fox with the gate starting open (f ≈ 0.993)


@dataclasses.dataclass(frozen=True)
class FoxConfig(MixerConfig):
    method: str = METHOD.field("chunk", choices=K.FORGETTING.supported)
    forget_bias: float = FORGET_BIAS.field()


class FoxMixer(Mixer):
    """Forgetting attention: softmax attention with a per-head forget gate (see the module)."""

    NAME = "fox"
    FAMILY = K.FORGETTING
    OPTIONS = FoxConfig
    BLOCK = 512  # query and key block of the "chunk" kernel
    SWEEP_LABELS = {OPEN_LABEL: {"forget_bias": 5.0}}

    def _build(self, rngs: nnx.Rngs) -> None:
        self.forget_gate = nnx.Linear(
            self.d_model,
            self.num_heads,
            use_bias=True,
            bias_init=nnx.initializers.constant(self.options["forget_bias"]),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )

    def log_forget(self, x_BTD):
        """log f `[B, T, H]` (or `[B, H]`), float32."""
        return jax.nn.log_sigmoid(self.forget_gate(x_BTD).astype(jnp.float32))

    def _init_core(self, batch_size: int, max_length: int):
        dtype = jnp.dtype(self.dtype or self.param_dtype)
        h = self.num_heads
        return empty_cache(batch_size, max_length, h, self.qk_dim, self.head_dim, dtype)

    def attends_with(self, x_BTD):
        q_BTHK, k_BTHK, v_BTHD, _ = self.inputs(x_BTD, None, 0)
        q_BTHK = q_BTHK * jnp.asarray(self.qk_dim**-0.5, q_BTHK.dtype)  # logits = q·k
        return q_BTHK, k_BTHK, v_BTHD, self.log_forget(x_BTD)

    def _mix(self, x_BTD, q_BTHK, k_BTHK, v_BTHD, core, position, segments=None):
        scale = self.qk_dim**-0.5
        a_BTH = self.log_forget(x_BTD)
        if core is None:
            o = K.forgetting_attention(
                q_BTHK,
                k_BTHK,
                v_BTHD,
                a_BTH,
                scale=scale,
                method=self.options["method"],
                block_size=self.BLOCK,
                segment_ids=segments,
            )
            return o, None
        o, core = K.cached_forgetting_attention(
            core, position, q_BTHK, k_BTHK, v_BTHD, a_BTH, scale=scale
        )
        return o.astype(v_BTHD.dtype), core

    def _mix_step(self, x_BD, q_BHK, k_BHK, v_BHD, core, position):
        o_B1HD, core = self._mix(
            x_BD[:, None], q_BHK[:, None], k_BHK[:, None], v_BHD[:, None], core, position
        )
        return o_B1HD[:, 0], core
