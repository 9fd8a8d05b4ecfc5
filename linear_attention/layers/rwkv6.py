"""RWKV-6 "Finch" time mixing (`rwkv6`, Peng et al. 2024): GLA with the bonus term u.

Per token, with x_{t−1} from the token shift (zero at a document start) and one learned
interpolation per branch c ∈ {r, w, k, v, g}, x_c = x_t + (x_{t−1} − x_t) ⊙ μ_c:

    r = x_r W_r,  k = x_k W_k,  v = x_v W_v                        per head [H, K], [H, Dv]
    log w = −exp(w₀ + tanh(x_w W₁) W₂)                            per key channel (< 0)
    S_t = Diag(w_t) S_{t−1} + k_t v_tᵀ
    o_t = S_{t−1}ᵀ r_t + (Σ_K r_t ⊙ u ⊙ k_t) v_t                  u: the bonus [H, K]
    y   = (GroupNorm(o) ⊙ silu(x_g W_g)) W_o

(FLA's `naive_recurrent_rwkv6` at scale 1.) The read sees the state before the token's own
write, which the linear kernel (o_t = S_tᵀ q_t, decay then write) gives with k, v and log w
shifted one token later: with k'_t = k_{t−1}, v'_t = v_{t−1}, log w'_t = log w_{t−1} the kernel's
state after token t is RWKV's after token t − 1, so o_t = kernel(r, k', v', w')_t + bonus_t, and
the state after the last token is one `recurrent_step` write of (k, v, w)_{T−1} (`rwkv6_attention`).
The shifted token is zero before the first token of a call and at every document start; with
time split (`layers.sequence`) it is the previous shard's last token (by `ppermute`). Dividing
by w instead (o_t = (r_t/w_t)ᵀ(S_t − k_t v_tᵀ)) would overflow where w underflows. Decoding
reads S before writing (`_forward` with `step`); the state is `LinearAttentionState(kv [B, H,
K, Dv], k_sum=None)`, float32, plus the token shift's last input `[B, 1, D]`.

Taken from RWKV-6 (BlinkDL's x060 time mix, at a middle layer: the mixer does not know its
depth): the decay's LoRA rank 64, w₀_i = −6 + 5·(i/(HK−1))^(0.7 + 1.3·½), u_i = ½·(1 −
i/(K−1)) + ((i + 1) mod 3 − 1)·0.1 per head, μ = 1 − (i/D)^p with p = (½·½, ½, ½, ½, ½·½) for
(r, w, k, v, g), GroupNorm eps 64e-5. Not taken: the data-dependent interpolation (ddlerp: μ
from a second LoRA of x; the static interpolation of `projections.ShiftedInputs` instead, as
RWKV-7's), and RWKV's matrix inits; `conv` and `rope` are refused as rwkv7's.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention import kernels as K
from linear_attention.layers.options import CHUNK_SIZE, CONV, METHOD, GatedOutputConfig
from linear_attention.layers.projections import LowRank
from linear_attention.layers.rwkv7 import GROUP_NORM_EPS, LAYER_RATIO, TokenShiftMixer
from linear_attention.layers.sequence import previous_tail, sequence_axis

DECAY_RANK = 64


def rwkv6_attention(
    r, k, v, log_w, u, *, method="chunk", chunk_size=64, initial_state=None, segments=None
):
    """RWKV-6's recurrence over `kernels.causal_linear_attention` (module docstring):

        S_t = Diag(w_t) S_{t−1} + k_t v_tᵀ,    o_t = S_{t−1}ᵀ r_t + (Σ_K r_t ⊙ u ⊙ k_t) v_t

    r, k `[B, T, H, K]`, v `[B, T, H, Dv]`, log w `[B, T, H, K]` (≤ 0, float32), u `[H, K]`;
    `segments` (a `Segments`) restarts the state at each document (only without
    `initial_state`); time split over `sequence_axis()` when one is set. Returns o in r's
    dtype, and with `initial_state` also the state after the last token."""
    b, t, h, dk = k.shape
    zero = lambda x: jnp.zeros_like(x[:, :1])  # noqa: E731
    if sequence_axis() is None:
        first = [zero(k), zero(v), zero(log_w)]
    else:  # the previous shard's last token
        flat = [x.reshape(b, t, -1) for x in (k, v, log_w)]
        tail = previous_tail(jnp.concatenate(flat, axis=-1), 1)
        sizes = np.cumsum([x.shape[-1] for x in flat])[:-1]
        first = [
            p.reshape(b, 1, h, -1).astype(x.dtype)
            for p, x in zip(jnp.split(tail, sizes, axis=-1), (k, v, log_w), strict=True)
        ]
    k_s, v_s, w_s = (
        jnp.concatenate([f, x[:, :-1]], axis=1) for f, x in zip(first, (k, v, log_w), strict=True)
    )
    if segments is not None:  # a document's first token reads an empty state (nothing shifted
        # in from the document before, not even a NaN the kernels would carry into this one)
        start = segments.starts[..., None, None]
        k_s, v_s, w_s = (jnp.where(start, jnp.zeros((), x.dtype), x) for x in (k_s, v_s, w_s))
    options = dict(
        log_decay=w_s,
        normalize=False,
        method=method,
        chunk_size=chunk_size,
        segment_ids=segments,
        axis_name=sequence_axis(),
    )
    bonus = bonus_term(r, k, v, u)
    if initial_state is None:
        o = K.causal_linear_attention(r, k_s, v_s, **options)
        return (o.astype(jnp.float32) + bonus).astype(o.dtype)
    o, state = K.causal_linear_attention(
        r, k_s, v_s, initial_state=initial_state, return_state=True, **options
    )
    last = lambda x: x[:, -1]  # noqa: E731
    _, state = K.recurrent_step(
        state, last(k), last(k), last(v), log_decay=last(log_w), normalize=False
    )
    return (o.astype(jnp.float32) + bonus).astype(o.dtype), state


def bonus_term(r, k, v, u):
    """The current token's term (Σ_K r ⊙ u ⊙ k) v, float32 `[..., H, Dv]`."""
    weight = jnp.sum(r.astype(jnp.float32) * u * k.astype(jnp.float32), -1, keepdims=True)
    return weight * v.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class RWKV6Config(GatedOutputConfig):
    conv: bool | int | None = CONV.field(False)
    method: str = METHOD.field(choices=K.LINEAR.supported)
    chunk_size: int = CHUNK_SIZE.field()


class RWKV6Mixer(TokenShiftMixer):
    """RWKV-6 time mixing: token shift, per-channel data-dependent decay, bonus u, GroupNorm."""

    NAME = "rwkv6"
    FAMILY = K.LINEAR
    OPTIONS = RWKV6Config
    # RWKV-6's token-shift exponents (× the layer ratio 1 − depth) of branches r, w, k, v, g
    SHIFT_POWERS = (0.5, 1.0, 1.0, 1.0, 0.5)

    def _output_options(self) -> dict:
        return dict(norm_type="layer", norm_eps=GROUP_NORM_EPS)

    def _build(self, rngs) -> None:
        opts = self.options
        self.method, self.chunk_size = opts["method"], opts["chunk_size"]
        h, dk, dv = self.num_heads, self.qk_dim, self.head_dim
        lin = dict(use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, rngs=rngs)
        self.receptance = nnx.Linear(self.d_model, h * dk, **lin)
        self.key = nnx.Linear(self.d_model, h * dk, **lin)
        self.value = nnx.Linear(self.d_model, h * dv, **lin)
        ratio = np.arange(h * dk) / max(h * dk - 1, 1)
        w0 = -6.0 + 5.0 * ratio ** (0.7 + 1.3 * LAYER_RATIO)
        self.decay = LowRank(
            self.d_model,
            h * dk,
            DECAY_RANK,
            activation="tanh",
            bias=w0,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )
        i = np.arange(dk)
        u = 0.5 * (1.0 - i / max(dk - 1, 1)) + ((i + 1) % 3 - 1) * 0.1
        self.bonus = nnx.Param(jnp.asarray(np.broadcast_to(u, (h, dk)), self.param_dtype))

    def _forward(self, x_BTD, tail, core, position, segments=None, *, step: bool = False):
        del position  # no positions
        b, t, _ = x_BTD.shape
        h, dk, dv = self.num_heads, self.qk_dim, self.head_dim
        (x_r, x_w, x_k, x_v, x_g), tail = self.inputs(x_BTD, tail, segments)
        r = self.receptance(x_r).reshape(b, t, h, dk)
        k = self.key(x_k).reshape(b, t, h, dk)
        v = self.value(x_v).reshape(b, t, h, dv)
        log_w = -jnp.exp(self.decay(x_w)).reshape(b, t, h, dk)
        u = self.bonus[...].astype(jnp.float32)
        if step:  # read the state, then write the token
            first = lambda z: z[:, 0]  # noqa: E731
            read = jnp.einsum("bhk,bhkd->bhd", first(r).astype(jnp.float32), core.kv)
            o = (read + bonus_term(first(r), first(k), first(v), u)).astype(r.dtype)[:, None]
            _, core = K.recurrent_step(
                core, *map(first, (r, k, v)), log_decay=first(log_w), normalize=False
            )
        else:
            options = dict(method=self.method, chunk_size=self.chunk_size, segments=segments)
            if core is None:
                o = rwkv6_attention(r, k, v, log_w, u, **options)
            else:
                o, core = rwkv6_attention(r, k, v, log_w, u, initial_state=core, **options)
        return self.output(x_g, o), core, tail


__all__ = ["RWKV6Mixer", "rwkv6_attention"]
