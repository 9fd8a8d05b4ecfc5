"""`ModelConfig`: the frozen, validated description of a `LanguageModel`.

Training builds it from a ConfigDict at the boundary, `ModelConfig(**dict(config.model))`, so every
field is a plain Python scalar, string, tuple or mapping (a list for `mixer` is accepted and
turned into a tuple; `dtype` / `param_dtype` may be a dtype or its name and are stored as the
name). Its fields are the model's own (sizes, positions, MLP, dtypes, the options every mixer
takes); the mixers' own options are the mappings `options` and `layer_options`
(`models.options`), checked against the registered mixers' `Config` classes. The rules between
fields are `models.checks`; the old flat spelling of mixer options (`ModelConfig(state_dim=16)`,
`config.state_dim`) still works for a release, warned (`models.legacy`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from linear_attention.fields import POSITIVE, check_choice, check_fields, fail, spec_field
from linear_attention.layers import MixerConfig
from linear_attention.layers.block import NORM_POSITIONS
from linear_attention.layers.moe import ROUTERS
from linear_attention.layers.options import CONV
from linear_attention.layers.registry import DEFAULT_MIXER
from linear_attention.models import checks, legacy
from linear_attention.models import options as mixer_options
from linear_attention.models.checks import MAX_POSITION, MOE_NAMES, MOE_OPTIONS
from linear_attention.models.init import INITIALIZERS
from linear_attention.models.options import (
    BLOCK_OPTIONS,
    FrozenMapping,
    as_layer_options,
    as_options,
)

POSITIONS = ("none", "learned", "rope")
# Rematerialisation: what the backward pass keeps of each block's forward pass (see `remat`).
REMAT = ("none", "block", "dots", "dots_no_batch")
DTYPES = ("float32", "bfloat16", "float16")


def _dtype_name(name: str, value) -> str:
    try:
        dtype = jnp.dtype(value).name
    except TypeError:
        dtype = value
    return check_choice(name, dtype, DTYPES)


def _mixer_names(name: str, value):
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
    if not isinstance(value, str):
        fail(name, "a name or a tuple of names", value)
    return value


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only language model: embeddings, `num_layers` residual blocks (pre-norm by
    default), RMSNorm, the output head (its mixer options: docs/guides/options.md).

    Fields:
      vocab_size, d_model, num_layers, num_heads, head_dim (None: d_model/num_heads): sizes.
      mixer: a registry name (`layers.MIXERS`) for every layer, or a tuple of names: one per
        layer, or a shorter pattern whose length divides `num_layers`, repeated.
      conv, out_norm, out_gate, position ("rope": rotary q/k), rope_base, reset_positions: the
        options every mixer takes (None: each mixer's default).
      options: the mixers' own options, `{option: value}` (`method`, `chunk_size`, `state_dim`,
        `window`, ...: the fields of the mixers' `Config` dataclasses, in `la-train --help`);
        each goes to every layer whose mixer takes it, and must be taken by one.
      layer_options: `{mixer: {option: value}}`: the layers of that mixer take `num_heads`,
        `norm_position`, common and own options from here instead (docs/guides/options.md).
      mlp, mlp_ratio, mlp_dim: every block's SwiGLU MLP (width mlp_dim or mlp_ratio·d_model).
      num_experts, experts_per_token, moe_*: a mixture of SwiGLU experts as the MLP
        (`layers.moe`: Qwen3-Next's routing by default, DeepSeek-V3's and Kimi Linear's with the
        sigmoid router, score bias, groups; `moe_dense_layers` first layers dense;
        `moe_aux_loss_coef` weights the load-balancing loss).
      norm_position: "pre" (`x + f(norm(x))`) or "post" (`x + norm(f(x))`, OLMo 2's).
      max_length: the longest sequence (learned positions, the softmax KV cache), < 2**31.
      redraw_interval: training redraws `favor` projections every this many steps (0: never).
      dtype, param_dtype: compute and parameter dtypes (names).
      remat: what each block's backward pass keeps: "none", "block" (its input only), "dots"
        or "dots_no_batch" (matmul outputs); any but "none" scans the blocks.
      tie_embeddings: the output head shares the token embedding.
      initializer_range, initializer: transformers' initialisation (`models.init`) of the
        architecture `initializer` (None: each layer by its mixer) at this range.

    Every field is checked in `__post_init__` (`fields.check_fields`, then `models.checks` and
    `models.options`; a ValueError names the field). `mixer_config(name)` is the checked
    `Config` of a layer's mixer, made once.
    """

    vocab_size: int
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int | None = None
    mixer: str | tuple[str, ...] = spec_field(DEFAULT_MIXER, convert=_mixer_names)
    conv: bool | int | None = CONV.field()
    out_norm: bool | None = None
    out_gate: bool | None = None
    mlp: bool = True
    mlp_ratio: float = spec_field(4.0, **POSITIVE)
    mlp_dim: int | None = None
    num_experts: int = spec_field(0, minimum=0)
    experts_per_token: int | None = None
    moe_dim: int | None = None
    shared_expert_dim: int | None = None
    moe_norm_topk: bool | None = None
    moe_router: str | None = spec_field(None, choices=tuple(ROUTERS))
    moe_score_bias: bool | None = None
    moe_groups: int | None = None
    moe_topk_groups: int | None = None
    moe_routed_scale: float | None = spec_field(None, **POSITIVE)
    moe_shared_gate: bool | None = None
    moe_dense_layers: int = spec_field(0, minimum=0)
    moe_aux_loss_coef: float = spec_field(0.0, low=0.0)
    position: str = spec_field("none", choices=POSITIONS)
    rope_base: float = spec_field(10000.0, **POSITIVE)
    reset_positions: bool = True
    max_length: int = 2048
    norm_eps: float = spec_field(1e-6, **POSITIVE)
    redraw_interval: int = spec_field(0, minimum=0)
    dtype: str = spec_field("float32", convert=_dtype_name)
    param_dtype: str = spec_field("float32", convert=_dtype_name)
    tie_embeddings: bool = True
    initializer_range: float | None = spec_field(None, **POSITIVE)
    initializer: str | None = spec_field(None, choices=tuple(INITIALIZERS))
    norm_position: str = spec_field("pre", choices=NORM_POSITIONS)
    remat: str = spec_field("none", choices=REMAT)
    layer_options: FrozenMapping = spec_field(FrozenMapping(), convert=as_layer_options)
    options: FrozenMapping = spec_field(FrozenMapping(), convert=as_options)

    def __post_init__(self):
        check_fields(self)
        checks.check_model(self)
        mixers = dict.fromkeys(self.layer_mixers)
        mixer_options.check_layer_options(self.layer_options, mixers)
        mixer_options.check_options(self.options, mixers)
        configs = mixer_options.mixer_configs(self, mixers)
        object.__setattr__(self, "_mixer_configs", configs)
        checks.check_levels(self, configs)
        converted = mixer_options.converted(self.options, configs, self.layer_options)
        object.__setattr__(self, "options", converted)

    def __getattr__(self, name):  # (a name that is no attribute: an old flat option?)
        if legacy.is_moved(name):
            return legacy.read(self, name)
        raise AttributeError(f"'ModelConfig' object has no attribute {name!r}")

    @property
    def moe_options(self) -> dict | None:
        """`layers.moe.MoE` keyword arguments of every block's MLP, or None (a SwiGLU)."""
        return checks.moe_options(self)

    def layer_moe_options(self, index: int) -> dict | None:
        """`moe_options` for layer `index`, or None where its MLP is dense (`moe_dense_layers`
        first, or no experts)."""
        return None if index < self.moe_dense_layers else self.moe_options

    def layer_num_heads(self, name: str) -> int:
        """The heads of the layers of mixer `name` (`layer_options`, else `num_heads`)."""
        return self.layer_options.get(name, {}).get("num_heads", self.num_heads)

    def layer_norm_position(self, name: str) -> str:
        """Where the norms of the layers of mixer `name` sit (`layer_options`, else
        `norm_position`)."""
        return self.layer_options.get(name, {}).get("norm_position", self.norm_position)

    @property
    def layer_mixers(self) -> tuple[str, ...]:
        """The mixer name of every layer (the pattern repeated to `num_layers`)."""
        if isinstance(self.mixer, str):
            return (self.mixer,) * self.num_layers
        return self.mixer * (self.num_layers // len(self.mixer))

    def mixer_options(self, name: str) -> dict:
        """Keyword options of the layers of mixer `name` (`models.options.mixer_options`)."""
        return mixer_options.mixer_options(self, name)

    def mixer_config(self, name: str) -> MixerConfig:
        """The checked `Config` of mixer `name` (one of this model's), made once."""
        return self._mixer_configs[name]

    @property
    def backend_layers(self) -> dict[str, tuple[str, ...]]:
        """The layer mixers whose `method` needs a Pallas backend, with the backends it has
        (its family's descriptor, `MixerConfig.backends`), in layer order."""
        names = dict.fromkeys(self.layer_mixers)
        return {n: b for n in names if (b := self.mixer_config(n).backends())}

    @property
    def uses_pallas(self) -> bool:
        """Whether some layer runs the Pallas kernels (`backend_layers`)."""
        return bool(self.backend_layers)

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def parameter_dtype(self):
        return jnp.dtype(self.param_dtype)


# The old flat mixer options (`ModelConfig(state_dim=16)`) still work for a release, warned.
_dataclass_init = ModelConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args, **kwargs):
    _dataclass_init(self, *args, **legacy.move_options(kwargs))


ModelConfig.__init__ = _init
__all__ = ["BLOCK_OPTIONS", "MAX_POSITION", "MOE_NAMES", "MOE_OPTIONS", "ModelConfig"]
