"""`ModelConfig`: the frozen, validated description of a `LanguageModel`.

Training builds it from a ConfigDict at the boundary, `ModelConfig(**dict(config.model))`, so every
field is a plain Python scalar, string or tuple (a list for `mixer` is accepted and turned into a
tuple; `dtype` / `param_dtype` may be a dtype or its name and are stored as the name).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from linear_attention.layers import MIXERS, get_mixer
from linear_attention.layers.base import conv_kernel_size

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


# Field types, checked strictly (a string "False" is not a bool); NumPy scalars are accepted and
# stored as the Python type, so the config stays hashable and JSON-able.
_INTS = ("vocab_size", "d_model", "num_layers", "num_heads", "max_length", "chunk_size", "window")
_INTS += ("redraw_interval", "head_dim", "feature_dim")  # (the last two may be None)
_BOOLS = ("mlp", "tie_embeddings", "allow_neg_eigval", "out_norm", "out_gate")  # (last 2: None)
_NUMBERS = ("mlp_ratio", "rope_base", "eps", "norm_eps", "feature_scale")  # (last: None)
_STRINGS = ("position", "method", "feature_map", "remat")  # (feature_map may be None)
_OPTIONAL = ("head_dim", "feature_dim", "feature_scale", "out_norm", "out_gate", "feature_map")
_OPTIONAL += ("conv",)


def _strict(field: str, value):
    """``value`` as the Python type of ``field``; ValueError naming it if it has another type."""
    if value is None and field in _OPTIONAL:
        return None
    if field in _BOOLS:
        if isinstance(value, bool | np.bool_):
            return bool(value)
        raise ValueError(f"{field} must be a bool, got {value!r} ({type(value).__name__})")
    if field in _INTS or (field == "conv" and not isinstance(value, bool | np.bool_)):
        if isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_):
            return int(value)
        kind = "a bool or an integer kernel size" if field == "conv" else "an integer"
        raise ValueError(f"{field} must be {kind}, got {value!r} ({type(value).__name__})")
    if field == "conv":
        return bool(value)
    if field in _NUMBERS:
        ok = isinstance(value, int | float | np.integer | np.floating)
        if not ok or isinstance(value, bool | np.bool_) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{field} must be a finite number > 0, got {value!r}")
        return float(value)
    if field in _STRINGS and not isinstance(value, str):
        raise ValueError(f"{field} must be a string, got {value!r} ({type(value).__name__})")
    return value


# The largest position a decoding state can count to: positions are int32 (as token ids are),
# so a counter past it would wrap to a negative position rather than fail.
MAX_POSITION = 2**31 - 1


def _int(field: str, value, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{field} must be an integer >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only language model: embeddings, `num_layers` pre-norm blocks, RMSNorm, head.

    Fields:
      vocab_size, d_model, num_layers, num_heads: sizes; `head_dim` defaults to d_model/num_heads.
      mixer: a registry name (`softmax`, `linear`, `favor`, `taylor`, `hedgehog`, `retnet`,
        `gated`, `gla`, `deltanet`, `gated_deltanet`, `swa`) for every layer, or a tuple of
        names: one per layer, or a shorter pattern whose length divides `num_layers`, repeated
        (`("gated", "softmax")` with 4 layers is gated, softmax, gated, softmax).
        Based: `("taylor", "swa")` with feature_dim=16 (README, "Based").
      feature_map: fixed φ for `linear` / `retnet` / `gated` layers (None: each mixer's default).
      feature_dim: width for `favor` (random features), `taylor` (projected q/k), `hedgehog`.
      feature_scale: `linear` layers apply φ to feature_scale·q and feature_scale·k (None: 1).
      conv: short causal conv on q/k/v: False, True (kernel 4) or a kernel size; None: each
        mixer's default (on for `deltanet` / `gated_deltanet`, off for the others).
      out_norm, out_gate: per-head output RMSNorm / swish gate (None: each mixer's default).
      mlp, mlp_ratio: SwiGLU MLP in every block (Zoology's MQAR models use none).
      position: "none", "learned" (absolute embeddings, needs max_length) or "rope" (all mixers).
      reset_positions: with packed rows (`model(tokens, segment_ids)`), positions (learned or
        rope) restart at 0 at each document, as if it were run alone (default True; False:
        they count along the row). Only meaningful with position "learned" or "rope".
      max_length: the longest sequence (learned positions; the softmax KV cache in decoding);
        at most 2**31 − 1, the largest int32 position.
      method, chunk_size, eps: passed to the linear-attention kernel (method and chunk_size to
        the delta rule's for `deltanet` / `gated_deltanet`, which take "chunk" or "scan").
      allow_neg_eigval: `deltanet` / `gated_deltanet` with β = 2·sigmoid in (0, 2) (negative
        eigenvalues of the state transition).
      window: tokens each `swa` layer sees (itself and window − 1 before; its decoding state
        is a ring buffer of this many keys and values, whatever max_length).
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

    Options that apply to some layers only (feature_map, feature_dim, redraw_interval) must be
    used by at least one layer; every field is checked in `__post_init__` (ValueError names it),
    types strictly: bools must be bools (not "False" or 0), numbers finite; NumPy scalars are
    accepted and stored as Python ints, floats and bools.
    """

    vocab_size: int
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int | None = None
    mixer: str | tuple[str, ...] = "linear"
    feature_map: str | None = None
    feature_dim: int | None = None
    feature_scale: float | None = None
    conv: bool | int | None = None
    out_norm: bool | None = None
    out_gate: bool | None = None
    mlp: bool = True
    mlp_ratio: float = 4.0
    position: str = "none"
    rope_base: float = 10000.0
    reset_positions: bool = True
    max_length: int = 2048
    method: str = "chunk"
    chunk_size: int = 64
    eps: float = 1e-6
    allow_neg_eigval: bool = False
    window: int = 64
    norm_eps: float = 1e-6
    redraw_interval: int = 0
    dtype: str = "float32"
    param_dtype: str = "float32"
    tie_embeddings: bool = True
    remat: str = "none"

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        for field in (*_INTS, *_BOOLS, *_NUMBERS, *_STRINGS, "conv"):
            set_(field, _strict(field, getattr(self, field)))
        for field in ("vocab_size", "d_model", "num_layers", "num_heads", "max_length"):
            _int(field, getattr(self, field))
        if self.max_length > MAX_POSITION:
            raise ValueError(
                f"max_length must be <= {MAX_POSITION} (2**31 - 1), got {self.max_length}: "
                "decoding counts positions in int32, which would wrap to negative past it"
            )
        _int("chunk_size", self.chunk_size)
        _int("window", self.window)
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
        if not isinstance(self.reset_positions, bool):
            raise ValueError(f"reset_positions must be a bool, got {self.reset_positions!r}")
        if not self.reset_positions and self.position == "none":
            raise ValueError("reset_positions=False needs position 'learned' or 'rope'")
        set_("dtype", _dtype_name("dtype", self.dtype))
        set_("param_dtype", _dtype_name("param_dtype", self.param_dtype))
        # Per-layer options: each mixer checks the ones it uses; the others must be used somewhere.
        used = set().union(*(MIXERS[name].USES for name in self.layer_mixers))
        for field in ("feature_map", "feature_dim", "feature_scale"):
            if getattr(self, field) is not None and field not in used:
                raise ValueError(
                    f"{field}={getattr(self, field)!r} is not used by any layer "
                    f"(mixers: {', '.join(sorted(set(self.layer_mixers)))})"
                )
        if self.allow_neg_eigval and "allow_neg_eigval" not in used:
            raise ValueError(
                "allow_neg_eigval=True is not used by any layer "
                f"(mixers: {', '.join(sorted(set(self.layer_mixers)))})"
            )
        if self.redraw_interval and "favor" not in self.layer_mixers:
            raise ValueError(
                f"redraw_interval={self.redraw_interval} needs a favor layer "
                f"(mixers: {', '.join(sorted(set(self.layer_mixers)))})"
            )
        for name in dict.fromkeys(self.layer_mixers):
            MIXERS[name].check_options(self.d_model, self.num_heads, **self.mixer_options(name))

    @property
    def layer_mixers(self) -> tuple[str, ...]:
        """The mixer name of every layer (the pattern repeated to `num_layers`)."""
        if isinstance(self.mixer, str):
            return (self.mixer,) * self.num_layers
        return self.mixer * (self.num_layers // len(self.mixer))

    def mixer_options(self, name: str) -> dict:
        """Keyword options for the mixer class `name`: the shared ones and those it uses."""
        cls = MIXERS[name]
        options = dict(
            head_dim=self.head_dim,
            conv=self.conv,
            out_norm=self.out_norm,
            out_gate=self.out_gate,
            rope=self.position == "rope",
            rope_base=float(self.rope_base),
            reset_positions=self.reset_positions,
        )
        for field in (
            "feature_map",
            "feature_dim",
            "feature_scale",
            "method",
            "chunk_size",
            "eps",
            "allow_neg_eigval",
            "window",
        ):
            if field in cls.USES:
                options[field] = getattr(self, field)
        return options

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def parameter_dtype(self):
        return jnp.dtype(self.param_dtype)
