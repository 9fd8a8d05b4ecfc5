"""LSTM (`lstm`, Hochreiter & Schmidhuber 1997): a nonlinear recurrent mixer, the positive
control for state tracking.

One LSTM cell per head, of width Dh = head_dim (num_heads = 1: one cell of width d_model); a
head's recurrent matrix sees only its own head (block-diagonal over heads, as xLSTM's sLSTM),
so the heads are independent cells, in PyTorch's gate order (i, f, g, o):

    z_t = x_t W + b + h_{t−1} R_h          W [D, H·4·Dh], R_h [Dh, 4·Dh] per head
    i = σ(z_i),  f = σ(z_f),  g = tanh(z_g),  o = σ(z_o)
    c_t = f ⊙ c_{t−1} + i ⊙ g,      h_t = o ⊙ tanh(c_t)
    y_t = out(h_t)                        the shared `OutputStage` (projection; norm, gate off)

The forget gate's bias starts at +1 (Gers et al. 2000; Jozefowicz et al. 2015), the other
biases at 0; R is uniform in ±1/√Dh (PyTorch's `nn.LSTM`), W the project's default.

It is sequential: the gates read h_{t−1} through a nonlinearity, so there is no parallel or
chunked form and no time split (`SEQUENCE_PARALLEL = False`: the config refuses mesh.seq > 1).
All three paths run the same `jax.lax.scan` over time (`step` is its body once). The decoding
state is `LSTMState(h, c)`, each `[B, H, Dh]` float32, whatever the context; the recurrence
runs in float32 whatever the compute dtype, and h goes to the output stage in the compute
dtype. Packed rows: (h, c) is zeroed before every document start (`segments.starts`).

Not taken (`NOT_TAKEN`): `conv` and `rope` (the recurrence orders the tokens and is its own
local context); there are no q/k/v, so `_forward` is overridden as in rwkv7.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention.layers.base import Mixer
from linear_attention.layers.options import CONV, MixerConfig

FORGET_BIAS = 1.0  # the forget gate's initial bias
GATES = 4  # i, f, g, o


class LSTMState(NamedTuple):
    """The LSTM's decoding state: hidden `h` and cell `c`, each `[B, H, Dh]` float32."""

    h: jax.Array
    c: jax.Array


@dataclasses.dataclass(frozen=True)
class LSTMConfig(MixerConfig):
    conv: bool | int | None = CONV.field(False)


class GateInputs(nnx.Module):
    """The input half of the gates, x W + b `[B, T, H, 4, Dh]` (no conv: no tail to carry)."""

    def __init__(self, d_model, num_heads, head_dim, *, dtype, param_dtype, rngs):
        self.num_heads, self.head_dim = num_heads, head_dim
        bias = jnp.zeros((num_heads, GATES, head_dim)).at[:, 1].set(FORGET_BIAS)
        self.proj = nnx.Linear(
            d_model,
            num_heads * GATES * head_dim,
            use_bias=True,
            bias_init=lambda *_: bias.reshape(-1).astype(param_dtype),
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def init_state(self, batch_size: int) -> None:
        del batch_size
        return None

    def __call__(self, x_BTD):
        b, t, _ = x_BTD.shape
        return self.proj(x_BTD).reshape(b, t, self.num_heads, GATES, self.head_dim)


def lstm_scan(z_BTHGD, recurrent_HDG, state: LSTMState, starts_BT=None):
    """The LSTM recurrence over time from `state`, in float32: `(h [B, T, H, Dh], final
    state)`; `z` the input half of the gates, `recurrent` `[H, Dh, 4·Dh]`; `starts` (bool
    `[B, T]` or None) zero the state before a document's first token."""
    b, t, h, _, d = z_BTHGD.shape
    r = recurrent_HDG.astype(jnp.float32)
    z_TBHGD = jnp.swapaxes(z_BTHGD.astype(jnp.float32), 0, 1)
    starts_TB = jnp.zeros((t, b), bool) if starts_BT is None else jnp.swapaxes(starts_BT, 0, 1)

    def body(carry, inputs):
        h_BHD, c_BHD = carry
        z_BHGD, start_B = inputs
        keep = (~start_B)[:, None, None]
        h_BHD, c_BHD = jnp.where(keep, h_BHD, 0.0), jnp.where(keep, c_BHD, 0.0)
        z = z_BHGD + jnp.einsum("bhd,hdg->bhg", h_BHD, r).reshape(b, h, GATES, d)
        i, f, o = (jax.nn.sigmoid(z[:, :, j]) for j in (0, 1, 3))
        c_BHD = f * c_BHD + i * jnp.tanh(z[:, :, 2])
        h_BHD = o * jnp.tanh(c_BHD)
        return (h_BHD, c_BHD), h_BHD

    (h_last, c_last), h_TBHD = jax.lax.scan(body, (state.h, state.c), (z_TBHGD, starts_TB))
    return jnp.swapaxes(h_TBHD, 0, 1), LSTMState(h_last, c_last)


class LSTMMixer(Mixer):
    """An LSTM cell per head, run by `lax.scan` over time (see the module): sequential."""

    NAME = "lstm"
    OPTIONS = LSTMConfig
    SEQUENCE_PARALLEL = False  # a nonlinear recurrence: no parallel form, no time split
    NOT_TAKEN = dict(
        conv="the recurrence is its own local context",
        rope="the recurrence orders the tokens (no positions)",
    )

    def _build_inputs(self, rngs: nnx.Rngs) -> nnx.Module:
        return GateInputs(
            self.d_model,
            self.num_heads,
            self.head_dim,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )

    def _build(self, rngs: nnx.Rngs) -> None:
        d = self.head_dim
        shape = (self.num_heads, d, GATES * d)
        bound = d**-0.5
        init = jax.random.uniform(rngs.params(), shape, jnp.float32, -bound, bound)
        self.recurrent = nnx.Param(init.astype(self.param_dtype))

    def mixing_flops(self, seq_len: int, *, method=None, chunk_size=None) -> float:
        """8·H·Dh² per token: h_{t−1} R, a [Dh] × [Dh, 4·Dh] product per head (the input half
        x W is a projection counted with the matmuls; the gates are elementwise)."""
        del seq_len, method, chunk_size  # the same cost per token at any length
        return 8.0 * self.num_heads * self.head_dim**2

    def _init_core(self, batch_size: int, max_length: int) -> LSTMState:
        del max_length  # the state does not grow with the context
        zeros = jnp.zeros((batch_size, self.num_heads, self.head_dim), jnp.float32)
        return LSTMState(zeros, zeros)

    def _forward(self, x_BTD, tail, core, position, segments=None, *, step: bool = False):
        del position, step  # no positions; one token is a scan of length 1
        z = self.inputs(x_BTD)
        starts = None if segments is None else segments.starts
        state = self._init_core(x_BTD.shape[0], 1) if core is None else core
        h_BTHD, state = lstm_scan(z, self.recurrent[...], state, starts)
        y = self.output(x_BTD, h_BTHD.astype(z.dtype))
        return y, (None if core is None else state), tail


__all__ = ["LSTMMixer", "LSTMState", "lstm_scan"]
