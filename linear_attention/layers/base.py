"""The shared skeleton of every attention mixer: projections, short conv, rotary, output norm/gate.

A mixer maps `x[B, T, d_model]` to `y[B, T, d_model]`:

    q, k, v = split(conv?(x W_qkv))            q, k: [B, T, H, Dk]   v: [B, T, H, Dv]
    q, k    = rope?(q, k)                      (absolute positions: state.position + t)
    o       = mix(q, k, v)                     the family-specific part (subclasses)
    y       = (norm?(o) ⊙ silu(x W_g)?) W_o    per-head RMSNorm and swish gate are optional

and has three paths giving the same numbers: `__call__` (whole sequence from an empty state),
`prefill(x, state) -> (y, state)` and `step(x[B, D], state) -> (y[B, D], state)`. States are
plain pytrees (`MixerState`), not NNX variables, so a jitted step can be reused at any position.

Packed rows: `__call__(x, segment_ids)` with `segment_ids[B, T]` (see `layers.segments`) mixes
each document on its own: the conv reads no other document, rotary positions restart at each
document (`reset_positions=True`, the default; else they count along the row), and `_mix` gets
the document ids as `segment_ids` for the kernel's mask or state resets.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention.kernels.segments import check_segment_ids
from linear_attention.layers.conv import ShortConv
from linear_attention.layers.norm import RMSNorm
from linear_attention.layers.rotary import apply_rotary, check_rotary_dim
from linear_attention.layers.segments import document_ids, document_positions
from linear_attention.layers.sequence import previous_tail, sequence_axis, sequence_offset

# Options that only some mixers use; `None` means "not set". A mixer whose `USES` lacks one of
# these raises if it is set, so nothing is silently ignored.
OPTIONAL_OPTIONS = ("feature_map", "feature_dim", "feature_scale", "method", "chunk_size", "eps")


class AttentionInputs(NamedTuple):
    """What a mixer attends with on a whole sequence (`Mixer.attention_inputs`), so that

        o_t = Σ_{s ≤ t} w(q_t·k_s) · exp(Σ_{r=s+1..t} log_decay_r) v_s   (then normalised)

    with w = exp and a softmax over s for softmax (q already scaled by Dk^-½), w = identity for
    linear mixers (q, k are the features φ(q), φ(k); normalised by the same sum with w(q·k) = q·k
    when the mixer divides by φ(q)ᵀz). q, k `[B, T, H, M]`, v `[B, T, H, Dv]` in the compute
    dtype; `log_decay` float32 `[B, T, H]`, `[B, T, H, M]` (per key dimension), or None."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    log_decay: jax.Array | None


class MixerState(NamedTuple):
    """Decoding state of one mixer: the family's `core` state (a `LinearAttentionState` or a
    `KVCache`), the conv tail `[B, K−1, C]` float32 (None without conv), and `position`, an int32
    scalar counting the tokens seen (all sequences of a batch advance together)."""

    core: Any
    conv: jax.Array | None
    position: jax.Array


def _check_int(name: str, value, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_method(mixer: str, method, allowed) -> None:
    """Raise unless `method` is None (the mixer's default) or one of the kernel's `allowed`."""
    if method is not None and method not in allowed:
        raise ValueError(
            f"unknown method {method!r} for mixer {mixer!r}; allowed: {', '.join(allowed)}"
        )


def conv_kernel_size(conv) -> int:
    """`conv` option to a kernel size: False/0 -> 0 (off), True -> 4, an int >= 2 -> itself."""
    if conv is False or conv is None:
        return 0
    if conv is True:
        return 4
    if isinstance(conv, int) and (conv == 0 or conv >= 2):
        return conv
    raise ValueError(
        f"conv must be a bool or a kernel size (0 = off, or an int >= 2), got {conv!r}"
    )


class Mixer(nnx.Module):
    """Base class of the attention mixers; subclasses implement `_init_core`, `_mix`, `_mix_step`.

    Class attributes set by subclasses: `NAME`, `USES` (which of `OPTIONAL_OPTIONS` it reads),
    `DEFAULT_OUT_NORM`, `DEFAULT_OUT_GATE`.
    """

    NAME: ClassVar[str] = ""
    USES: ClassVar[frozenset[str]] = frozenset()
    DEFAULT_OUT_NORM: ClassVar[bool] = False
    DEFAULT_OUT_GATE: ClassVar[bool] = False
    # `__call__` may run with time split over a mesh axis (layers/sequence.py).
    SEQUENCE_PARALLEL: ClassVar[bool] = False

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        head_dim: int | None = None,
        feature_map: str | None = None,
        feature_dim: int | None = None,
        feature_scale: float | None = None,
        conv: bool | int = False,
        out_norm: bool | None = None,
        out_gate: bool | None = None,
        rope: bool = False,
        rope_base: float = 10000.0,
        reset_positions: bool = True,
        method: str | None = None,
        chunk_size: int | None = None,
        eps: float | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        options = dict(
            feature_map=feature_map,
            feature_dim=feature_dim,
            feature_scale=feature_scale,
            method=method,
            chunk_size=chunk_size,
            eps=eps,
        )
        self.check_options(
            d_model,
            num_heads,
            head_dim=head_dim,
            conv=conv,
            out_norm=out_norm,
            out_gate=out_gate,
            rope=rope,
            rope_base=rope_base,
            reset_positions=reset_positions,
            **options,
        )
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = head_dim or d_model // num_heads
        self.qk_dim = self._qk_dim(self.head_dim, feature_dim)
        self.rope = bool(rope)
        self.rope_base = float(rope_base)
        self.reset_positions = reset_positions
        self.dtype = dtype
        self.param_dtype = param_dtype
        h, dk, dv = num_heads, self.qk_dim, self.head_dim
        lin = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.qkv_proj = nnx.Linear(d_model, h * (2 * dk + dv), **lin)
        ksize = conv_kernel_size(conv)
        self.conv = (
            ShortConv(h * (2 * dk + dv), ksize, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            if ksize
            else None
        )
        out_norm = self.DEFAULT_OUT_NORM if out_norm is None else out_norm
        out_gate = self.DEFAULT_OUT_GATE if out_gate is None else out_gate
        self.out_norm = (
            RMSNorm((h, dv), dtype=dtype, param_dtype=param_dtype, rngs=rngs) if out_norm else None
        )
        self.gate_proj = nnx.Linear(d_model, h * dv, **lin) if out_gate else None
        self.out_proj = nnx.Linear(h * dv, d_model, **lin)
        self._build(rngs=rngs, **options)

    # ----------------------------------------------------------------- options and hooks
    @classmethod
    def _qk_dim(cls, head_dim: int, feature_dim: int | None) -> int:
        """Width of q and k per head (before the feature map); taylor overrides it."""
        return head_dim

    @classmethod
    def check_options(
        cls,
        d_model: int,
        num_heads: int,
        *,
        head_dim: int | None = None,
        conv: bool | int = False,
        out_norm: bool | None = None,
        out_gate: bool | None = None,
        rope: bool = False,
        rope_base: float = 10000.0,
        reset_positions: bool = True,
        **options,
    ) -> None:
        """Raise ValueError naming the first bad option (called before any parameter exists)."""
        _check_int("d_model", d_model)
        _check_int("num_heads", num_heads)
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(
                    f"d_model={d_model} is not divisible by num_heads={num_heads}; "
                    "change one of them or set head_dim"
                )
        else:
            _check_int("head_dim", head_dim)
        conv_kernel_size(conv)
        for name, value in (
            ("out_norm", out_norm),
            ("out_gate", out_gate),
            ("rope", rope),
            ("reset_positions", reset_positions),
        ):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool (or None for the default), got {value!r}")
        if not (isinstance(rope_base, int | float) and rope_base > 0):
            raise ValueError(f"rope_base must be a number > 0, got {rope_base!r}")
        unknown = set(options) - set(OPTIONAL_OPTIONS)
        if unknown:
            raise ValueError(f"unknown mixer option(s) {sorted(unknown)}")
        for name in OPTIONAL_OPTIONS:
            if options.get(name) is not None and name not in cls.USES:
                raise ValueError(
                    f"mixer {cls.NAME!r} does not use option {name}={options[name]!r} "
                    f"(it uses: {', '.join(sorted(cls.USES)) or 'none of them'})"
                )
        cls._check_family_options(**{k: options.get(k) for k in OPTIONAL_OPTIONS})
        if rope:
            qk = cls._qk_dim(head_dim or d_model // num_heads, options.get("feature_dim"))
            check_rotary_dim("q/k head dimension", qk)

    @classmethod
    def _check_family_options(cls, **options) -> None:
        """Subclass checks of the options in `USES`."""

    def _build(self, *, rngs: nnx.Rngs, **options) -> None:
        """Subclass hook: create the family's own submodules."""

    def _init_core(self, batch_size: int, max_length: int) -> Any:
        raise NotImplementedError

    def _mix(
        self, x_BTD, q_BTHK, k_BTHK, v_BTHD, core, position, segment_ids=None
    ) -> tuple[jax.Array, Any]:
        """Sequence path; `core=None` means an empty state and no state is returned.
        `segment_ids`: document ids `[B, T]` (0, 1, … per row; only with `core=None`)."""
        raise NotImplementedError

    def _mix_step(self, x_BD, q_BHK, k_BHK, v_BHD, core, position) -> tuple[jax.Array, Any]:
        raise NotImplementedError

    def _attention_inputs(self, x_BTD, q_BTHK, k_BTHK, v_BTHD) -> AttentionInputs:
        """Subclass hook for `attention_inputs`: featurise q and k, give the log decay. The
        default (q, k as projected, no decay) fits a mixer whose kernel takes them as they are."""
        return AttentionInputs(q_BTHK, k_BTHK, v_BTHD, None)

    # ----------------------------------------------------------------- shared parts
    def _check_input(self, x: jax.Array, rank: int, layout: str) -> None:
        if x.ndim != rank or x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must be {layout} with d_model={self.d_model}, got shape {tuple(x.shape)}"
            )

    def _qkv(self, x_BTD, conv_tail, position, documents_BT=None):
        b, t, _ = x_BTD.shape
        h, dk, dv = self.num_heads, self.qk_dim, self.head_dim
        qkv = self.qkv_proj(x_BTD)
        if self.conv is not None and documents_BT is not None:  # packed rows (from empty)
            if sequence_axis() is None:
                qkv = self.conv(qkv, documents_BT)
            else:  # time split: after the previous shard's last K − 1 inputs and their ids
                k_1 = self.conv.kernel_size - 1
                tail = previous_tail(qkv, k_1).astype(qkv.dtype)
                ids = previous_tail(documents_BT[..., None].astype(jnp.float32), k_1)[..., 0]
                qkv = self.conv(
                    jnp.concatenate([tail, qkv], axis=1),
                    jnp.concatenate([ids.astype(documents_BT.dtype), documents_BT], axis=1),
                )[:, k_1:]
        elif self.conv is not None:
            if conv_tail is None:  # time split: the previous shard's last K − 1 inputs
                k_1 = self.conv.kernel_size - 1
                axis = sequence_axis()
                conv_tail = self.conv.init_state(b) if axis is None else previous_tail(qkv, k_1)
            qkv, conv_tail = self.conv.prefill(qkv, conv_tail)
        q_BTHK = qkv[..., : h * dk].reshape(b, t, h, dk)
        k_BTHK = qkv[..., h * dk : 2 * h * dk].reshape(b, t, h, dk)
        v_BTHD = qkv[..., 2 * h * dk :].reshape(b, t, h, dv)
        if self.rope:
            positions_T = position + jnp.arange(t, dtype=jnp.int32)
            if documents_BT is not None and self.reset_positions:
                positions_T = document_positions(documents_BT)  # [B, T]
            q_BTHK = apply_rotary(q_BTHK, positions_T, base=self.rope_base)
            k_BTHK = apply_rotary(k_BTHK, positions_T, base=self.rope_base)
        return q_BTHK, k_BTHK, v_BTHD, conv_tail

    def _output(self, x_BTD, o_BTHD):
        b, t = o_BTHD.shape[:2]
        if self.out_norm is not None:
            o_BTHD = self.out_norm(o_BTHD)
        o_BTF = o_BTHD.reshape(b, t, self.num_heads * self.head_dim)
        if self.gate_proj is not None:
            o_BTF = o_BTF * jax.nn.silu(self.gate_proj(x_BTD))
        return self.out_proj(o_BTF)

    # ----------------------------------------------------------------- public paths
    def init_state(self, batch_size: int, max_length: int) -> MixerState:
        """Empty state for `batch_size` sequences of up to `max_length` tokens (only the softmax
        KV cache depends on `max_length`)."""
        _check_int("batch_size", batch_size)
        _check_int("max_length", max_length)
        return MixerState(
            core=self._init_core(batch_size, max_length),
            conv=None if self.conv is None else self.conv.init_state(batch_size),
            position=jnp.zeros((), jnp.int32),
        )

    def __call__(self, x_BTD: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """Causal mixing of a whole sequence `[B, T, d_model]` from an empty state; with
        `segment_ids[B, T]` (int) each document of a packed row is mixed on its own."""
        self._check_input(x_BTD, 3, "[B, T, D]")
        if sequence_axis() is not None and not self.SEQUENCE_PARALLEL:
            raise ValueError(f"mixer {self.NAME!r} does not support a split time axis")
        if segment_ids is None:
            position = sequence_offset(x_BTD.shape[1])  # 0 unless time is split
            q, k, v, _ = self._qkv(x_BTD, None, position)
            o_BTHD, _ = self._mix(x_BTD, q, k, v, None, position)
        else:  # (with time split, the document ids and positions are the whole row's)
            check_segment_ids(segment_ids, *x_BTD.shape[:2])
            documents_BT = document_ids(segment_ids)
            position = sequence_offset(x_BTD.shape[1])
            q, k, v, _ = self._qkv(x_BTD, None, position, documents_BT)
            o_BTHD, _ = self._mix(x_BTD, q, k, v, None, position, segment_ids=documents_BT)
        return self._output(x_BTD, o_BTHD)

    def attention_inputs(self, x_BTD: jax.Array) -> AttentionInputs:
        """The featurised queries and keys, values and log decay this mixer attends with on
        `x[B, T, D]` (a whole sequence from an empty state; projection, conv and rotary as in
        `__call__`): the inputs of its kernel, for analysis (see `AttentionInputs`)."""
        self._check_input(x_BTD, 3, "[B, T, D]")
        q, k, v, _ = self._qkv(x_BTD, None, 0)
        return self._attention_inputs(x_BTD, q, k, v)

    def prefill(self, x_BTD: jax.Array, state: MixerState) -> tuple[jax.Array, MixerState]:
        """Mix `x[B, T, D]` after the tokens summarized by `state`; returns `(y, new state)`."""
        self._check_input(x_BTD, 3, "[B, T, D]")
        if sequence_axis() is not None:
            raise ValueError("prefill does not split time: call it outside split_sequence")
        q, k, v, tail = self._qkv(x_BTD, state.conv, state.position)
        o_BTHD, core = self._mix(x_BTD, q, k, v, state.core, state.position)
        position = state.position + x_BTD.shape[1]
        return self._output(x_BTD, o_BTHD), MixerState(core, tail, position)

    def step(self, x_BD: jax.Array, state: MixerState) -> tuple[jax.Array, MixerState]:
        """One token `x[B, D]`; returns `(y[B, D], new state)`."""
        self._check_input(x_BD, 2, "[B, D]")
        x_B1D = x_BD[:, None]
        q, k, v, tail = self._qkv(x_B1D, state.conv, state.position)
        o_BHD, core = self._mix_step(x_BD, q[:, 0], k[:, 0], v[:, 0], state.core, state.position)
        y_BD = self._output(x_B1D, o_BHD[:, None])[:, 0]
        return y_BD, MixerState(core, tail, state.position + 1)
