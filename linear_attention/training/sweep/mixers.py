"""Mixer labels of the sweep grids: one label per model setting, as the studies' tables name
them, turned into the model fields a grid sets together for it. What a label means is said by
the mixers themselves (`layers.base.Mixer`'s sweep attributes) and the registry:

- a registered mixer's name: that mixer, with the options it declares in `SWEEP_FIELDS` set
  from this module's keywords (the Taylor feature width, the window);
- a hybrid of the registry (`layers.registry.HYBRIDS`, e.g. Based): its mixers, with the
  options each of them sets;
- ``<label>_neg``: the mixer with β ∈ (0, 2) (``model.options.allow_neg_eigval``;
  Grazzi et al.);
- ``<mixer>_n<k>``: a mixer with a `SWEEP_COUNT` option (the Householder steps) set to k;
- a mixer's own fixed labels (`SWEEP_LABELS`, e.g. elu+1 with q and k scaled by 8).

A field a mixer does not use stays None (unset), since a mixer refuses an option it does not
use. ``model.conv`` is the exception: unset (None) it is each mixer's default, on for the delta
rules and off for the rest, so a grid that means "the preset's conv" says so
(``conv=base.model.conv``); a mixer that refuses a conv (`NOT_TAKEN`: its token shift is its
local context) gets ``no_conv``.
"""

from __future__ import annotations

import ml_collections

from linear_attention.layers import MIXERS
from linear_attention.layers.linear import SCALED_LABEL as LINEAR_SCALED
from linear_attention.layers.registry import HYBRIDS
from linear_attention.training.sweep.grid import grid_axis

_NEG = "_neg"


def _fixed_labels() -> dict[str, tuple[str, dict]]:
    """Every mixer's own fixed labels: label -> (mixer name, options)."""
    return {
        label: (name, options)
        for name, cls in MIXERS.items()
        for label, options in vars(cls).get("SWEEP_LABELS", {}).items()
    }


# Every model option some label sets, beside the mixer and the conv.
SWEPT = tuple(
    dict.fromkeys(
        [
            "allow_neg_eigval",
            *(f for cls in MIXERS.values() for f in cls.SWEEP_FIELDS),
            *(f for _, options in _fixed_labels().values() for f in options),
            *(cls.SWEEP_COUNT for cls in MIXERS.values() if cls.SWEEP_COUNT),
        ]
    )
)


def _parse(label: str) -> tuple[str | tuple[str, ...], dict]:
    """A label without ``_neg`` -> (the mixer or hybrid, the options it fixes)."""
    fixed = _fixed_labels()
    if label in fixed:
        name, options = fixed[label]
        return name, dict(options)
    if label in HYBRIDS:
        return HYBRIDS[label], {}
    base, _, count = label.rpartition("_n")
    if count.isdigit() and base in MIXERS and MIXERS[base].SWEEP_COUNT:
        return base, {MIXERS[base].SWEEP_COUNT: int(count)}
    return label, {}


def mixer_settings(label: str, *, taylor_dim: int, window: int, conv, no_conv=0) -> dict:
    """The model fields (``model.mixer``, ``model.options.<name>``, ``model.conv`` -> value)
    that a mixer label sets; ``conv`` is what
    every mixer but one that refuses a conv writes into ``model.conv`` (None would be each
    mixer's default, not the base config's), ``no_conv`` what such a mixer writes."""
    keywords = {"taylor_dim": taylor_dim, "window": window}
    mixer, options = _parse(label.removesuffix(_NEG))
    names = mixer if isinstance(mixer, tuple) else (mixer,)
    registered = [MIXERS[n] for n in names if n in MIXERS]
    for cls in registered:
        options.update({f: keywords[k] for f, k in cls.SWEEP_FIELDS.items()})
    if label.endswith(_NEG):
        options["allow_neg_eigval"] = True
    refuses_conv = registered and all("conv" in cls.NOT_TAKEN for cls in registered)
    return {
        "model.mixer": mixer,
        **{f"model.options.{f}": options.get(f) for f in SWEPT},
        "model.conv": no_conv if refuses_conv else conv,
    }


def mixer_axis(fields, labels, **settings) -> ml_collections.ConfigDict:
    """The grid axis over mixer labels that sets ``fields`` (each a key of `mixer_settings`;
    the ones left out must be None for every label); ``settings`` go to `mixer_settings`."""
    choices = []
    for label in labels:
        values = mixer_settings(label, **settings)
        dropped = {f: v for f, v in values.items() if f not in fields and v is not None}
        if dropped:
            raise ValueError(
                f"mixer {label!r} sets {dropped}, which the axis's fields {fields} lack"
            )
        choices.append(tuple(values[f] for f in fields))
    if len(fields) == 1:  # (an axis of one field takes bare values)
        choices = [c[0] for c in choices]
    return grid_axis(tuple(fields), choices, tuple(labels))


__all__ = ["LINEAR_SCALED", "SWEPT", "mixer_axis", "mixer_settings"]
