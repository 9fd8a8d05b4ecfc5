"""Mixer labels of the sweep grids: one label per model setting, as the studies' tables name
them, turned into the model fields a grid sets together for it.

- ``based``: taylor and swa layers alternating (README, "Based").
- ``<mixer>_neg``: the mixer with β ∈ (0, 2) (``model.allow_neg_eigval``; Grazzi et al.).
- ``gated_deltaproduct_n<k>``: gated_deltaproduct with k Householder steps.
- ``linear_scale8``: elu+1 with q and k scaled by 8 before the feature map (EXPERIMENTS.md,
  "Why elu+1 sits at chance"); ``linear`` is the published scale 1.
- any other label: the registry's mixer of that name.

A field a mixer does not use stays None (unset), since a mixer refuses an option it does not
use: only taylor layers take ``feature_dim``, only swa layers the ``window``, only the scaled
elu+1 a ``feature_scale``, only the ``_neg`` labels ``allow_neg_eigval`` (the others keep the
mixer's own range). ``model.conv`` is the exception: unset (None) it is each mixer's default,
on for the delta rules and off for the rest, so a grid that means "the preset's conv" says so
(``conv=base.model.conv``). rwkv7 turns the short conv off: it refuses one, its token shift
being its local context.
"""

from __future__ import annotations

import ml_collections

from linear_attention.training.sweep.grid import grid_axis

LINEAR_SCALED = "linear_scale8"
BASED = ("taylor", "swa")


def mixer_settings(label: str, *, taylor_dim: int, window: int, conv, no_conv=0) -> dict:
    """The model fields (``model.<name>`` -> value) that a mixer label sets; ``conv`` is what
    every mixer but rwkv7 writes into ``model.conv`` (None would be each mixer's default, not
    the base config's), ``no_conv`` what rwkv7 writes."""
    base = label.removesuffix("_neg")
    steps = None
    if base.startswith("gated_deltaproduct_n"):
        base, steps = "gated_deltaproduct", int(base.removeprefix("gated_deltaproduct_n"))
    return {
        "model.mixer": {"based": BASED, LINEAR_SCALED: "linear"}.get(base, base),
        "model.allow_neg_eigval": True if label.endswith("_neg") else None,
        "model.feature_dim": taylor_dim if base in ("taylor", "based") else None,
        "model.window": window if base in ("swa", "based") else None,
        "model.feature_scale": 8.0 if base == LINEAR_SCALED else None,
        "model.num_householder": steps,
        "model.conv": no_conv if base == "rwkv7" else conv,
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
