"""A mixer assembled from parts; this class wires them and gives the three paths.

A mixer maps `x[B, T, d_model]` to `y[B, T, d_model]`:

    q, k, v = inputs(x)              `QKVProjection`: projection, short conv?, rotary?
    o       = family(x, q, k, v)     the kernel family (subclasses: `_mix`, `_mix_step`,
                                     `_init_core`), with the mixer's feature map and decay parts
    y       = output(x, o)           `OutputStage`: per-head norm?, output gate?, projection

and has three paths giving the same numbers: `__call__` (whole sequence from an empty state),
`prefill(x, state) -> (y, state)` and `step(x[B, D], state) -> (y[B, D], state)`. States are
plain pytrees (`MixerState`), not NNX variables, so a jitted step can be reused at any position.

Options: a subclass declares `OPTIONS` (its own options, `layers.options.Option`) and
`DEFAULTS` (its defaults of the common ones, e.g. `out_norm`) and `NOT_TAKEN` (common options it
refuses, with the reason: rwkv7 takes no conv); `check_options` validates every
keyword option once against that table and fills the defaults (an option the mixer does not
use raises a ValueError naming it and the mixer). The parts read `self.options`.

Packed rows: `__call__(x, segments)` with a `layers.segments.Segments` (or raw `segment_ids[B,
T]`, checked and converted here) mixes each document on its own: the conv reads no other
document, rotary positions restart at each document (`reset_positions`), and `_mix` gets the
segments for the kernel's mask or state resets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention.layers.options import COMMON_OPTIONS, Option, check_options, conv_kernel_size
from linear_attention.layers.output import OutputStage
from linear_attention.layers.projections import QKVProjection
from linear_attention.layers.rotary import check_rotary_dim
from linear_attention.layers.segments import Segments, as_segments
from linear_attention.layers.sequence import sequence_axis, sequence_offset

__all__ = ["Mixer", "MixerState", "conv_kernel_size"]


class MixerState(NamedTuple):
    """Decoding state of one mixer: the family's `core` state (a `LinearAttentionState` or a
    `KVCache`), the input part's tail `[B, K−1, C]` float32 (conv tail or token shift; None
    without), and `position`, an int32 scalar counting the tokens seen (all sequences of a batch
    advance together)."""

    core: Any
    conv: jax.Array | None
    position: jax.Array


def check_int(name: str, value, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


class Mixer(nnx.Module):
    """Base of the attention mixers; subclasses are kernel families, and their subclasses pick
    parts (`DECAY`, a feature map, output defaults) and declare `OPTIONS`."""

    NAME: ClassVar[str] = ""
    OPTIONS: ClassVar[dict[str, Option]] = {}
    DEFAULTS: ClassVar[dict[str, Any]] = {}
    # Common options this mixer refuses when set, with the reason (a model leaves them out of
    # such layers and raises only when no layer takes them: `ModelConfig.mixer_options`).
    NOT_TAKEN: ClassVar[dict[str, str]] = {}
    # `__call__` may run with time split over a mesh axis (layers/sequence.py).
    SEQUENCE_PARALLEL: ClassVar[bool] = False

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
        **options,
    ):
        # (a tuple: a module's static attributes must be hashable for nnx.jit)
        self.option_items = tuple(self.check_options(d_model, num_heads, **options).items())
        opts = self.options
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = opts["head_dim"] or d_model // num_heads
        self.num_value_heads = opts.get("num_value_heads") or num_heads
        self.qk_dim = self._qk_dim(self.head_dim, opts)
        self.rope = opts["rope"]
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.inputs = self._build_inputs(rngs)
        self.output = OutputStage(
            d_model,
            self.num_value_heads,
            self.head_dim,
            norm=opts["out_norm"],
            gate=opts["out_gate"],
            **self._output_options(),
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self._build(rngs)

    # ----------------------------------------------------------------- options and parts
    @property
    def options(self) -> dict:
        """The validated options, defaults filled in (`check_options`)."""
        return dict(self.option_items)

    @classmethod
    def option_table(cls) -> dict[str, Option]:
        """Every option this mixer takes, with its default for this mixer."""
        table = {
            name: option.with_default(cls.DEFAULTS.get(name, option.default))
            for name, option in COMMON_OPTIONS.items()
        }
        table.update(cls.OPTIONS)
        return table

    @classmethod
    def check_options(cls, d_model: int, num_heads: int, **options) -> dict:
        """The validated options with this mixer's defaults filled in; ValueError naming the
        first bad one (called before any parameter exists)."""
        check_int("d_model", d_model)
        check_int("num_heads", num_heads)
        resolved = check_options(cls.NAME, cls.option_table(), options)
        for name in ("out_norm", "out_gate"):  # None in a config means "the mixer's default"
            if resolved[name] is None:
                resolved[name] = bool(cls.DEFAULTS.get(name, False))
        if resolved["head_dim"] is None and d_model % num_heads:
            raise ValueError(
                f"d_model={d_model} is not divisible by num_heads={num_heads}; "
                "change one of them or set head_dim"
            )
        for name, why in cls.NOT_TAKEN.items():
            if resolved[name]:
                raise ValueError(
                    f"mixer {cls.NAME!r} does not use option {name}={resolved[name]!r} ({why})"
                )
        cls._check_family_options(num_heads, resolved)
        if resolved["rope"]:
            head_dim = resolved["head_dim"] or d_model // num_heads
            check_rotary_dim("q/k head dimension", cls._qk_dim(head_dim, resolved))
        return resolved

    @classmethod
    def _check_family_options(cls, num_heads: int, options: Mapping) -> None:
        """Subclass checks that involve more than one option."""

    @classmethod
    def _qk_dim(cls, head_dim: int, options: Mapping) -> int:
        """Width of q and k per head (before the feature map); taylor overrides it."""
        return head_dim

    def _build_inputs(self, rngs: nnx.Rngs) -> nnx.Module:
        opts = self.options
        return QKVProjection(
            self.d_model,
            self.num_heads,
            self.qk_dim,
            self.head_dim,
            num_value_heads=self.num_value_heads,
            num_keys=self._num_keys(),
            conv=conv_kernel_size(opts["conv"]),
            rope=opts["rope"],
            rope_base=opts["rope_base"],
            reset_positions=opts["reset_positions"],
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )

    def _num_keys(self) -> int | None:
        """Keys (and values) per token and head with an n axis (Gated DeltaProduct's n, 1 or
        more), or None: one key and no such axis."""
        return None

    def _output_options(self) -> dict:
        """Subclass hook: gate activation and rank of the output stage."""
        return {}

    def _build(self, rngs: nnx.Rngs) -> None:
        """Subclass hook: create the family's own parts (feature map, decay, gates)."""

    def _init_core(self, batch_size: int, max_length: int) -> Any:
        raise NotImplementedError

    def _mix(self, x_BTD, q, k, v, core, position, segments=None) -> tuple[jax.Array, Any]:
        """Sequence path; `core=None` means an empty state and no state is returned.
        `segments`: a `Segments` (packed rows; only with `core=None`)."""
        raise NotImplementedError

    def _mix_step(self, x_BD, q, k, v, core, position) -> tuple[jax.Array, Any]:
        raise NotImplementedError

    def _forward(self, x_BTD, tail, core, position, segments=None, *, step: bool = False):
        """inputs → family → output: `(y [B, T, D], core, input tail)`. A whole sequence
        (`core=None`: from an empty state, no state returned; `segments` only here), a prefill
        from `core`, or with `step` one token (T = 1) by `_mix_step`. A mixer whose parts do not
        fit the q/k/v pipeline (rwkv7: a token-shifted input per branch, a term added after the
        norm) overrides this one method; the three public paths stay shared."""
        q, k, v, tail = self.inputs(x_BTD, tail, position, segments)
        if step:
            o_BHD, core = self._mix_step(x_BTD[:, 0], q[:, 0], k[:, 0], v[:, 0], core, position)
            o = o_BHD[:, None]
        else:
            o, core = self._mix(x_BTD, q, k, v, core, position, segments)
        return self.output(x_BTD, o), core, tail

    # ----------------------------------------------------------------- shared parts
    def check_input(self, x: jax.Array, rank: int, layout: str) -> None:
        if x.ndim != rank or x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must be {layout} with d_model={self.d_model}, got shape {tuple(x.shape)}"
            )

    # ----------------------------------------------------------------- public paths
    def init_state(self, batch_size: int, max_length: int) -> MixerState:
        """Empty state for `batch_size` sequences of up to `max_length` tokens (only the softmax
        KV cache depends on `max_length`)."""
        check_int("batch_size", batch_size)
        check_int("max_length", max_length)
        return MixerState(
            core=self._init_core(batch_size, max_length),
            conv=self.inputs.init_state(batch_size),
            position=jnp.zeros((), jnp.int32),
        )

    def __call__(self, x_BTD: jax.Array, segments: Segments | jax.Array | None = None):
        """Causal mixing of a whole sequence `[B, T, d_model]` from an empty state; with
        `segments` (a `Segments`, or `segment_ids[B, T]` ints) each document of a packed row is
        mixed on its own."""
        self.check_input(x_BTD, 3, "[B, T, D]")
        if sequence_axis() is not None and not self.SEQUENCE_PARALLEL:
            raise ValueError(f"mixer {self.NAME!r} does not support a split time axis")
        # (with time split, the document ids and positions are the whole row's)
        segments = as_segments(segments, *x_BTD.shape[:2])
        position = sequence_offset(x_BTD.shape[1])  # 0 unless time is split
        y_BTD, _, _ = self._forward(x_BTD, None, None, position, segments)
        return y_BTD

    def prefill(self, x_BTD: jax.Array, state: MixerState) -> tuple[jax.Array, MixerState]:
        """Mix `x[B, T, D]` after the tokens summarized by `state`; returns `(y, new state)`."""
        self.check_input(x_BTD, 3, "[B, T, D]")
        if sequence_axis() is not None:
            raise ValueError("prefill does not split time: call it outside split_sequence")
        y_BTD, core, tail = self._forward(x_BTD, state.conv, state.core, state.position)
        return y_BTD, MixerState(core, tail, state.position + x_BTD.shape[1])

    def step(self, x_BD: jax.Array, state: MixerState) -> tuple[jax.Array, MixerState]:
        """One token `x[B, D]`; returns `(y[B, D], new state)`."""
        self.check_input(x_BD, 2, "[B, D]")
        y_B1D, core, tail = self._forward(
            x_BD[:, None], state.conv, state.core, state.position, step=True
        )
        return y_B1D[:, 0], MixerState(core, tail, state.position + 1)
