"""Griffin's recurrent block (`rglru`, De et al. 2024), RecurrentGemma's temporal mixing, on the
RG-LRU (`kernels.rg_lru`).

With W = `lru_width` channels in H = num_heads blocks of W/H, per token:

    y   = gelu(x_t W_y + b_y)                                    [W]  the gate branch
    u   = conv(x_t W_x + b_x)                                    causal depthwise, kernel 4, bias
    i_t = σ(u W_i + b_i),  r_t = σ(u W_a + b_a)                  block-diagonal [H, W/H, W/H]
    log a_t = −8 · r_t · softplus(Λ)                             [W] ≤ 0, float32
    h_t = a_t ⊙ h_{t−1} + √(1 − a_t²) ⊙ (i_t ⊙ u_t)              (the RG-LRU; x unscaled at a reset)
    out = (h_t ⊙ y) W_out + b_out

(gelu: the tanh approximation, transformers' `gelu_pytorch_tanh`.) The parameters are
transformers' `RecurrentGemmaRecurrentBlock`'s, named as there (`linear_y`, `linear_x`,
`conv_1d`, the RG-LRU's `input_gate_weight` / `_bias`, `recurrent_gate_weight` / `_bias` and
`recurrent_param` Λ), except `linear_out`, called `out_proj` as every mixer's last projection
(tensor parallelism splits it by rows). Their initialisation is transformers': `linear_x`,
`linear_y` N(0, 1/d_model), the conv N(0, 0.01/4), the gates N(0, 0.01·H/W), the biases 0, and
Λ such that a = exp(−softplus(Λ)) ~ √U(0.81, 0.998) (a between 0.9 and 0.999);
`out_proj` the project's default (transformers scales it by the depth, which a mixer does not
know).

A reset is a token at position 0: the first token of a sequence and, in packed rows, of every
document (as RecurrentGemma's `position_ids == 0`): the state is zeroed and the input written
unscaled. The mixer folds it into log a as −inf (the kernel's one reset mechanism), so the whole
sequence, a prefill from position 0 and a step at position 0 agree.

The decoding state is the RG-LRU's `[B, W]` float32 and the conv's tail `[B, 3, W]`: O(1) in
the context. Time splits over a mesh axis (the conv's halo, the RG-LRU's affine combine).

Not taken (`NOT_TAKEN`): `rope`, `out_norm`, `out_gate` (the gate branch is always on) and
`head_dim` (num_heads only blocks the gates).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention import kernels as K
from linear_attention.fields import spec_field
from linear_attention.layers.base import Mixer
from linear_attention.layers.conv import ShortConv
from linear_attention.layers.options import CONV, METHOD, MixerConfig, required_conv
from linear_attention.layers.segments import Segments
from linear_attention.layers.sequence import sequence_axis

# Griffin's constant c of a = σ(Λ)^(c·r) (transformers: log a = −8 · r · softplus(Λ)).
GATE_POWER = 8.0
# transformers' w_init_variance_scale (the conv's and the gates' N(0, scale / fan_in)).
W_INIT_SCALE = 0.01
# The range of a at initialisation, squared (transformers: a² ~ U(0.9², 0.999²)).
A2_MIN, A2_MAX = 0.9**2, 0.999**2


def recurrent_param_init(key, shape, dtype=jnp.float32):
    """Λ with exp(−softplus(Λ)) = √u, u ~ U(0.9², 0.999²): Λ = log(1/√u − 1)."""
    u = jax.random.uniform(key, shape, jnp.float32, A2_MIN, A2_MAX)
    return jnp.log(jax.lax.rsqrt(u) - 1.0).astype(dtype)


@dataclasses.dataclass(frozen=True)
class RGLRUConfig(MixerConfig):
    conv: bool | int | None = CONV.field(4)
    method: str = METHOD.field("scan", choices=K.RG_LRU.supported)
    lru_width: int | None = spec_field(
        None, "channels of Griffin's recurrent block (None: d_model), a multiple of num_heads"
    )


class RGLRUInputs(nnx.Module):
    """The two branches: `(gelu(x W_y + b_y), conv(x W_x + b_x), tail)`, each `[B, T, W]`."""

    def __init__(self, d_model, width, conv, *, dtype, param_dtype, rngs):
        normal = nnx.initializers.normal(d_model**-0.5)
        linear = dict(kernel_init=normal, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.linear_y = nnx.Linear(d_model, width, **linear)
        self.linear_x = nnx.Linear(d_model, width, **linear)
        self.conv_1d = ShortConv(
            width,
            conv,
            activation="identity",
            kernel_std=math.sqrt(W_INIT_SCALE / conv),
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def init_state(self, batch_size: int) -> jax.Array:
        return self.conv_1d.init_state(batch_size)

    def __call__(self, x_BTD, tail, segments: Segments | None = None):
        y_BTW = jax.nn.gelu(self.linear_y(x_BTD), approximate=True)
        ids = None if segments is None else segments.ids
        u_BTW, tail = self.conv_1d.sequence(self.linear_x(x_BTD), tail, ids)
        return y_BTW, u_BTW, tail


class RGLRUMixer(Mixer):
    """Griffin's recurrent block: gate branch, conv, RG-LRU, out_proj (module docstring)."""

    NAME = "rglru"
    FAMILY = K.RG_LRU
    OPTIONS = RGLRUConfig
    SEQUENCE_PARALLEL = True
    NOT_TAKEN = dict(
        rope="the recurrence orders the tokens (no positions)",
        out_norm="its output is gated by the gelu branch, not normalised",
        out_gate="its gelu gate branch is always on",
        head_dim="its heads block the gates of lru_width channels",
    )

    @classmethod
    def _check_family_options(cls, num_heads, options) -> None:
        required_conv(cls.NAME, options["conv"])
        width = options["lru_width"]
        if width is not None and width % num_heads:
            raise ValueError(
                f"lru_width={width} must be a multiple of num_heads={num_heads} (mixer "
                f"{cls.NAME!r}: its gates are block-diagonal over the heads)"
            )

    def _build_inputs(self, rngs: nnx.Rngs) -> nnx.Module:
        opts = self.options
        self.width = opts["lru_width"] or self.d_model  # (d_model: a multiple of num_heads)
        return RGLRUInputs(
            self.d_model,
            self.width,
            required_conv(self.NAME, opts["conv"]),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )

    def _build_output(self, rngs: nnx.Rngs) -> None:
        return None  # (`out_proj`, made in `_build`)

    def _build(self, rngs: nnx.Rngs) -> None:
        h, w = self.num_heads, self.width
        self.method = self.options["method"]
        bw = w // h
        normal = nnx.initializers.normal(math.sqrt(W_INIT_SCALE / bw))
        weight = lambda: nnx.Param(normal(rngs.params(), (h, bw, bw), self.param_dtype))  # noqa: E731
        bias = lambda: nnx.Param(jnp.zeros((h, bw), self.param_dtype))  # noqa: E731
        self.input_gate_weight, self.input_gate_bias = weight(), bias()
        self.recurrent_gate_weight, self.recurrent_gate_bias = weight(), bias()
        self.recurrent_param = nnx.Param(
            recurrent_param_init(rngs.params(), (w,), self.param_dtype)
        )
        self.out_proj = nnx.Linear(
            w, self.d_model, dtype=self.dtype, param_dtype=self.param_dtype, rngs=rngs
        )

    def _flops_sizes(self) -> dict:
        return dict(width=self.width)

    def _init_core(self, batch_size: int, max_length: int) -> jax.Array:
        del max_length  # the state does not grow with the context
        return jnp.zeros((batch_size, self.width), jnp.float32)

    def gates(self, u_BTW):
        """`(i, log a)`: the input gate and the log decay `[B, T, W]`, float32."""
        b, t, w = u_BTW.shape
        u_BTHC = u_BTW.reshape(b, t, self.num_heads, -1).astype(jnp.float32)

        def gate(weight, bias):
            z = jnp.einsum("bthc,hcd->bthd", u_BTHC, weight[...].astype(jnp.float32))
            return jax.nn.sigmoid(z + bias[...].astype(jnp.float32)).reshape(b, t, w)

        i_BTW = gate(self.input_gate_weight, self.input_gate_bias)
        r_BTW = gate(self.recurrent_gate_weight, self.recurrent_gate_bias)
        rate_W = jax.nn.softplus(self.recurrent_param[...].astype(jnp.float32))
        return i_BTW, -GATE_POWER * r_BTW * rate_W

    def _forward(self, x_BTD, tail, core, position, segments=None, *, step: bool = False):
        y_BTW, u_BTW, tail = self.inputs(x_BTD, tail, segments)
        i_BTW, log_a_BTW = self.gates(u_BTW)
        # a reset at position 0 (of the sequence, or of each packed document): −inf
        t = x_BTD.shape[1]
        resets_BT = (position + jnp.arange(t, dtype=jnp.int32) == 0)[None]
        if segments is not None:
            resets_BT = resets_BT | segments.starts
        log_a_BTW = jnp.where(resets_BT[..., None], -jnp.inf, log_a_BTW)
        x_BTW = (i_BTW * u_BTW).astype(u_BTW.dtype)
        if step:
            h_BW, core = K.rg_lru_step(x_BTW[:, 0], log_a_BTW[:, 0], core)
            h_BTW = h_BW[:, None]
        else:
            h_BTW, h_BW = K.rg_lru(
                x_BTW, log_a_BTW, initial_state=core, method=self.method,
                axis_name=sequence_axis(),
            )  # fmt: skip
            core = None if core is None else h_BW
        return self.out_proj(h_BTW * y_BTW), core, tail


__all__ = ["RGLRUMixer", "recurrent_param_init"]
