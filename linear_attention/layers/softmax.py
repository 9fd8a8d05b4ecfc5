"""Exact multi-head causal softmax attention with a fixed-size KV cache (the baseline mixer).

    o_t = Σ_{s ≤ t} softmax_s(q_t·k_s / √Dk) v_s

`__call__` calls `kernels.softmax_attention(causal=True)`. `prefill` / `step` write k, v into a
cache `[B, L, H, D]` at `position` (L = `max_length` of `init_state`) and attend with
`kernels.cached_softmax_attention` (slot s visible to position p iff s ≤ p; logits float32,
masked before `exp`), which reads only the filled blocks of the cache: a step at position N
costs O(N) whatever L, and a prefill never builds `[B, H, T, L]` logits. Writing past the end of
the cache cannot be caught at trace time (the position is traced), so those outputs are NaN
rather than wrong.

Options for the attention layers of released hybrids (Qwen3-Next, Qwen3.5, OLMo Hybrid), each
off by default: `num_kv_heads` HK (grouped-query attention: query head j reads key/value head
j // (H / HK); the cache holds the HK heads), `qk_norm` (RMSNorm of q and k per head, one scale
shared by the heads, before rotary; with `qk_norm_all_heads`, as OLMo's, over all of q's H·Dk
channels and all of k's HK·Dk at once, one scale per channel), `rotary_dim` (partial rotary:
the first channels of q and k rotate) and `gate_activation` "sigmoid" with `out_gate` (the
output gate σ(x W_g) before W_o).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from linear_attention import kernels as K
from linear_attention.kernels.softmax.context_parallel import softmax_context_parallel
from linear_attention.layers.base import Mixer
from linear_attention.layers.options import (
    GATE_ACTIVATION,
    NUM_KV_HEADS,
    QK_NORM,
    QK_NORM_ALL_HEADS,
    ROTARY_DIM,
    MixerConfig,
)
from linear_attention.layers.output import GATE_ACTIVATIONS
from linear_attention.layers.sequence import sequence_axis


@dataclasses.dataclass(frozen=True)
class SoftmaxConfig(MixerConfig):
    """Softmax attention's own options: grouped KV heads, q/k norm, partial rotary, gate."""

    num_kv_heads: int | None = NUM_KV_HEADS.field()
    qk_norm: bool = QK_NORM.field()
    qk_norm_all_heads: bool = QK_NORM_ALL_HEADS.field()
    rotary_dim: int | None = ROTARY_DIM.field()
    gate_activation: str = GATE_ACTIVATION.field(choices=tuple(GATE_ACTIVATIONS))


class KVCache(NamedTuple):
    """Keys `[B, L, HK, Dk]` and values `[B, L, HK, Dv]` in the compute dtype (HK: the
    key/value heads); slots at or after the mixer state's `position` are empty."""

    k: jax.Array
    v: jax.Array


class SoftmaxMixer(Mixer):
    """Causal softmax attention; use `rope=True` (or learned positions in the model) for order."""

    NAME = "softmax"
    OPTIONS = SoftmaxConfig
    SEQUENCE_PARALLEL = True
    CACHE_BLOCK = 512  # slots of the KV cache read per block by prefill / step

    @classmethod
    def _check_family_options(cls, num_heads, options) -> None:
        hk = options["num_kv_heads"]
        if hk is not None and num_heads % hk:
            raise ValueError(
                f"num_kv_heads={hk} must divide num_heads={num_heads} (mixer {cls.NAME!r})"
            )
        if options["qk_norm_all_heads"] and not options["qk_norm"]:
            raise ValueError(f"qk_norm_all_heads=True needs qk_norm=True (mixer {cls.NAME!r})")
        if options["rotary_dim"] is not None and not options["rope"]:
            raise ValueError(
                f"rotary_dim={options['rotary_dim']} needs rotary positions (rope) on "
                f"(mixer {cls.NAME!r})"
            )
        if options["gate_activation"] != "silu" and not options["out_gate"]:
            raise ValueError(
                f"gate_activation={options['gate_activation']!r} needs out_gate=True "
                f"(mixer {cls.NAME!r})"
            )

    @property
    def num_kv_heads(self) -> int:
        return self.options["num_kv_heads"] or self.num_heads

    def _input_options(self) -> dict:
        opts = self.options
        return dict(
            num_key_heads=self.num_kv_heads,
            num_value_heads=self.num_kv_heads,
            qk_norm=opts["qk_norm"],
            qk_norm_all_heads=opts["qk_norm_all_heads"],
            rotary_dim=opts["rotary_dim"],
        )

    def _output_options(self) -> dict:
        return dict(gate_activation=self.options["gate_activation"])

    def _grouped(self, x_BTHD):
        """Key/value heads repeated to the query heads (query head j reads head j // group)."""
        group = self.num_heads // self.num_kv_heads
        return x_BTHD if group == 1 else jnp.repeat(x_BTHD, group, axis=2)

    def mixing_flops(self, seq_len: int, *, method=None, chunk_size=None) -> float:
        """2·H·T·(dk + dv): QKᵀ and the weighted sum over all T keys (the convention of PaLM's
        MFU, Chowdhery et al. 2022, appendix B: causal masking is not discounted)."""
        return 2.0 * self.num_heads * seq_len * (self.qk_dim + self.head_dim)

    def _cache_dtype(self):
        return jnp.dtype(self.dtype or self.param_dtype)

    def _init_core(self, batch_size: int, max_length: int) -> KVCache:
        h, dtype = self.num_kv_heads, self._cache_dtype()
        return KVCache(
            k=jnp.zeros((batch_size, max_length, h, self.qk_dim), dtype),
            v=jnp.zeros((batch_size, max_length, h, self.head_dim), dtype),
        )

    def attends_with(self, x_BTD):
        q_BTHK, k_BTHK, v_BTHD, _ = self.inputs(x_BTD, None, 0)
        q_BTHK = q_BTHK * jnp.asarray(self.qk_dim**-0.5, q_BTHK.dtype)  # logits = q·k
        return q_BTHK, k_BTHK, v_BTHD, None

    def _mix(self, x_BTD, q_BTHK, k_BTHK, v_BTHD, core, position, segments=None):
        scale = self.qk_dim**-0.5
        if core is None:
            k_BTHK, v_BTHD = self._grouped(k_BTHK), self._grouped(v_BTHD)
        if core is None and sequence_axis() is not None:  # context parallel over the split
            o = softmax_context_parallel(
                q_BTHK,
                k_BTHK,
                v_BTHD,
                axis_name=sequence_axis(),
                scale=scale,
                segment_ids=None if segments is None else segments.ids,
            )
            return o, None
        if core is None:
            ids = {} if segments is None else dict(segment_ids=segments)
            o_BTHD = K.softmax_attention(q_BTHK, k_BTHK, v_BTHD, causal=True, scale=scale, **ids)
            return o_BTHD, None
        t, length = q_BTHK.shape[1], core.k.shape[1]
        if t > length:
            raise ValueError(f"cannot prefill {t} tokens into a KV cache of max_length {length}")
        start = (0, position, 0, 0)
        k_BLHK = jax.lax.dynamic_update_slice(core.k, k_BTHK.astype(core.k.dtype), start)
        v_BLHD = jax.lax.dynamic_update_slice(core.v, v_BTHD.astype(core.v.dtype), start)
        # Only the filled slots [0, position + t) are read, block by block (no [B, H, T, L]).
        o_BTHD = K.cached_softmax_attention(
            q_BTHK,
            self._grouped(k_BLHK),
            self._grouped(v_BLHD),
            position,
            scale=scale,
            block_size=self.CACHE_BLOCK,
        ).astype(v_BTHD.dtype)
        overflow = position + t > length  # the cache write above was clamped: refuse loudly
        o_BTHD = jnp.where(overflow, jnp.nan, o_BTHD).astype(v_BTHD.dtype)
        return o_BTHD, KVCache(k_BLHK, v_BLHD)

    def _mix_step(self, x_BD, q_BHK, k_BHK, v_BHD, core, position):
        o_B1HD, core = self._mix(
            x_BD[:, None], q_BHK[:, None], k_BHK[:, None], v_BHD[:, None], core, position
        )
        return o_B1HD[:, 0], core
