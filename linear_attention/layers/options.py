"""Mixer options: each mixer declares the options it reads, once, beside its class.

A mixer class has `OPTIONS: dict[name, Option]`: the option's Python type, its default for that
mixer, a one-line help text and its allowed values. `check_options` validates keyword options
against that table: an option the mixer does not declare raises a ValueError naming the option
and the mixer (never a bare TypeError), a value of the wrong type or outside its range raises
naming the option and the allowed values, and the defaults are filled in. `ModelConfig`, the
command line (`la-train --help`) and the Linen bridge read the same tables (`option_table`), so
an option's type and default are written once.

The options shared by every mixer (`COMMON_OPTIONS`: head size, short conv, rotary positions,
output norm and gate) are the parts of `layers.base.Mixer`; a mixer overrides their defaults
(`DEFAULTS`), e.g. the delta-rule mixers turn the conv on.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Option:
    """One option: `type` (int, float, bool or str), `default` (None: "not set", the part
    decides), `help`, and constraints: `minimum` (numbers), `choices` (strings), `optional`
    (None is a valid value), or `check(value)` raising ValueError for anything more."""

    type: type
    default: Any = None
    help: str = ""
    minimum: float | None = None
    positive: bool = False
    choices: tuple | None = None
    optional: bool = False
    check: Callable[[Any], None] | None = None

    def with_default(self, default) -> Option:
        return dataclasses.replace(self, default=default)

    def but(self, **changes) -> Option:
        """This option with some fields changed (e.g. a mixer's own `choices`)."""
        return dataclasses.replace(self, **changes)

    def validate(self, name: str, value, mixer: str):
        """`value` as this option's Python type; ValueError naming `name` if it is not valid."""
        if value is None and (self.optional or self.default is None):
            return None
        if self.type is bool:
            if not isinstance(value, bool | np.bool_):
                raise ValueError(f"{name} must be a bool, got {value!r}")
            value = bool(value)
        elif self.type is int:
            if not isinstance(value, int | np.integer) or isinstance(value, bool | np.bool_):
                raise ValueError(f"{name} must be an integer >= {self.minimum}, got {value!r}")
            value = int(value)
        elif self.type is float:
            ok = isinstance(value, int | float | np.integer | np.floating)
            if not ok or isinstance(value, bool | np.bool_) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
            value = float(value)
        elif self.type is str:
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {value!r}")
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"{name} must be an integer >= {self.minimum}, got {value!r}")
        if self.positive and not value > 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(
                f"unknown {name} {value!r} for mixer {mixer!r}; allowed: {', '.join(self.choices)}"
            )
        if self.check is not None:
            self.check(value)
        return value


def check_conv(value) -> None:
    if value is True or value is False or value == 0 or value >= 2:
        return
    raise ValueError(
        f"conv must be a bool or a kernel size (0 = off, or an int >= 2), got {value!r}"
    )


def conv_kernel_size(conv) -> int:
    """`conv` option to a kernel size: False/0/None -> 0 (off), True -> 4, an int >= 2 -> itself."""
    if conv is None or conv is False:
        return 0
    if conv is True:
        return 4
    if isinstance(conv, int | np.integer) and not isinstance(conv, bool | np.bool_):
        check_conv(int(conv))
        return int(conv)
    raise ValueError(
        f"conv must be a bool or a kernel size (0 = off, or an int >= 2), got {conv!r}"
    )


class _ConvOption(Option):
    def validate(self, name, value, mixer):
        if value is None:
            return None
        conv_kernel_size(value)
        return bool(value) if isinstance(value, bool | np.bool_) else int(value)


# Options every mixer takes (its parts: projections, conv, rotary, output stage).
COMMON_OPTIONS: dict[str, Option] = {
    "head_dim": Option(int, None, "width of a head (None: d_model / num_heads)", minimum=1),
    "conv": _ConvOption(
        int, None, "short causal conv on q/k/v: False, True (kernel 4) or a kernel size"
    ),
    "out_norm": Option(bool, None, "per-head RMSNorm of the output (None: the mixer's default)"),
    "out_gate": Option(bool, None, "output gate (None: the mixer's default)"),
    "rope": Option(bool, False, "rotary positions on q and k"),
    "rope_base": Option(float, 10000.0, "rotary base", positive=True),
    "reset_positions": Option(bool, True, "packed rows: positions restart at each document"),
}

# The family options, declared once with their types and shared help; a mixer lists the ones
# it reads (`uses(...)`) with its own default.
METHOD = Option(str, "chunk", "kernel algorithm")
CHUNK_SIZE = Option(int, 64, "chunk length of the chunked kernels", minimum=1)
EPS = Option(float, 1e-6, "denominator epsilon of normalised linear attention", positive=True)
FEATURE_MAP = Option(str, None, "fixed feature map φ")
FEATURE_DIM = Option(int, None, "feature width (random features, projected q/k, learned φ)", 1)
FEATURE_SCALE = Option(float, None, "φ(c·q), φ(c·k) with this c (None: 1)", positive=True)
ALLOW_NEG_EIGVAL = Option(bool, False, "β in (0, 2): negative eigenvalues of the transition")
NUM_VALUE_HEADS = Option(
    int, None, "value heads (a multiple of num_heads; None: num_heads): grouped value heads", 1
)
NUM_HOUSEHOLDER = Option(int, 2, "Householder (delta) steps per token", minimum=1)
WINDOW = Option(int, 64, "tokens each layer sees (itself and window − 1 before)", minimum=1)


def check_options(mixer: str, table: Mapping[str, Option], options: Mapping) -> dict:
    """The options of mixer `mixer` (name) validated against its `table`, defaults filled in.
    ValueError names an option the mixer does not use (listing those it does) or a bad value."""
    unknown = [name for name in options if name not in table]
    if unknown:
        own = [n for n in table if n not in COMMON_OPTIONS]
        raise ValueError(
            f"mixer {mixer!r} does not use option {unknown[0]}={options[unknown[0]]!r} "
            f"(its own options: {', '.join(own) or 'none'})"
        )
    resolved = {}
    for name, option in table.items():
        value = options.get(name, option.default)
        if value is None:
            value = option.default
        resolved[name] = option.validate(name, value, mixer)
    return resolved
