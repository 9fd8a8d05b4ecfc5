"""transformers' initialisation of a `LanguageModel` (`ModelConfig.initializer_range` r): the
parameters drawn as `PreTrainedModel._init_weights` and the `_init_weights` of Qwen3.5 /
Qwen3-Next (`gated_deltanet` and `softmax` layers) and Mamba-2 (`gated` layers) draw them, so
that a model in a converted checkpoint's shape, trained from scratch, starts as transformers
would start it.

    every Linear kernel, the embedding           ~ N(0, r²)
    the MoE experts and router                   ~ N(0, r²)
    biases (Linear, conv), the MoE score bias    0
    norm scales                                  1   (transformers' zero-centred norms: w = 0)
    gated_deltanet layers (Qwen3.5, Qwen3-Next)  A_log = log U(0.01, 16), dt_bias = 1,
                                                 conv kernel ~ N(0, r²)
    gated layers (Mamba-2)                       A_log = log h for head h = 1..H, D = 1,
                                                 dt_bias = softplus⁻¹(dt), dt ~ logU[1e-3, 1e-1],
                                                 conv kernel ~ U(±1/√K), out_proj ~ U(±1/√fan_in)

Mamba-2's dt range is transformers' default (`time_step_min`, `time_step_max`; its floor,
1e-4, is below the range and never binds) and its out_proj is not rescaled
(`rescale_prenorm_residual=False`, the default). torch's draws cannot be reproduced bit for bit;
their distributions are.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention.layers import LayerNorm, MoE, RMSNorm, ScalarDecay, ShortConv
from linear_attention.layers.delta import GatedDeltaNetMixer
from linear_attention.layers.linear import GatedMixer
from linear_attention.layers.softmax import SoftmaxMixer

# The mixers whose transformers layers define the initialisation (the others have none here).
INIT_MIXERS = (GatedDeltaNetMixer.NAME, SoftmaxMixer.NAME, GatedMixer.NAME)
# Mamba-2's dt range at initialisation (transformers' time_step_min, time_step_max).
DT_MIN, DT_MAX = 1e-3, 1e-1
# Qwen3.5's A range: its lower end kept away from 0 so that log A stays finite.
A_MIN, A_MAX = 0.01, 16.0


class _Keys:
    """A fresh key per draw, folded from one: the draws follow the module order."""

    def __init__(self, key):
        self.key, self.count = key, 0

    def __call__(self):
        self.count += 1
        return jax.random.fold_in(self.key, self.count)


def _set(param: nnx.Param, value) -> None:
    param.set_value(jnp.asarray(value, jnp.float32).astype(param[...].dtype))


def _uniform(keys, shape, bound):
    return jax.random.uniform(keys(), shape, jnp.float32, -bound, bound)


def transformers_init(model, std: float, key) -> None:
    """Redraw every parameter of the `LanguageModel` `model` (whose layers are `INIT_MIXERS`)
    as transformers initialises its architecture (module docstring), with initializer_range
    `std`, from `key`."""
    keys = _Keys(key)
    for _, module in nnx.iter_modules(model):
        _base_rule(module, std, keys)
    for block, name in zip(model.blocks, model.config.layer_mixers, strict=True):
        decay = getattr(block.mixer, "decay", None)
        if name == GatedDeltaNetMixer.NAME and isinstance(decay, ScalarDecay):
            a = jax.random.uniform(keys(), decay.a_log[...].shape, jnp.float32, A_MIN, A_MAX)
            _set(decay.a_log, jnp.log(a))
            _set(decay.dt_bias, jnp.ones(decay.dt_bias[...].shape))
        elif name == GatedMixer.NAME:
            _mamba2_layer(block.mixer, keys)


def _zeros(param: nnx.Param | None) -> None:
    if param is not None:
        _set(param, jnp.zeros(param[...].shape))


def _base_rule(module, std: float, keys) -> None:
    """`PreTrainedModel._init_weights` on one module (Linear, conv and embedding weights and the
    experts N(0, std²), biases 0, norm scales 1); other modules are left."""

    def normal(param: nnx.Param) -> None:
        _set(param, std * jax.random.normal(keys(), param[...].shape, jnp.float32))

    if isinstance(module, nnx.Linear | ShortConv):  # (ShortConv: an nn.Conv1d)
        normal(module.kernel)
        _zeros(module.bias)
    elif isinstance(module, nnx.Embed):
        normal(module.embedding)
    elif isinstance(module, RMSNorm | LayerNorm):
        _set(module.scale, jnp.ones(module.scale[...].shape))
        _zeros(getattr(module, "bias", None))
    elif isinstance(module, MoE):
        for param in (module.w_gate, module.w_up, module.w_down):
            normal(param)
        _zeros(module.score_bias)


def _mamba2_layer(mixer, keys) -> None:
    """`Mamba2PreTrainedModel._init_weights` on a `gated` mixer: A_log, dt_bias, D, and torch's
    default (kaiming uniform) conv and out_proj."""
    decay = mixer.decay
    (heads,) = decay.a_log[...].shape
    _set(decay.a_log, jnp.log(jnp.arange(1, heads + 1, dtype=jnp.float32)))
    low, high = math.log(DT_MIN), math.log(DT_MAX)
    dt = jnp.exp(jax.random.uniform(keys(), decay.dt_bias[...].shape, jnp.float32, low, high))
    _set(decay.dt_bias, dt + jnp.log(-jnp.expm1(-dt)))  # softplus⁻¹
    if getattr(mixer, "skip", None) is not None:
        _set(mixer.skip, jnp.ones(mixer.skip[...].shape))
    conv = getattr(mixer.inputs, "conv", None)
    if conv is not None:
        _set(conv.kernel, _uniform(keys, conv.kernel[...].shape, conv.kernel_size**-0.5))
        _zeros(conv.bias)
    out = mixer.output.out_proj.kernel
    _set(out, _uniform(keys, out[...].shape, out[...].shape[0] ** -0.5))
