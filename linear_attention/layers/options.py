"""Mixer options: a typed, frozen dataclass per mixer, checked once when it is made.

`MixerConfig` holds the options every mixer takes (its parts: head size, short conv, rotary
positions, output norm and gate); a family subclasses it with its own fields, declared from
the shared `Option`s below so that an option has one type and one help text wherever it
appears (`method: str = METHOD.field(choices=...)`), and overrides the defaults of the common
ones it changes (the delta rules turn the conv on). Each registered mixer gets its own subclass
(`Mixer.Config`, made by `layers.base.Mixer`) that names it in messages.

Making a config checks every field (`fields.check_fields`: type, range, choices); None for a
field means "this mixer's default". The rules that involve the model's sizes (head width,
rotary width, grouped value heads) are `Mixer.check_config`. `ModelConfig`, the command line
(`la-train --help`) and the Linen bridge read the same dataclasses.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import numpy as np

from linear_attention.fields import POSITIVE, check_fields, fail, spec_field
from linear_attention.kernels.primitives.family import Family
from linear_attention.kernels.primitives.pallas import CHUNK_MULTIPLE


def conv_kernel_size(conv) -> int:
    """The `conv` option as a kernel size: False/0/None -> 0 (off), True -> 4, an int >= 2 ->
    itself; anything else raises (the one place of the rule)."""
    if conv is None or conv is False or conv is np.False_:
        return 0
    if conv is True or conv is np.True_:
        return 4
    is_int = isinstance(conv, int | np.integer)
    if is_int and (conv == 0 or conv >= 2):
        return int(conv)
    requirement = "a bool or an integer kernel size (0 = off, or an int >= 2)"
    fail("conv", requirement, conv, show_type=not is_int)


def required_conv(mixer: str, conv) -> int:
    """`conv_kernel_size` for a mixer whose block always has its conv (Mamba-1's, Griffin's):
    a ValueError naming the mixer when it is off."""
    size = conv_kernel_size(conv)
    if not size:
        raise ValueError(
            f"mixer {mixer!r} needs its causal conv: conv must be True or a kernel size >= 2, "
            f"got {conv!r}"
        )
    return size


def _conv(name: str, value):
    conv_kernel_size(value)
    return bool(value) if isinstance(value, bool | np.bool_) else int(value)


@dataclasses.dataclass(frozen=True)
class Option:
    """A shared option: its default and help, and its `fields.Spec` constraints; `field(...)`
    declares it in a config dataclass (with a mixer's own default or choices)."""

    default: Any = None
    help: str = ""
    spec: dict = dataclasses.field(default_factory=dict)

    def field(self, default=dataclasses.MISSING, **changes):
        default = self.default if default is dataclasses.MISSING else default
        return spec_field(default, self.help, **{**self.spec, **changes})


def option(default=None, help: str = "", **spec) -> Option:
    return Option(default, help, spec)


HEAD_DIM = option(None, "width of a head (None: d_model / num_heads)")
CONV = option(
    None, "short causal conv on q/k/v: False, True (kernel 4) or a kernel size", convert=_conv
)
OUT_NORM = option(None, "per-head RMSNorm of the output (None: the mixer's default)")
OUT_GATE = option(None, "output gate (None: the mixer's default)")
METHOD = option("chunk", "kernel algorithm")
CHUNK_SIZE = option(64, "chunk length of the chunked kernels")
EPS = option(1e-6, "denominator epsilon of normalised linear attention", **POSITIVE)
FEATURE_MAP = option(None, "fixed feature map φ")
FEATURE_DIM = option(None, "feature width (random features, projected q/k, learned φ)")
FEATURE_SCALE = option(None, "φ(c·q), φ(c·k) with this c (None: 1)", **POSITIVE)
ALLOW_NEG_EIGVAL = option(False, "β in (0, 2): negative eigenvalues of the transition")
NUM_VALUE_HEADS = option(
    None, "value heads (a multiple of num_heads; None: num_heads): grouped value heads"
)
CONV_BIAS = option(True, "the short conv has a bias (False: none, as Qwen3-Next's)")
OUT_NORM_SHARED = option(
    False, "the per-head output norm's scale is one [head_dim] shared by the heads (Qwen3-Next)"
)
STATE_DIM = option(
    None,
    "q/k width per head, the state's first axis (None: head_dim): Mamba-2's state size N, "
    "a Gated DeltaNet's key head width",
)
DT_INPUT = option(False, "k scaled by the step dt of the decay, not by Dk^-½ (Mamba-2's input)")
D_SKIP = option(False, "o + D_h·v: a learned skip per value head (Mamba-2's D)")
GATE_BEFORE_NORM = option(
    False, "the output gate multiplies before the output norm (Mamba-2's gated RMSNorm)"
)
OUT_NORM_GROUPS = option(
    None, "output norm over this many groups of the H·Dv channels (None: one per head)"
)
OUT_NORM_EPS = option(1e-6, "epsilon of the output norm", **POSITIVE)
NUM_KV_HEADS = option(
    None, "key/value heads (a divisor of num_heads; None: num_heads): grouped-query attention"
)
QK_NORM = option(False, "RMSNorm on q and k per head, one scale shared by the heads (Qwen3)")
QK_NORM_ALL_HEADS = option(
    False,
    "with qk_norm: q and k each normalised over all their heads' channels at once, one scale "
    "per channel (OLMo 2, OLMo Hybrid)",
)
ROTARY_DIM = option(
    None, "rotate only the first rotary_dim channels of q and k (None: all; needs rope)"
)
GATE_ACTIVATION = option("silu", "output gate activation (with out_gate)")
NUM_HOUSEHOLDER = option(2, "Householder (delta) steps per token")
WINDOW = option(64, "tokens each layer sees (itself and window − 1 before)")
NUM_LEVELS = option(
    15, "log-linear attention's level weights: positions below 2^(num_levels − 1)", minimum=2
)


@dataclasses.dataclass(frozen=True)
class MixerConfig:
    """The options every mixer takes; a family's config subclasses it."""

    # The mixer this config belongs to, and its kernel family (set on each registered mixer's
    # `Config`): the family's methods are the `method` field's choices, an old spelling warned
    # and translated here.
    MIXER: ClassVar[str] = ""
    FAMILY: ClassVar[Family | None] = None

    head_dim: int | None = HEAD_DIM.field()
    conv: bool | int | None = CONV.field()
    out_norm: bool = OUT_NORM.field(False)
    out_gate: bool = OUT_GATE.field(False)
    rope: bool = spec_field(False, "rotary positions on q and k")
    rope_base: float = spec_field(10000.0, "rotary base", **POSITIVE)
    reset_positions: bool = spec_field(True, "packed rows: positions restart at each document")

    def __post_init__(self):
        for field in dataclasses.fields(self):  # None: this mixer's default
            if getattr(self, field.name) is None:
                object.__setattr__(self, field.name, field.default)
        family, method = self.FAMILY, getattr(self, "method", None)
        if family is not None and method is not None:
            method = family.translate(method, f"mixer {self.MIXER!r}")
            object.__setattr__(self, "method", method)
        check_fields(self, owner=f"mixer {self.MIXER!r}")
        # (the kernels refuse it too, but only when traced: a config is refused before a compile)
        chunk = getattr(self, "chunk_size", None)
        if self.backends() and chunk % CHUNK_MULTIPLE:
            raise ValueError(
                f"chunk_size must be a multiple of {CHUNK_MULTIPLE} for mixer {self.MIXER!r} "
                f"with method={method!r} (16, 32, 48, 64, ...: its blocks tile by "
                f"{CHUNK_MULTIPLE} rows), got {chunk}"
            )

    def backends(self) -> tuple[str, ...]:
        """The Pallas backends this config's `method` needs (its family's descriptor); () where
        it runs on every backend, or the mixer has no method."""
        method = getattr(self, "method", None)
        if self.FAMILY is None or method is None:
            return ()
        return self.FAMILY.backends(method)

    @classmethod
    def own_options(cls) -> tuple[str, ...]:
        """The options this config adds to the common ones."""
        return _own_options(cls)

    @classmethod
    def defaults(cls) -> dict:
        return {f.name: f.default for f in dataclasses.fields(cls)}


COMMON_OPTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(MixerConfig))


@functools.cache
def _own_options(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in COMMON_OPTIONS)


@dataclasses.dataclass(frozen=True)
class GatedOutputConfig(MixerConfig):
    """The common options with the output norm and gate on (the gated families)."""

    out_norm: bool = OUT_NORM.field(True)
    out_gate: bool = OUT_GATE.field(True)
