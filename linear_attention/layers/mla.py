"""Multi-head latent attention (`mla`; DeepSeek-V2, 2024, and the attention layers of Kimi
Linear): causal softmax attention whose keys and values are read out of one low-rank latent.

    q        = x W_q,  or  RMSNorm(x W_q↓) W_q↑ with `q_rank`          [B, T, H, Dn + Dr]
    [c, r]   = x W_kv↓                c [B, T, R] the latent (R = `kv_rank`), r [B, T, Dr]
    [k_n, v] = RMSNorm(c) W_kv↑       per head: k_n [Dn], v [Dv]
    k        = [k_n, r]               the last Dr key channels are the same for every head
    q[..., Dn:], r ← rope(·)          with `rope` only (Kimi Linear's layers have none: NoPE)
    o_t      = Σ_{s ≤ t} softmax_s(q_t·k_s / √(Dn + Dr)) v_s,      y = o W_o

Dv is `head_dim`, Dn `nope_dim` (None: head_dim), Dr `rope_dim` (None: head_dim / 2; 0: none).
The two latent norms have eps 1e-6 (as transformers' DeepSeek-V2 and Kimi Linear). Rotary, when
on, turns the Dr channels only, in this library's half-split layout.

The attention is the `softmax` family's (`kernels.softmax_attention` on the sequence,
`cached_softmax_attention` against a KV cache in `prefill` / `step`). The cache holds the
expanded keys `[B, L, H, Dn + Dr]` and values `[B, L, H, Dv]`, not the latent: the same numbers
as the full pass, at the memory of ordinary multi-head attention (absorbing W_kv↑ into q and
W_o to cache only [c, r] is the serving form, not done here). The common `out_norm` / `out_gate`
parts apply to o as in the other mixers (off by default, as in both models). No short conv,
and no split time axis.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from linear_attention.layers.norm import RMSNorm
from linear_attention.layers.options import MixerConfig, option
from linear_attention.layers.rotary import apply_rotary, check_rotary_dim
from linear_attention.layers.segments import Segments
from linear_attention.layers.softmax import SoftmaxMixer

LATENT_NORM_EPS = 1e-6

KV_RANK = option(None, "width R of the key/value latent (mla; None: 4 · head_dim)")
Q_RANK = option(None, "rank of the low-rank query projection, with its norm (mla; None: full)")
ROPE_DIM = option(
    None, "key channels shared by the heads, rotated with rope (mla; None: head_dim / 2)", minimum=0
)
NOPE_DIM = option(None, "per-head key channels read from the latent (mla; None: head_dim)")


@dataclasses.dataclass(frozen=True)
class MLAConfig(MixerConfig):
    """MLA's own options: the latent's width, the query's rank, the key's two parts."""

    kv_rank: int | None = KV_RANK.field()
    q_rank: int | None = Q_RANK.field()
    rope_dim: int | None = ROPE_DIM.field()
    nope_dim: int | None = NOPE_DIM.field()


def latent_sizes(head_dim: int, options) -> tuple[int, int, int]:
    """`(kv_rank, nope_dim, rope_dim)` with their defaults filled in."""
    rope_dim = options["rope_dim"]
    return (
        options["kv_rank"] or 4 * head_dim,
        options["nope_dim"] or head_dim,
        head_dim // 2 if rope_dim is None else rope_dim,
    )


class LatentProjection(nnx.Module):
    """MLA's input part: q `[B, T, H, Dn + Dr]`, k `[B, T, H, Dn + Dr]`, v `[B, T, H, Dv]` from
    the query projection and the key/value latent (no decoding state of its own)."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        v_dim: int,
        *,
        kv_rank: int,
        nope_dim: int,
        rope_dim: int,
        q_rank: int | None = None,
        rope: bool = False,
        rope_base: float = 10000.0,
        reset_positions: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.num_heads, self.v_dim = num_heads, v_dim
        self.kv_rank, self.nope_dim, self.rope_dim = kv_rank, nope_dim, rope_dim
        self.rope, self.rope_base, self.reset_positions = rope, rope_base, reset_positions
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        lin = dict(use_bias=False, **common)
        qk = num_heads * (nope_dim + rope_dim)
        if q_rank:
            self.q_down = nnx.Linear(d_model, q_rank, **lin)
            self.q_norm = RMSNorm(q_rank, eps=LATENT_NORM_EPS, **common)
            self.q_proj = nnx.Linear(q_rank, qk, **lin)
        else:
            self.q_down = self.q_norm = None
            self.q_proj = nnx.Linear(d_model, qk, **lin)
        self.kv_down = nnx.Linear(d_model, kv_rank + rope_dim, **lin)
        self.kv_norm = RMSNorm(kv_rank, eps=LATENT_NORM_EPS, **common)
        self.kv_up = nnx.Linear(kv_rank, num_heads * (nope_dim + v_dim), **lin)

    def init_state(self, batch_size: int) -> None:
        del batch_size  # every token's keys and values come from its own input

    def __call__(self, x_BTD, tail, position, segments: Segments | None = None):
        """`(q, k, v, None)`; `position` as `QKVProjection`'s (rotary only)."""
        del tail
        b, t, _ = x_BTD.shape
        h, dn, dr, dv = self.num_heads, self.nope_dim, self.rope_dim, self.v_dim
        if self.q_down is None:
            q_BTHK = self.q_proj(x_BTD)
        else:
            q_BTHK = self.q_proj(self.q_norm(self.q_down(x_BTD)))
        q_BTHK = q_BTHK.reshape(b, t, h, dn + dr)
        latent = self.kv_down(x_BTD)
        c_BTR, r_BT1K = latent[..., : self.kv_rank], latent[..., self.kv_rank :][:, :, None]
        kv_BTHF = self.kv_up(self.kv_norm(c_BTR)).reshape(b, t, h, dn + dv)
        kn_BTHK, v_BTHD = kv_BTHF[..., :dn], kv_BTHF[..., dn:]
        if self.rope and dr:
            positions = position + jnp.arange(t, dtype=jnp.int32)
            if segments is not None and self.reset_positions:
                positions = segments.positions  # [B, T]
            q_rot = apply_rotary(q_BTHK[..., dn:], positions, base=self.rope_base)
            q_BTHK = jnp.concatenate([q_BTHK[..., :dn], q_rot], axis=-1)
            r_BT1K = apply_rotary(r_BT1K, positions, base=self.rope_base)
        r_BTHK = jnp.broadcast_to(r_BT1K.astype(kn_BTHK.dtype), (b, t, h, dr))
        k_BTHK = jnp.concatenate([kn_BTHK, r_BTHK], axis=-1)
        return q_BTHK, k_BTHK, v_BTHD, None


class MLAMixer(SoftmaxMixer):
    """Multi-head latent attention: the softmax family with `LatentProjection` inputs."""

    NAME = "mla"
    OPTIONS = MLAConfig
    SEQUENCE_PARALLEL = False
    NOT_TAKEN = {"conv": "its keys and values come from the latent, with no short conv"}

    @classmethod
    def _qk_dim(cls, head_dim, options) -> int:
        _, nope_dim, rope_dim = latent_sizes(head_dim, options)
        return nope_dim + rope_dim

    @classmethod
    def check_config(cls, d_model, num_heads, config) -> None:
        # (rotary turns the rope_dim channels only: the base check of the whole q/k width
        # does not apply, so rope is checked here)
        super().check_config(d_model, num_heads, dataclasses.replace(config, rope=False))
        head_dim = config.head_dim or d_model // num_heads
        _, _, rope_dim = latent_sizes(head_dim, dataclasses.asdict(config))
        if config.rope:
            if not rope_dim:
                raise ValueError(f"rope needs rope_dim > 0 (mixer {cls.NAME!r})")
            check_rotary_dim("rope_dim", rope_dim)

    @classmethod
    def _check_family_options(cls, num_heads, options) -> None:
        """(none: softmax's checks are of options MLA does not have)"""

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    def _build_inputs(self, rngs: nnx.Rngs) -> nnx.Module:
        opts = self.options
        kv_rank, nope_dim, rope_dim = latent_sizes(self.head_dim, opts)
        return LatentProjection(
            self.d_model,
            self.num_heads,
            self.head_dim,
            kv_rank=kv_rank,
            nope_dim=nope_dim,
            rope_dim=rope_dim,
            q_rank=opts["q_rank"],
            rope=opts["rope"],
            rope_base=opts["rope_base"],
            reset_positions=opts["reset_positions"],
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )

    def _output_options(self) -> dict:
        return {}  # (the common out_norm / out_gate, silu; Kimi Linear and DeepSeek have none)
