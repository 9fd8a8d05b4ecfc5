"""transformers' initialisation of a `LanguageModel` (`ModelConfig.initializer_range` r): the
parameters drawn as `PreTrainedModel._init_weights` and the `_init_weights` of the architecture
named by `ModelConfig.initializer` draw them (None: each layer by its mixer's architecture,
`DEFAULT_INITIALIZER`), so that a model in a converted checkpoint's shape, trained from scratch,
starts as transformers would start it.

    every Linear kernel, the embedding           ~ N(0, r²)
    the MoE experts and router                   ~ N(0, r²)
    biases (Linear, conv), the MoE score bias    0
    norm scales                                  1   (transformers' zero-centred norms: w = 0)
    gated_deltanet, Qwen3.5 / Qwen3-Next         A_log = log U(0.01, 16), dt_bias = 1,
                                                 conv kernel ~ N(0, r²)
    gated_deltanet, OLMo Hybrid                  A_log = log U(0, 16), dt_bias = softplus⁻¹(dt),
                                                 conv kernel ~ N(0, r²)
    kda, Kimi Linear                             A_log = log U(1, 16), dt_bias = softplus⁻¹(dt)
                                                 per channel, conv kernel ~ N(0, r²)
    gated, Mamba-2                               A_log = log h for head h = 1..H, D = 1,
                                                 dt_bias = softplus⁻¹(dt),
                                                 conv kernel ~ U(±1/√K), out_proj ~ U(±1/√fan_in)
    gated, Bamba                                 A_log = log h for head h = 1..H, D = 1,
                                                 dt_bias = 1, conv kernel and out_proj ~ N(0, r²)
    mamba, Mamba-1                               A_log = log n for n = 1..N on every channel,
                                                 D = 1, dt_proj kernel ~ U(±1/√R), its bias
                                                 softplus⁻¹(dt), conv kernel and out_proj
                                                 ~ U(±1/√fan_in)
    softmax (Qwen3.5, OLMo Hybrid, Bamba), mla   the rules above only

Everywhere dt = max(exp(U(log 1e-3, log 1e-1)), 1e-4): transformers' default range
(`time_step_min`, `time_step_max`, OLMo Hybrid's `linear_dt_min`, `linear_dt_max`) and floor
(below the range, so it never binds). Mamba-2's out_proj is not rescaled
(`rescale_prenorm_residual=False`, the default). torch's draws cannot be reproduced bit for bit;
their distributions are.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention.layers import LayerNorm, MoE, RMSNorm, ScalarDecay, ShortConv
from linear_attention.layers.delta import GatedDeltaNetMixer
from linear_attention.layers.kda import KDAMixer
from linear_attention.layers.linear import GatedMixer
from linear_attention.layers.mamba import MambaMixer
from linear_attention.layers.mla import MLAMixer
from linear_attention.layers.softmax import SoftmaxMixer

GDN, SOFTMAX, GATED = GatedDeltaNetMixer.NAME, SoftmaxMixer.NAME, GatedMixer.NAME
KDA, MLA, MAMBA = KDAMixer.NAME, MLAMixer.NAME, MambaMixer.NAME
# The architectures whose `_init_weights` the initialisation follows, with their layers' mixers.
INITIALIZERS = {
    "qwen3_5": (GDN, SOFTMAX),
    "mamba2": (GATED,),
    "kimi_linear": (KDA, MLA),
    "olmo_hybrid": (GDN, SOFTMAX),
    "bamba": (GATED, SOFTMAX),
    "mamba": (MAMBA,),
}
# `ModelConfig.initializer` None: each layer initialised as in this architecture.
DEFAULT_INITIALIZER = {
    GDN: "qwen3_5",
    SOFTMAX: "qwen3_5",
    GATED: "mamba2",
    KDA: "kimi_linear",
    MLA: "kimi_linear",
    MAMBA: "mamba",
}
# The mixers whose transformers layers define the initialisation (the others have none here).
INIT_MIXERS = tuple(DEFAULT_INITIALIZER)
# The dt range at initialisation (transformers' time_step_min, time_step_max) and its floor.
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4
# Qwen3.5's A range: its lower end kept away from 0 so that log A stays finite.
A_MIN, A_MAX = 0.01, 16.0
# OLMo Hybrid's A range (its linear_a_log_min, linear_a_log_max defaults) and Kimi Linear's.
OLMO_A_MIN, OLMO_A_MAX = 0.0, 16.0
KIMI_A_MIN, KIMI_A_MAX = 1.0, 16.0


def transformers_init(model, std: float, key, initializer: str | None = None) -> None:
    """Redraw every parameter of the `LanguageModel` `model` (whose layers are `INIT_MIXERS`)
    as transformers initialises the architecture `initializer` (a key of `INITIALIZERS`; None:
    each layer's by `DEFAULT_INITIALIZER`; module docstring), with initializer_range `std`, from
    `key`."""
    plan = []  # (parameter, rule), in module order; a later rule for a parameter replaces it
    for _, module in nnx.iter_modules(model):
        plan += _base_rule(module, std)
    for block, name in zip(model.blocks, model.config.layer_mixers, strict=True):
        plan += _layer_rule(block.mixer, name, initializer or DEFAULT_INITIALIZER[name])
    values = _draw(key, [rule for _, rule in plan])
    for (param, _), value in zip(plan, values, strict=True):
        param.set_value(jnp.asarray(value, param[...].dtype))


def _draw(key, rules: list) -> list:
    """The values of `rules` ((kind, shape, *arguments) each), in order. Eagerly from a NumPy
    generator seeded by the JAX key: JAX's sampler would compile for every parameter shape
    (seconds for a small model on a CPU core); inside a trace (`nnx.eval_shape`, a jit) from
    JAX's, which compiles with the rest."""
    if isinstance(key, jax.core.Tracer):
        keys, xp = iter(jax.random.split(key, len(rules))), jnp

        def normal(shape):
            return jax.random.normal(next(keys), shape, jnp.float32)

        def uniform(shape):
            return jax.random.uniform(next(keys), shape, jnp.float32)

    else:
        typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
        rng = np.random.default_rng(np.asarray(jax.random.key_data(key) if typed else key).ravel())
        xp, normal, uniform = np, rng.standard_normal, rng.random
    out = []
    for kind, shape, *args in rules:
        match kind:
            case "normal":
                out.append(_transform(xp, normal(shape), *args))
            case "uniform":
                out.append(_transform(xp, uniform(shape), *args))
            case "constant":
                out.append(xp.full(shape, args[0], xp.float32))
            case "log_arange":  # log n, n = 1.. along the last axis
                row = xp.log(xp.arange(1, shape[-1] + 1, dtype=xp.float32))
                out.append(xp.broadcast_to(row, shape))
            case _:
                raise ValueError(f"rule kind {kind!r}: known normal, uniform, constant, log_arange")
    return out


def _transform(xp, x, how: str, *args):
    """A standard normal or uniform draw `x` made the parameter's distribution (`xp`: NumPy or
    jax.numpy)."""
    match how:
        case "scale":  # N(0, std²)
            return args[0] * x
        case "range":  # U(low, high)
            low, high = args
            return low + (high - low) * x
        case "log":  # log U(low, high): A_log for A ~ U(low, high) (A = 0: log A = -inf)
            low, high = args
            with np.errstate(divide="ignore"):
                return xp.log(low + (high - low) * x)
        case "dt_bias":  # softplus⁻¹(dt), dt = max(exp U(log DT_MIN, log DT_MAX), DT_FLOOR)
            low, high = math.log(DT_MIN), math.log(DT_MAX)
            dt = xp.maximum(xp.exp(low + (high - low) * x), DT_FLOOR)
            return dt + xp.log(-xp.expm1(-dt))
        case _:
            raise ValueError(f"transform {how!r}: known scale, range, log, dt_bias")


def _shape(param: nnx.Param) -> tuple[int, ...]:
    return tuple(param[...].shape)


def _normal(param, std: float):
    return param, ("normal", _shape(param), "scale", std)


def _uniform(param, low: float, high: float, how: str = "range"):
    return param, ("uniform", _shape(param), how, low, high)


def _constant(param, value: float):
    return param, ("constant", _shape(param), value)


def _dt_bias(param):
    return param, ("uniform", _shape(param), "dt_bias")


def _layer_rule(mixer, name: str, initializer: str) -> list:
    """The architecture's own `_init_weights` on the mixer `mixer` (of the registered `name`),
    after the base rule: (parameter, rule) pairs."""
    match initializer, name:
        case "qwen3_5", GatedDeltaNetMixer.NAME if isinstance(mixer.decay, ScalarDecay):
            return [
                _uniform(mixer.decay.a_log, A_MIN, A_MAX, "log"),
                _constant(mixer.decay.dt_bias, 1.0),
            ]
        case "qwen3_5", GatedDeltaNetMixer.NAME:  # (a per-channel decay: not Qwen3.5's)
            return []
        case "olmo_hybrid", GatedDeltaNetMixer.NAME:
            return [
                _uniform(mixer.decay.a_log, OLMO_A_MIN, OLMO_A_MAX, "log"),
                _dt_bias(mixer.decay.dt_bias),
            ]
        case "kimi_linear", KDAMixer.NAME:
            return [
                _uniform(mixer.decay.a_log, KIMI_A_MIN, KIMI_A_MAX, "log"),
                _dt_bias(mixer.decay.dt_bias),
            ]
        case "mamba2", GatedMixer.NAME:
            return _mamba2_layer(mixer)
        case "mamba", MambaMixer.NAME:
            return _mamba_layer(mixer)
        case "bamba", GatedMixer.NAME:
            rules = [
                (mixer.decay.a_log, ("log_arange", _shape(mixer.decay.a_log))),
                _constant(mixer.decay.dt_bias, 1.0),
            ]
            return rules + ([] if mixer.skip is None else [_constant(mixer.skip, 1.0)])
        case ("qwen3_5" | "olmo_hybrid" | "bamba", SoftmaxMixer.NAME) | (
            "kimi_linear",
            MLAMixer.NAME,
        ):
            return []  # (Linear layers and norms only: the base rule)
        case _:
            raise ValueError(
                f"initializer={initializer!r} has no {name!r} layers; its mixers: "
                f"{', '.join(INITIALIZERS.get(initializer, ()))}"
            )


def _zeros(param: nnx.Param | None) -> list:
    return [] if param is None else [_constant(param, 0.0)]


def _base_rule(module, std: float) -> list:
    """`PreTrainedModel._init_weights` on one module (Linear, conv and embedding weights and the
    experts N(0, std²), biases 0, norm scales 1): (parameter, rule) pairs; none for other
    modules."""
    if isinstance(module, nnx.Linear | ShortConv):  # (ShortConv: an nn.Conv1d)
        return [_normal(module.kernel, std), *_zeros(module.bias)]
    if isinstance(module, nnx.Embed):
        return [_normal(module.embedding, std)]
    if isinstance(module, RMSNorm | LayerNorm):
        return [_constant(module.scale, 1.0), *_zeros(getattr(module, "bias", None))]
    if isinstance(module, MoE):
        experts = [_normal(p, std) for p in (module.w_gate, module.w_up, module.w_down)]
        return experts + _zeros(module.score_bias)
    return []


def _mamba2_layer(mixer) -> list:
    """`Mamba2PreTrainedModel._init_weights` on a `gated` mixer: A_log, dt_bias, D, and torch's
    default (kaiming uniform) conv and out_proj."""
    a_log = mixer.decay.a_log
    rules = [(a_log, ("log_arange", _shape(a_log))), _dt_bias(mixer.decay.dt_bias)]
    if getattr(mixer, "skip", None) is not None:
        rules.append(_constant(mixer.skip, 1.0))
    conv = getattr(mixer.inputs, "conv", None)
    if conv is not None:
        rules += [_torch_default(conv.kernel), *_zeros(conv.bias)]
    return [*rules, _torch_default(mixer.output.out_proj.kernel)]


def _torch_default(param) -> tuple:
    """torch's default (kaiming uniform, a = √5) of a kernel `[fan_in, …]` or a conv's `[K, C]`
    (fan in K): U(±1/√fan_in)."""
    bound = _shape(param)[0] ** -0.5
    return _uniform(param, -bound, bound)


def _mamba_layer(mixer) -> list:
    """`MambaPreTrainedModel._init_weights` on a `mamba` mixer: A_log, D, dt_proj, and torch's
    default conv and out_proj."""
    bound = mixer.dt_rank**-0.5
    conv = mixer.inputs.conv1d
    return [
        (mixer.A_log, ("log_arange", _shape(mixer.A_log))),
        _constant(mixer.D, 1.0),
        _uniform(mixer.dt_proj.kernel, -bound, bound),
        _dt_bias(mixer.dt_proj.bias),
        _torch_default(conv.kernel),
        *_zeros(conv.bias),
        _torch_default(mixer.out_proj.kernel),
    ]
