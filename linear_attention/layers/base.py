"""A mixer assembled from parts; this class wires them and gives the three paths.

A mixer maps `x[B, T, d_model]` to `y[B, T, d_model]`:

    q, k, v = inputs(x)              `QKVProjection`: projection, short conv?, rotary?
    o       = family(x, q, k, v)     the kernel family (subclasses: `_mix`, `_mix_step`,
                                     `_init_core`), with the mixer's feature map and decay parts
    y       = output(x, o)           `OutputStage`: per-head norm?, output gate?, projection

and has three paths giving the same numbers: `__call__` (whole sequence from an empty state),
`prefill(x, state) -> (y, state)` and `step(x[B, D], state) -> (y[B, D], state)`. States are
plain pytrees (`MixerState`), not NNX variables, so a jitted step can be reused at any position.

Options: a family declares `OPTIONS`, its frozen options dataclass (`layers.options`: the common
options with its own defaults, and its own fields), and `NOT_TAKEN` (common options it refuses,
with the reason: rwkv7 takes no conv). Every registered mixer gets `Config`, that dataclass
named after it; `make_config` builds and checks it once (an option the mixer does not use
raises a ValueError naming it and the mixer) and `check_config` adds the rules that involve
the model's sizes. A mixer is made from keyword options or from a `config` already made (by
`ModelConfig`); the parts read `self.options`. What a mixer reports about itself: its
`Config`, `NOT_TAKEN`, `REDRAWS` (random features that training redraws), `SWEEP` (its sweep
labels, `training.sweep.mixers`), `FAMILY` (its kernel family's descriptor: the `method`
choices, the FLOPs of each method, the backends a method needs), `mixing_flops(seq_len)`
(forward FLOPs per token of its sequence mixing; `training.flops`), and for analysis what it
attends with (`attends_with`) and the keys it writes along (`write_keys`).

Packed rows: `__call__(x, segments)` with a `layers.segments.Segments` (or raw `segment_ids[B,
T]`, checked and converted here) mixes each document on its own: the conv reads no other
document, rotary positions restart at each document (`reset_positions`), and `_mix` gets the
segments for the kernel's mask or state resets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention.fields import build, check_int
from linear_attention.kernels.primitives.family import Family
from linear_attention.layers.options import MixerConfig, conv_kernel_size
from linear_attention.layers.output import OutputStage
from linear_attention.layers.projections import QKVProjection
from linear_attention.layers.rotary import check_rotary_dim
from linear_attention.layers.segments import Segments, as_segments
from linear_attention.layers.sequence import sequence_axis, sequence_offset

__all__ = ["Mixer", "MixerState", "conv_kernel_size"]


class MixerState(NamedTuple):
    """Decoding state of one mixer: the family's `core` state (a `LinearAttentionState` or a
    `KVCache`), the input part's tail `[B, K−1, C]` float32 (conv tail or token shift; None
    without), `position`, an int32 scalar counting the tokens seen (all sequences of a batch
    advance together), and `kind`, the name of the mixer that made it ("" when unknown), static
    in the pytree: a layer refuses another mixer's state even when the shapes agree (a kda
    state read by gated_deltanet would decode silently wrong)."""

    core: Any
    conv: jax.Array | None
    position: jax.Array
    kind: str = ""


jax.tree_util.register_pytree_with_keys(
    MixerState,
    lambda s: (
        tuple((jax.tree_util.GetAttrKey(k), getattr(s, k)) for k in ("core", "conv", "position")),
        s.kind,
    ),
    lambda kind, children: MixerState(*children, kind),
    flatten_func=lambda s: ((s.core, s.conv, s.position), s.kind),
)


class Mixer(nnx.Module):
    """Base of the attention mixers; subclasses are kernel families, and their subclasses pick
    parts (`DECAY`, a feature map, output defaults) and declare `OPTIONS`."""

    NAME: ClassVar[str] = ""
    # Its kernel family's descriptor (`kernels.FAMILIES`): the `method` choices, the FLOPs of
    # each method, the backends a method needs. None: a mixer without a `method`.
    FAMILY: ClassVar[Family | None] = None
    # The family's options dataclass; `Config` is it, named after this mixer.
    OPTIONS: ClassVar[type[MixerConfig]] = MixerConfig
    Config: ClassVar[type[MixerConfig]] = MixerConfig
    # Common options this mixer refuses when set, with the reason (a model leaves them out of
    # such layers and raises only when no layer takes them: `ModelConfig.mixer_options`).
    NOT_TAKEN: ClassVar[dict[str, str]] = {}
    # `__call__` may run with time split over a mesh axis (layers/sequence.py).
    SEQUENCE_PARALLEL: ClassVar[bool] = False
    # Random features that training redraws every `ModelConfig.redraw_interval` steps.
    REDRAWS: ClassVar[bool] = False
    # Sweep labels (`training.sweep.mixers`): the options a sweep sets for this mixer, each
    # to the value of a keyword of `mixer_settings` ({"window": "window"}); the option a
    # `<name>_n<k>` label sets to k; labels of fixed settings of this class only (not
    # inherited), e.g. {"linear_scale8": {"feature_scale": 8.0}}.
    SWEEP_FIELDS: ClassVar[dict[str, str]] = {}
    SWEEP_COUNT: ClassVar[str | None] = None
    SWEEP_LABELS: ClassVar[dict[str, dict]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # Each registered mixer's own config class, so that messages name the mixer; its
        # qualified name `<Mixer>.Config` lets pickle find it.
        attributes = {"MIXER": cls.NAME, "FAMILY": cls.FAMILY, "__module__": cls.__module__}
        cls.Config = type(f"{cls.__name__}Config", (cls.OPTIONS,), attributes)
        cls.Config.__qualname__ = f"{cls.__qualname__}.Config"

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        config: MixerConfig | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
        **options,
    ):
        config = self.make_config(d_model, num_heads, config, **options)
        # (a tuple: a module's static attributes must be hashable for nnx.jit)
        self.option_items = tuple(
            (f.name, getattr(config, f.name)) for f in dataclasses.fields(config)
        )
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
        self.output = self._build_output(rngs)
        self._build(rngs)

    # ----------------------------------------------------------------- options and parts
    @property
    def options(self) -> dict:
        """The validated options, defaults filled in (`check_options`)."""
        return dict(self.option_items)

    @classmethod
    def make_config(cls, d_model: int, num_heads: int, config=None, **options) -> MixerConfig:
        """This mixer's checked `Config`: made from keyword ``options`` (each checked once), or
        ``config`` as given (made and checked by `ModelConfig`); then `check_config`."""
        if config is None:
            shown = cls.Config.own_options()
            config = build(cls.Config, options, owner=f"mixer {cls.NAME!r}", shown=shown)
        elif options or not isinstance(config, cls.Config):
            raise ValueError(
                f"mixer {cls.NAME!r} takes a {cls.Config.__name__} or keyword options, got "
                f"{type(config).__name__} and {sorted(options)}"
            )
        cls.check_config(d_model, num_heads, config)
        return config

    @classmethod
    def check_options(cls, d_model: int, num_heads: int, **options) -> dict:
        """The checked options with this mixer's defaults filled in, as a dict; ValueError
        naming the first bad one (called before any parameter exists)."""
        return dataclasses.asdict(cls.make_config(d_model, num_heads, **options))

    @classmethod
    def check_config(cls, d_model: int, num_heads: int, config: MixerConfig) -> None:
        """The rules between a config and the model's sizes (its fields are checked already)."""
        check_int("d_model", d_model)
        check_int("num_heads", num_heads)
        options = dataclasses.asdict(config)
        if config.head_dim is None and d_model % num_heads:
            raise ValueError(
                f"d_model={d_model} is not divisible by num_heads={num_heads}; "
                "change one of them or set head_dim"
            )
        for name, why in cls.NOT_TAKEN.items():
            if options[name]:
                raise ValueError(
                    f"mixer {cls.NAME!r} does not use option {name}={options[name]!r} ({why})"
                )
        cls._check_family_options(num_heads, options)
        if config.rope:
            head_dim = config.head_dim or d_model // num_heads
            qk_dim = cls._qk_dim(head_dim, options)
            rotary_dim = options.get("rotary_dim")
            if rotary_dim is None:
                check_rotary_dim("q/k head dimension", qk_dim)
            elif rotary_dim > qk_dim:
                raise ValueError(
                    f"rotary_dim={rotary_dim} must be <= the q/k head dimension {qk_dim}"
                )
            else:
                check_rotary_dim("rotary_dim", rotary_dim)

    @classmethod
    def _check_family_options(cls, num_heads: int, options: Mapping) -> None:
        """Subclass checks that involve more than one option."""

    @classmethod
    def _qk_dim(cls, head_dim: int, options: Mapping) -> int:
        """Width of q and k per head (before the feature map); taylor overrides it."""
        return head_dim

    def _build_inputs(self, rngs: nnx.Rngs) -> nnx.Module:
        opts = self.options
        options = dict(
            num_value_heads=self.num_value_heads,
            num_keys=self._num_keys(),
            conv=conv_kernel_size(opts["conv"]),
            rope=opts["rope"],
            rope_base=opts["rope_base"],
            reset_positions=opts["reset_positions"],
        )
        options.update(self._input_options())
        return QKVProjection(
            self.d_model,
            self.num_heads,
            self.qk_dim,
            self.head_dim,
            **options,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )

    def _input_options(self) -> dict:
        """Subclass hook: options of the q/k/v projection that replace or add to the common
        ones (key/value heads, q/k norm, partial rotary, conv bias)."""
        return {}

    def _num_keys(self) -> int | None:
        """Keys (and values) per token and head with an n axis (Gated DeltaProduct's n, 1 or
        more), or None: one key and no such axis."""
        return None

    def _build_output(self, rngs: nnx.Rngs) -> nnx.Module:
        """The output part: the shared `OutputStage` (a mixer whose output is not per-head
        norm, gate and projection, as Mamba-1's and Griffin's blocks, builds its own)."""
        opts = self.options
        return OutputStage(
            self.d_model,
            self.num_value_heads,
            self.head_dim,
            norm=opts["out_norm"],
            gate=opts["out_gate"],
            **self._output_options(),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )

    def _output_options(self) -> dict:
        """Subclass hook: gate activation and rank of the output stage."""
        return {}

    def _build(self, rngs: nnx.Rngs) -> None:
        """Subclass hook: create the family's own parts (feature map, decay, gates)."""

    def attends_with(self, x_BTD) -> tuple | None:
        """`(q, k, v, log_decay)` of the causal weighted sum of (q·k) v that this mixer is on
        a whole sequence `x[B, T, D]` (`layers.analysis.AttentionInputs`), or None where its
        output is no such sum (the default)."""
        return None

    def write_keys(self, x_BTD) -> jax.Array | None:
        """The unit keys a delta-rule mixer writes along on `x[B, T, D]`
        (`layers.analysis.delta_keys`), float32; None where it writes along none (the
        default)."""
        return None

    def _init_core(self, batch_size: int, max_length: int) -> Any:
        raise NotImplementedError

    def _mix(self, x_BTD, q, k, v, core, position, segments=None) -> tuple[jax.Array, Any]:
        """Sequence path; `core=None` means an empty state and no state is returned.
        `segments`: a `Segments` (packed rows; only with `core=None`)."""
        raise NotImplementedError

    def _mix_step(self, x_BD, q, k, v, core, position) -> tuple[jax.Array, Any]:
        raise NotImplementedError

    def mixing_flops(self, seq_len: int, *, method=None, chunk_size=None) -> float:
        """Forward FLOPs per token of the sequence mixing on rows of ``seq_len`` tokens, with
        the kernel ``method`` and ``chunk_size`` (None: this mixer's own): its family's count
        of the method (`Family.flops`, on `_flops_sizes`); a mixer without a family counts its
        own (`training.flops`), and one without a count raises."""
        if self.FAMILY is None:
            raise NotImplementedError(f"no FLOPs count for mixer {self.NAME!r}")
        opts = self.options
        sizes = dict(
            seq_len=seq_len,
            heads=self.num_value_heads,
            dk=self.qk_dim,
            dv=self.head_dim,
            chunk_size=chunk_size or opts.get("chunk_size"),
        )
        return self.FAMILY.flops(method or opts["method"], **{**sizes, **self._flops_sizes()})

    def _flops_sizes(self) -> dict:
        """Subclass hook: the sizes of its family's FLOPs count other than the heads, widths and
        chunk (`mixing_flops`), or those it counts otherwise."""
        return {}

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
        """Empty state for `batch_size` sequences of up to `max_length` tokens. Only the caches
        that grow with the context are sized by it (softmax's and MLA's KV cache, FoX's and
        PaTH's `ForgettingCache`), and they refuse a prefill past it; the log-linear mixers
        refuse a `max_length` past their levels, and a prefill or step past them; every other
        state is fixed-size, so a prefill past `max_length` gives the whole-sequence numbers."""
        check_int("batch_size", batch_size)
        check_int("max_length", max_length)
        return MixerState(
            core=self._init_core(batch_size, max_length),
            conv=self.inputs.init_state(batch_size),
            position=jnp.zeros((), jnp.int32),
            kind=self.NAME,
        )

    def _check_state(self, state) -> None:
        if not isinstance(state, MixerState):
            raise ValueError(f"state must be a MixerState, got {type(state).__name__}")
        if state.kind and state.kind != self.NAME:
            raise ValueError(
                f"the state was made by a {state.kind!r} mixer; this layer is {self.NAME!r} "
                "(use the state of this model's init_state / prefill)"
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
        self._check_state(state)
        y_BTD, core, tail = self._forward(x_BTD, state.conv, state.core, state.position)
        return y_BTD, MixerState(core, tail, state.position + x_BTD.shape[1], self.NAME)

    def step(self, x_BD: jax.Array, state: MixerState) -> tuple[jax.Array, MixerState]:
        """One token `x[B, D]`; returns `(y[B, D], new state)`."""
        self.check_input(x_BD, 2, "[B, D]")
        self._check_state(state)
        y_B1D, core, tail = self._forward(
            x_BD[:, None], state.conv, state.core, state.position, step=True
        )
        return y_B1D[:, 0], MixerState(core, tail, state.position + 1, self.NAME)
