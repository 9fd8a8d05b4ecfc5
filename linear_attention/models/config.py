"""`ModelConfig`: the frozen, validated description of a `LanguageModel`.

Training builds it from a ConfigDict at the boundary, `ModelConfig(**dict(config.model))`, so every
field is a plain Python scalar, string or tuple (a list for `mixer` is accepted and turned into a
tuple; `dtype` / `param_dtype` may be a dtype or its name and are stored as the name).

Its fields are the model's own (sizes, positions, MLP, dtypes, the options shared by every
mixer), declared below, plus one field per mixer option, taken from the mixers' own `OPTIONS`
tables (`layers.options`): a new mixer's options become fields, command-line overrides and
`la-train --help` lines without being written here. Mixer options default to None, "the
mixer's default"; one that no layer's mixer uses raises a ValueError naming it and the mixers.
Field types come from the annotations (and the option tables), read once (`FIELD_TYPES`).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing

import jax.numpy as jnp
import numpy as np

from linear_attention.layers import MIXERS, Option, get_mixer
from linear_attention.layers.options import conv_kernel_size

POSITIONS = ("none", "learned", "rope")
# Rematerialisation: what the backward pass keeps of each block's forward pass (see `remat`).
REMAT = ("none", "block", "dots", "dots_no_batch")
DTYPES = ("float32", "bfloat16", "float16")


def _dtype_name(field: str, value) -> str:
    try:
        name = jnp.dtype(value).name
    except TypeError as e:
        raise ValueError(f"{field} must be one of {DTYPES}, got {value!r}") from e
    if name not in DTYPES:
        raise ValueError(f"{field} must be one of {DTYPES}, got {value!r}")
    return name


def _mixer_option_table() -> dict[str, Option]:
    """Every option some mixer declares (beyond the common ones), by name; the first
    declaration gives its type, and every mixer must agree on it."""
    table: dict[str, Option] = {}
    for cls in MIXERS.values():
        for name, option in cls.OPTIONS.items():
            if name in table and table[name].type is not option.type:
                raise TypeError(f"mixers disagree on the type of option {name!r}")
            table.setdefault(name, option)
    return table


MIXER_OPTIONS = _mixer_option_table()


# The largest position a decoding state can count to: positions are int32 (as token ids are),
# so a counter past it would wrap to a negative position rather than fail.
MAX_POSITION = 2**31 - 1


def _int(field: str, value, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{field} must be an integer >= {minimum}, got {value!r}")


def _strict(field: str, value, kinds: tuple):
    """``value`` as the Python type of ``field`` (one of ``kinds``: None, bool, int, float,
    str); ValueError naming it if it has another type. NumPy scalars are accepted."""
    if value is None:
        if type(None) in kinds:
            return None
        if str in kinds:
            raise ValueError(f"{field} must be a string, got None")
    if bool in kinds and isinstance(value, bool | np.bool_):
        return bool(value)
    if (
        int in kinds
        and isinstance(value, int | np.integer)
        and not isinstance(value, bool | np.bool_)
    ):
        return int(value)
    if float in kinds:
        ok = isinstance(value, int | float | np.integer | np.floating)
        if not ok or isinstance(value, bool | np.bool_) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{field} must be a finite number > 0, got {value!r}")
        return float(value)
    if str in kinds:
        if isinstance(value, str):
            return value
        raise ValueError(f"{field} must be a string, got {value!r} ({type(value).__name__})")
    if bool in kinds and int in kinds:
        kind = "a bool or an integer kernel size"
    else:
        kind = "a bool" if bool in kinds else "an integer"
    raise ValueError(f"{field} must be {kind}, got {value!r} ({type(value).__name__})")


@dataclasses.dataclass(frozen=True)
class _ModelFields:
    """The model's own fields (see `ModelConfig`)."""

    vocab_size: int
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int | None = None
    mixer: str | tuple[str, ...] = "linear"
    conv: bool | int | None = None
    out_norm: bool | None = None
    out_gate: bool | None = None
    mlp: bool = True
    mlp_ratio: float = 4.0
    position: str = "none"
    rope_base: float = 10000.0
    reset_positions: bool = True
    max_length: int = 2048
    norm_eps: float = 1e-6
    redraw_interval: int = 0
    dtype: str = "float32"
    param_dtype: str = "float32"
    tie_embeddings: bool = True
    remat: str = "none"

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        for field, kinds in FIELD_TYPES.items():
            if field not in ("dtype", "param_dtype"):  # (a dtype or its name: `_dtype_name`)
                set_(field, _strict(field, getattr(self, field), kinds))
        for field in ("vocab_size", "d_model", "num_layers", "num_heads", "max_length"):
            _int(field, getattr(self, field))
        if self.max_length > MAX_POSITION:
            raise ValueError(
                f"max_length must be <= {MAX_POSITION} (2**31 - 1), got {self.max_length}: "
                "decoding counts positions in int32, which would wrap to negative past it"
            )
        _int("redraw_interval", self.redraw_interval, minimum=0)
        if self.head_dim is not None:
            _int("head_dim", self.head_dim)
        mixer = self.mixer
        if isinstance(mixer, list):
            mixer = tuple(mixer)
            set_("mixer", mixer)
        if isinstance(mixer, tuple):
            if not mixer or self.num_layers % len(mixer):
                raise ValueError(
                    f"mixer has {len(mixer)} names, which must be num_layers={self.num_layers} "
                    "or a pattern whose length divides it"
                )
        elif not isinstance(mixer, str):
            raise ValueError(f"mixer must be a name or a tuple of names, got {mixer!r}")
        for name in self.layer_mixers:
            get_mixer(name)
        if self.remat not in REMAT:
            raise ValueError(f"unknown remat {self.remat!r}; allowed: {', '.join(REMAT)}")
        if self.position not in POSITIONS:
            raise ValueError(f"unknown position {self.position!r}; allowed: {', '.join(POSITIONS)}")
        if self.mlp and int(self.mlp_ratio * self.d_model) < 1:
            raise ValueError(f"mlp_ratio={self.mlp_ratio} leaves no hidden units")
        conv_kernel_size(self.conv)
        if not self.reset_positions and self.position == "none":
            raise ValueError("reset_positions=False needs position 'learned' or 'rope'")
        set_("dtype", _dtype_name("dtype", self.dtype))
        set_("param_dtype", _dtype_name("param_dtype", self.param_dtype))
        # Mixer options: each must be used by some layer; each mixer checks the ones it uses.
        mixers = dict.fromkeys(self.layer_mixers)
        for field in MIXER_OPTIONS:
            value = getattr(self, field)
            if value is not None and not any(field in MIXERS[m].OPTIONS for m in mixers):
                raise ValueError(
                    f"{field}={value!r} is not used by any layer "
                    f"(mixers: {', '.join(sorted(mixers))})"
                )
        if self.redraw_interval and "favor" not in mixers:
            raise ValueError(
                f"redraw_interval={self.redraw_interval} needs a favor layer "
                f"(mixers: {', '.join(sorted(mixers))})"
            )
        # A common option some mixers refuse (rwkv7: conv, rope) applies to the layers that take
        # it, and raises when it is set and no layer takes it.
        for option, field, off, is_set in (
            ("conv", "conv", "0", bool(self.conv)),
            ("rope", "position", "none", self.position == "rope"),
        ):
            refusing = [m for m in mixers if option in MIXERS[m].NOT_TAKEN]
            if is_set and len(refusing) == len(mixers):
                why = MIXERS[refusing[0]].NOT_TAKEN[option]
                raise ValueError(
                    f"{field}={getattr(self, field)!r} is not used by any layer: "
                    f"{', '.join(refusing)} takes no {option} ({why}); set "
                    f"--config.model.{field}={off}"
                )
        for name in mixers:
            MIXERS[name].check_options(self.d_model, self.num_heads, **self.mixer_options(name))

    @property
    def layer_mixers(self) -> tuple[str, ...]:
        """The mixer name of every layer (the pattern repeated to `num_layers`)."""
        if isinstance(self.mixer, str):
            return (self.mixer,) * self.num_layers
        return self.mixer * (self.num_layers // len(self.mixer))

    def mixer_options(self, name: str) -> dict:
        """Keyword options for the mixer class `name`: the common ones and those of its own
        that are set (None: the mixer's default). A common option the mixer refuses
        (`NOT_TAKEN`) is left out: it applies to the other layers of a hybrid."""
        options = dict(
            head_dim=self.head_dim,
            conv=self.conv,
            out_norm=self.out_norm,
            out_gate=self.out_gate,
            rope=self.position == "rope",
            rope_base=float(self.rope_base),
            reset_positions=self.reset_positions,
        )
        for field in MIXERS[name].OPTIONS:
            if getattr(self, field) is not None:
                options[field] = getattr(self, field)
        for option in MIXERS[name].NOT_TAKEN:
            options.pop(option, None)
        return options

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def parameter_dtype(self):
        return jnp.dtype(self.param_dtype)


ModelConfig = dataclasses.make_dataclass(
    "ModelConfig",
    [
        (name, typing.Optional[option.type], dataclasses.field(default=None))  # noqa: UP045
        for name, option in MIXER_OPTIONS.items()
    ],
    bases=(_ModelFields,),
    frozen=True,
)
ModelConfig.__module__ = __name__  # (for pickling and reprs; make_dataclass's own module)
ModelConfig.__doc__ = """A decoder-only language model: embeddings, `num_layers` pre-norm blocks,
RMSNorm, the output head.

Fields:
  vocab_size, d_model, num_layers, num_heads: sizes; `head_dim` defaults to d_model/num_heads.
  mixer: a registry name (`layers.MIXERS`) for every layer, or a tuple of names: one per
    layer, or a shorter pattern whose length divides `num_layers`, repeated (`("gated",
    "softmax")` with 4 layers is gated, softmax, gated, softmax). Based: `("taylor", "swa")`
    with feature_dim=16 (README, "Based").
  conv: short causal conv on q/k/v: False, True (kernel 4) or a kernel size; None: each
    mixer's default (on for the delta-rule mixers, off for the others).
  out_norm, out_gate: per-head output RMSNorm / output gate (None: each mixer's default).
  mlp, mlp_ratio: SwiGLU MLP in every block (Zoology's MQAR models use none).
  position: "none", "learned" (absolute embeddings, needs max_length) or "rope" (all mixers).
  reset_positions: with packed rows (`model(tokens, segment_ids)`), positions (learned or
    rope) restart at 0 at each document, as if it were run alone (default True; False:
    they count along the row). Only meaningful with position "learned" or "rope".
  max_length: the longest sequence (learned positions; the softmax KV cache in decoding);
    at most 2**31 − 1, the largest int32 position.
  redraw_interval: training redraws `favor` projections every this many steps (0: never).
  dtype, param_dtype: compute and parameter dtypes (names); param_dtype "bfloat16" keeps
    parameters and optimizer state in bfloat16 (half the memory of both).
  remat: rematerialisation of each block in training: "none" (the backward pass keeps every
    activation), "block" (keeps only each block's input and recomputes the rest: memory
    per layer drops to one [B, T, D] array, for about one more forward pass), "dots"
    (`jax.checkpoint_policies.dots_saveable`: matmul outputs kept, elementwise work
    recomputed) or "dots_no_batch" (`dots_with_no_batch_dims_saveable`: only matmuls
    without batch dimensions kept, i.e. the projections, not the attention scores). Any
    value but "none" runs the blocks as a `jax.lax.scan` over the repeats of the mixer
    pattern (see `model._scanned_blocks`): the same numbers, one compiled body.
  tie_embeddings: output head shares the token embedding.
  The mixers' own options (`method`, `chunk_size`, `eps`, `feature_map`, `feature_dim`,
  `feature_scale`, `allow_neg_eigval`, `window`, …; `MIXER_OPTIONS`, described by each
  mixer's `OPTIONS` and `la-train --help`): None is the mixer's default; a value must be used
  by at least one layer and is passed to the layers whose mixer uses it.

Every field is checked in `__post_init__` (ValueError names it), types strictly: bools must be
bools (not "False" or 0), numbers finite; NumPy scalars are accepted and stored as Python ints,
floats and bools.
"""


def _kinds(hint) -> tuple:
    args = (
        typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else ()
    )
    return tuple(args or (hint,))


# Field name -> the Python types its value may have (None included), from the annotations.
FIELD_TYPES: dict[str, tuple] = {
    name: _kinds(hint)
    for name, hint in typing.get_type_hints(ModelConfig).items()
    if name != "mixer"
}
