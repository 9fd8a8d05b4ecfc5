"""Sliding-window softmax attention (`swa`) with a fixed-size ring-buffer decoding state.

    o_t = Σ_{t−W < s ≤ t} softmax_s(q_t·k_s / √Dk) v_s          W = `window` (default 64)

The projections and options are the `softmax` mixer's (short conv, rotary positions, output
norm / gate). `__call__` calls `kernels.sliding_window_attention` (blocks of ≥ W steps: O(T·W)
time and memory). The decoding state is a ring buffer of the last W keys and values
`[B, W, H, D]` in the compute dtype (position p in slot p mod W) plus the mixer state's
position: its size does not depend on `max_length` or on how many tokens were decoded, and
`prefill` / `step` attend over [ring in position order, new keys] with the same kernel, so the
three paths give the same numbers. Slots of positions < 0 (before the first token) are masked.

With time split over a mesh axis (`split_sequence`) each shard takes the previous shard's last
W − 1 keys and values by `ppermute` (a halo, as the short conv does), so a shard must hold at
least W − 1 tokens. Packed rows (`segment_ids`) mask keys of other documents.

Based (Arora et al. 2024, "Simple linear attention language models balance the recall-throughput
tradeoff") is this mixer hybridised with `taylor`: `ModelConfig(mixer=("taylor", "swa"),
conv=..., options=dict(feature_dim=16, window=...))` (see README, "Based").
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from linear_attention import kernels as K
from linear_attention.layers.base import Mixer
from linear_attention.layers.options import WINDOW, MixerConfig
from linear_attention.layers.sequence import previous_tail, sequence_axis


class RingBuffer(NamedTuple):
    """The last `window` keys `[B, W, H, Dk]` and values `[B, W, H, Dv]` (compute dtype); the
    token at position p sits in slot p mod W. Slots of positions < 0 hold zeros, never seen."""

    k: jax.Array
    v: jax.Array


@dataclasses.dataclass(frozen=True)
class SlidingWindowConfig(MixerConfig):
    window: int = WINDOW.field()


class SlidingWindowMixer(Mixer):
    """Causal softmax attention over the last `window` tokens; rope or learned positions give
    order within the window."""

    NAME = "swa"
    SEQUENCE_PARALLEL = True
    OPTIONS = SlidingWindowConfig
    SWEEP_FIELDS = {"window": "window"}
    BLOCK = 64  # query block of the sequence kernel (grown to the window if larger)

    def mixing_flops(self, seq_len: int, *, method=None, chunk_size=None) -> float:
        """2·H·min(W, T)·(dk + dv): softmax attention's count over the window."""
        return 2.0 * self.num_heads * min(self.window, seq_len) * (self.qk_dim + self.head_dim)

    def _build(self, rngs) -> None:
        self.window = self.options["window"]

    def _cache_dtype(self):
        return jnp.dtype(self.dtype or self.param_dtype)

    def _init_core(self, batch_size: int, max_length: int) -> RingBuffer:
        # W slots whatever max_length: the state size is fixed (decoding may run past it).
        h, w, dtype = self.num_heads, self.window, self._cache_dtype()
        return RingBuffer(
            k=jnp.zeros((batch_size, w, h, self.qk_dim), dtype),
            v=jnp.zeros((batch_size, w, h, self.head_dim), dtype),
        )

    def _attend(self, q_BTHK, k_BSHK, v_BSHD, position, segment_ids=None):
        return K.sliding_window_attention(
            q_BTHK,
            k_BSHK,
            v_BSHD,
            window=self.window,
            scale=self.qk_dim**-0.5,
            segment_ids=segment_ids,
            position=position,
            block_size=self.BLOCK,
        ).astype(v_BSHD.dtype)

    def _mix(self, x_BTD, q_BTHK, k_BTHK, v_BTHD, core, position, segments=None):
        segment_ids = None if segments is None else segments.ids
        b, t, h, _ = k_BTHK.shape
        w = self.window
        if core is None and sequence_axis() is not None and w > 1:
            # time split: prepend the previous shard's last W − 1 keys and values (a halo; on
            # the first shard they sit at negative positions and are masked)
            if t < w - 1:
                raise ValueError(
                    f"swa window={w} needs shards of at least window − 1 = {w - 1} tokens, got "
                    f"{t}; use fewer sequence shards (config.mesh.seq) or a smaller window"
                )
            kv_BTC = jnp.concatenate([k_BTHK.reshape(b, t, -1), v_BTHD.reshape(b, t, -1)], -1)
            halo_BWC = previous_tail(kv_BTC, w - 1)  # (float32)
            hk = h * self.qk_dim
            halo_k = halo_BWC[..., :hk].reshape(b, w - 1, h, self.qk_dim).astype(k_BTHK.dtype)
            halo_v = halo_BWC[..., hk:].reshape(b, w - 1, h, self.head_dim)
            k_BSHK = jnp.concatenate([halo_k, k_BTHK], axis=1)
            v_BSHD = jnp.concatenate([halo_v.astype(v_BTHD.dtype), v_BTHD], axis=1)
            if segment_ids is None:
                return self._attend(q_BTHK, k_BSHK, v_BSHD, position), None
            # Packed rows: the kernel masks documents for equal query and key lengths, so the
            # halo gets queries too (zeros, at positions − (W − 1) … −1 from the shard's first
            # token; their outputs are dropped) and its ids (the document ids are the row's).
            ids = previous_tail(segment_ids[..., None].astype(jnp.float32), w - 1)[..., 0]
            ids_BS = jnp.concatenate([ids.astype(segment_ids.dtype), segment_ids], axis=1)
            q_BSHK = jnp.concatenate([jnp.zeros_like(halo_k), q_BTHK], axis=1)
            o_BSHD = self._attend(q_BSHK, k_BSHK, v_BSHD, position - (w - 1), ids_BS)
            return o_BSHD[:, w - 1 :], None
        if core is None:
            return self._attend(q_BTHK, k_BTHK, v_BTHD, position, segment_ids), None
        # From a ring buffer: its slots in position order (positions p − W … p − 1), then the
        # new tokens; the new ring is the last W of them, put back in slots position mod W.
        slots_W = (position + jnp.arange(w, dtype=jnp.int32)) % w
        k_BSHK = jnp.concatenate([core.k[:, slots_W], k_BTHK.astype(core.k.dtype)], axis=1)
        v_BSHD = jnp.concatenate([core.v[:, slots_W], v_BTHD.astype(core.v.dtype)], axis=1)
        o_BTHD = self._attend(q_BTHK, k_BSHK, v_BSHD, position).astype(v_BTHD.dtype)
        latest_W = t + (jnp.arange(w, dtype=jnp.int32) - (position + t)) % w
        return o_BTHD, RingBuffer(k_BSHK[:, latest_W], v_BSHD[:, latest_W])

    def _mix_step(self, x_BD, q_BHK, k_BHK, v_BHD, core, position):
        o_B1HD, core = self._mix(
            x_BD[:, None], q_BHK[:, None], k_BHK[:, None], v_BHD[:, None], core, position
        )
        return o_B1HD[:, 0], core
