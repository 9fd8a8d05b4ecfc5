"""A model's mixer options: `ModelConfig.options` and `ModelConfig.layer_options`.

Each mixer declares its options in its own `Config` dataclass (`layers.options`); a model sets
them in two mappings, never as fields of its own:

- `options`, ``{option: value}``: every layer whose mixer takes the option gets the value, so an
  option several mixers of a hybrid take (`method`, `chunk_size`) is set once. Each must be
  taken by at least one mixer of the model (an unknown name gets the closest known one).
- `layer_options`, ``{mixer: {option: value}}``: the layers of that mixer only, over `options`
  and the model's common fields (`head_dim`, `conv`, `out_gate`, ...), plus `num_heads` and
  `norm_position` (`BLOCK_OPTIONS`).

The names a model may use are the union of the registered mixers' `Config` fields
(`option_classes`), read from the registry, so a new mixer's options need no line here. A
value's type and range are checked by the mixer's `Config` when the model is made.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import numpy as np

from linear_attention.fields import check_choice, check_int, did_you_mean, fail
from linear_attention.layers import MIXERS
from linear_attention.layers.block import NORM_POSITIONS
from linear_attention.layers.options import COMMON_OPTIONS

# The block options `layer_options` may set per layer type, beside the mixer's own.
BLOCK_OPTIONS = ("num_heads", "norm_position")


class FrozenMapping(dict):
    """A dict that cannot change and hashes (a `ModelConfig` field must hash: configs key the
    caches of state shapes), written to JSON as an object, so that a run's config.json holds
    `options` as `{option: value}` and `layer_options` as `{mixer: {option: value}}`."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))

    def _frozen(self, *args, **kwargs):
        raise TypeError("a FrozenMapping cannot change (make a new ModelConfig)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _frozen
    __ior__ = _frozen


@functools.cache
def option_classes() -> dict[str, tuple[type, ...]]:
    """Every mixer option beside the common ones -> the registered mixers' `Config` classes
    that declare it, in registry order."""
    table: dict[str, list] = {}
    for cls in MIXERS.values():
        for name in cls.Config.own_options():
            table.setdefault(name, []).append(cls.Config)
    return {name: tuple(classes) for name, classes in table.items()}


def _scalar(name: str, value):
    if isinstance(value, np.generic):
        value = value.item()
    if value is not None and not isinstance(value, bool | int | float | str):
        fail(name, "a bool, number, string or None", value, show_type=True)
    return value


def pairs(value):
    """A mapping given as ``(key, value)`` pairs (a tuple of them in a frozen config) as a dict."""
    if isinstance(value, list | tuple) and all(
        isinstance(e, list | tuple) and len(e) == 2 and isinstance(e[0], str) for e in value
    ):
        return dict(value)
    return value


def as_options(name: str, value, *, where: str | None = None) -> FrozenMapping:
    """`options` as a sorted `FrozenMapping` of scalars, the unset (None) left out; given as a
    mapping or as ``(option, value)`` pairs."""
    value = pairs(value)
    if not isinstance(value, Mapping):
        fail(where or name, "a mapping {option: value}", value, show_type=True)
    where = where or name
    items = ((o, _scalar(f"{where}[{o!r}]", v)) for o, v in value.items())
    return FrozenMapping(sorted((o, v) for o, v in items if v is not None))


def as_layer_options(name: str, value) -> FrozenMapping:
    """`layer_options` as a `FrozenMapping` `{mixer: FrozenMapping({option: value})}`, sorted;
    given as a mapping or as ``(mixer, options)`` pairs."""
    value = pairs(value)
    if not isinstance(value, Mapping):
        fail(name, "a mapping {mixer: {option: value}}", value, show_type=True)
    table = {}
    for mixer, options in value.items():
        where = f"{name}[{mixer!r}]"
        if not isinstance(mixer, str) or not isinstance(pairs(options), Mapping):
            fail(where, "a mapping {option: value}", options)
        table[mixer] = as_options(name, options, where=where)
    return FrozenMapping(sorted(table.items()))


def check_options(options: Mapping, mixers) -> None:
    """Each of `options` is taken by some mixer of the model (`mixers`, its layers' names)."""
    taken = sorted({o for m in mixers for o in MIXERS[m].Config.own_options()})
    names = ", ".join(dict.fromkeys(mixers))
    for option, value in options.items():
        if option in taken:
            continue
        if option in COMMON_OPTIONS or option in BLOCK_OPTIONS:
            why = f"{option} is a model field: set model.{option}, or it per mixer in layer_options"
        elif option in option_classes():
            users = ", ".join(c.MIXER for c in option_classes()[option])
            why = f"no mixer of this model takes it (mixers: {names}; taken by {users})"
        else:
            why = f"no mixer takes it{did_you_mean(option, [*taken, *option_classes()])}"
        raise ValueError(
            f"options.{option}={value!r}: {why}; the mixers of this model ({names}) take: "
            f"{', '.join(taken) or 'none'}"
        )


def check_layer_options(layer_options: Mapping, mixers) -> None:
    """Each `layer_options` entry names a mixer some layer uses, and options it takes."""
    used = dict.fromkeys(mixers)
    for name, options in layer_options.items():
        if name not in used:
            raise ValueError(
                f"layer_options names mixer {name!r}, which no layer uses "
                f"(mixers: {', '.join(used)}){did_you_mean(name, used)}"
            )
        allowed = (*BLOCK_OPTIONS, *(f.name for f in dataclasses.fields(MIXERS[name].Config)))
        where = f"layer_options[{name!r}]"
        for option, value in options.items():
            if option not in allowed:
                raise ValueError(
                    f"{where} sets {option}={value!r}, which mixer {name!r} does not take"
                    f"{did_you_mean(option, allowed)}; allowed: {', '.join(allowed)}"
                )
            if option == "num_heads":
                check_int(f"{where}['num_heads']", value)
            if option == "norm_position":
                check_choice(f"{where}['norm_position']", value, NORM_POSITIONS)


def mixer_options(config, name: str) -> dict:
    """Keyword options of mixer `name` in model `config`: the common ones, the `options` it
    takes, then its `layer_options`. A common option the mixer refuses (`NOT_TAKEN`) is left
    out: it applies to the other layers of a hybrid."""
    cls = MIXERS[name]
    options = dict(
        head_dim=config.head_dim,
        conv=config.conv,
        out_norm=config.out_norm,
        out_gate=config.out_gate,
        rope=config.position == "rope",
        rope_base=float(config.rope_base),
        reset_positions=config.reset_positions,
    )
    options.update((o, v) for o, v in config.options.items() if o in cls.Config.own_options())
    for option in cls.NOT_TAKEN:
        options.pop(option, None)
    own = config.layer_options.get(name, {})
    options.update((o, v) for o, v in own.items() if o not in BLOCK_OPTIONS)
    return options


def mixer_configs(config, mixers) -> dict:
    """The checked `Config` of each of `mixers` in model `config`; a refusal caused by
    `layer_options` says so."""
    configs = {}
    for name in mixers:
        try:
            configs[name] = MIXERS[name].make_config(
                config.d_model, config.layer_num_heads(name), **mixer_options(config, name)
            )
        except ValueError as e:
            if name not in config.layer_options:
                raise
            raise ValueError(f"{e} (with layer_options[{name!r}])") from None
    return configs


def converted(options: Mapping, configs: Mapping, layer_options: Mapping) -> FrozenMapping:
    """`options` with each value as a mixer config that takes it (and does not override it in
    `layer_options`) converted it."""
    values = dict(options)
    for option in options:
        for name, c in configs.items():
            if option in c.own_options() and option not in layer_options.get(name, {}):
                values[option] = getattr(c, option)
                break
    return FrozenMapping(values)
