"""PaTH attention (`path`: Yang et al. 2025, "PaTH Attention: Position Encoding via Accumulating
Householder Transformations"): causal softmax attention whose keys are transported to the query
by the data-dependent Householder transforms of the tokens between them,
`kernels.path_attention`.

    q, k, v = x W_q, x W_k, x W_v                       per head, no rotary by default
    w_t = l2norm(SiLU(conv(x W_w↓ W_w↑)))               per head, rank-32 projection, short conv
    β_t = 2·sigmoid(x W_β + b_β)  ∈ (0, 2)              per head
    log f_t = log sigmoid(x W_f + b_f)                  with `forget_gate` (PaTH-FoX), b_f
                                                        starting at `forget_bias` (FoX's)
    o_i = Σ_{j ≤ i} softmax_j(q_iᵀ H_i ⋯ H_{j+1} k_j / √Dk + Σ_{j<l≤i} log f_l) v_j,
    H_t = I − β_t w_t w_tᵀ,    y = o W_o

The paper's layer, as flash-linear-attention's `PaTHAttention` builds it (`use_low_rank_w`,
`use_w_shortconv` with kernel 3, β = 2·sigmoid so that negative eigenvalues are reachable, an
optional forget gate, the output projection; no positional encoding, the transforms order the
tokens). For this mixer the common `conv` option is that short conv on w (default kernel 3;
False turns it off); q, k and v take none, as in FLA. `rope`, `out_norm` and `out_gate` are
allowed and off. Where it differs from FLA: the forget gate is FoX's, added to the logits
unscaled (FLA's kernel multiplies it by 1/√Dk with the logits: a constant factor on log f); no
q/k norm option (FLA's `use_qk_norm`, off by default there); grouped key/value heads are not
offered.

Paths: `__call__` runs the blockwise kernel (O(T) memory, custom VJP); `prefill` / `step` keep a
`ForgettingCache` of `max_length` slots whose keys are kept transported to the last token
(float32; a new token moves every stored key through its H_t, O(L·Dk)), with the cumulative log
gate and reset count per slot, plus the w conv's tail as the input state. Packed rows: each
document is mixed alone (the w conv reads no other document; the gate sums and attention reset
at its start). The output is not an affine map of a carried state, so there is no time split.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention import kernels as K
from linear_attention.kernels.softmax.gated_cache import empty_cache
from linear_attention.layers.base import Mixer
from linear_attention.layers.conv import ShortConv
from linear_attention.layers.delta import l2norm
from linear_attention.layers.fox import FORGET_BIAS
from linear_attention.layers.options import CONV, METHOD, MixerConfig, conv_kernel_size, option
from linear_attention.layers.projections import QKVProjection
from linear_attention.layers.segments import Segments

FORGET_GATE = option(False, "FoX's forget gate on the logits (PaTH-FoX)")


@dataclasses.dataclass(frozen=True)
class PathConfig(MixerConfig):
    conv: bool | int | None = CONV.field(3)  # for path: the short conv on w (FLA's kernel 3)
    method: str = METHOD.field("chunk", choices=K.PATH.supported)
    forget_gate: bool = FORGET_GATE.field()
    forget_bias: float = FORGET_BIAS.field()  # FoX's initial gate bias, with forget_gate


class PathInputs(nnx.Module):
    """q, k `[B, T, H, Dk]`, v `[B, T, H, Dv]` (`QKVProjection`, no conv) and the raw w
    `[B, T, H, Dk]` from a rank-`RANK` projection and an optional short conv (SiLU), whose tail
    `[B, K−1, H·Dk]` float32 is the decoding state."""

    RANK = 32  # FLA's low-rank w projection (use_low_rank_w)

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        qk_dim: int,
        v_dim: int,
        *,
        conv: int,
        rope: bool,
        rope_base: float,
        reset_positions: bool,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.num_heads, self.qk_dim = num_heads, qk_dim
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.qkv = QKVProjection(
            d_model,
            num_heads,
            qk_dim,
            v_dim,
            rope=rope,
            rope_base=rope_base,
            reset_positions=reset_positions,
            **common,
        )
        self.w_down = nnx.Linear(d_model, self.RANK, use_bias=False, **common)
        self.w_up = nnx.Linear(self.RANK, num_heads * qk_dim, use_bias=False, **common)
        self.conv = ShortConv(num_heads * qk_dim, conv, **common) if conv else None

    def init_state(self, batch_size: int) -> jax.Array | None:
        return None if self.conv is None else self.conv.init_state(batch_size)

    def __call__(self, x_BTD, conv_tail, position, segments: Segments | None = None):
        """`(q, k, v, w, new conv tail)`; `conv_tail=None` on a whole sequence (zeros)."""
        b, t, _ = x_BTD.shape
        q_BTHK, k_BTHK, v_BTHD, _ = self.qkv(x_BTD, None, position, segments)
        w_BTC = self.w_up(self.w_down(x_BTD))
        if self.conv is not None and segments is not None:  # packed rows (from empty)
            w_BTC = self.conv(w_BTC, segments.ids)
        elif self.conv is not None:
            conv_tail = self.conv.init_state(b) if conv_tail is None else conv_tail
            w_BTC, conv_tail = self.conv.prefill(w_BTC, conv_tail)
        w_BTHK = w_BTC.reshape(b, t, self.num_heads, self.qk_dim)
        return q_BTHK, k_BTHK, v_BTHD, w_BTHK, conv_tail


class PathMixer(Mixer):
    """PaTH attention: softmax attention with Householder-transported keys (see the module)."""

    NAME = "path"
    FAMILY = K.PATH
    OPTIONS = PathConfig
    BLOCK = 64  # the "chunk" kernel's block: its UT transform and its query/key block

    def _flops_sizes(self) -> dict:
        return dict(chunk_size=self.BLOCK)

    @classmethod
    def _check_family_options(cls, num_heads: int, options) -> None:
        if options["forget_bias"] and not options["forget_gate"]:
            raise ValueError(
                f"mixer 'path' uses forget_bias={options['forget_bias']!r} only with its forget "
                "gate: set forget_gate=True, or leave forget_bias at 0"
            )

    def _build_inputs(self, rngs: nnx.Rngs) -> nnx.Module:
        opts = self.options
        return PathInputs(
            self.d_model,
            self.num_heads,
            self.qk_dim,
            self.head_dim,
            conv=conv_kernel_size(opts["conv"]),
            rope=opts["rope"],
            rope_base=opts["rope_base"],
            reset_positions=opts["reset_positions"],
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )

    def _build(self, rngs: nnx.Rngs) -> None:
        gate = dict(use_bias=True, dtype=self.dtype, param_dtype=self.param_dtype, rngs=rngs)
        self.beta_proj = nnx.Linear(self.d_model, self.num_heads, **gate)
        bias = nnx.initializers.constant(self.options["forget_bias"])
        self.forget_gate = (
            nnx.Linear(self.d_model, self.num_heads, bias_init=bias, **gate)
            if self.options["forget_gate"]
            else None
        )

    def _init_core(self, batch_size: int, max_length: int):
        dtype = jnp.dtype(self.dtype or self.param_dtype)
        h, dk, dv = self.num_heads, self.qk_dim, self.head_dim
        # the stored keys are rewritten by every token's H_t: float32, as a state
        return empty_cache(batch_size, max_length, h, dk, dv, dtype, key_dtype=jnp.float32)

    def transforms(self, x_BTD, w_BTHK):
        """(unit w `[B, T, H, Dk]`, β = 2·sigmoid `[B, T, H]`, log f `[B, T, H]` or None), all
        float32."""
        beta_BTH = 2.0 * jax.nn.sigmoid(self.beta_proj(x_BTD).astype(jnp.float32))
        log_f = None
        if self.forget_gate is not None:
            log_f = jax.nn.log_sigmoid(self.forget_gate(x_BTD).astype(jnp.float32))
        return l2norm(w_BTHK), beta_BTH, log_f

    def _forward(self, x_BTD, tail, core, position, segments=None, *, step: bool = False):
        q, k, v, w, tail = self.inputs(x_BTD, tail, position, segments)
        w, beta, log_f = self.transforms(x_BTD, w)
        scale = self.qk_dim**-0.5
        if step:
            first = lambda z: None if z is None else z[:, 0]  # noqa: E731
            o, core = K.path_attention_step(
                core, position, *map(first, (q, k, v, w, beta, log_f)), scale=scale
            )
            o = o[:, None]
        elif core is None:
            o = K.path_attention(
                q,
                k,
                v,
                w,
                beta,
                log_f,
                segment_ids=segments,
                method=self.options["method"],
                block_size=self.BLOCK,
                scale=scale,
            )
        else:
            o, core = K.cached_path_attention(core, position, q, k, v, w, beta, log_f, scale=scale)
        return self.output(x_BTD, o), core, tail
