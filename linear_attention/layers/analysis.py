"""What a mixer attends with, for analysis: `attention_inputs(mixer, x)` (attention maps) and
`delta_keys(mixer, x)` (the keys a delta rule writes along).

This reads the mixer's parts (its input projection, feature map and decay) and is kept out of the
mixer classes: the model never calls it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from linear_attention.layers.delta import DeltaNetMixer
from linear_attention.layers.fox import FoxMixer
from linear_attention.layers.linear import GatedMixer, LinearMixer
from linear_attention.layers.softmax import SoftmaxMixer


class AttentionInputs(NamedTuple):
    """What a mixer attends with on a whole sequence (`attention_inputs`), so that

        o_t = Σ_{s ≤ t} w(q_t·k_s) · exp(Σ_{r=s+1..t} log_decay_r) v_s   (then normalised)

    with w = exp and a softmax over s for softmax and forgetting attention (q already scaled by
    Dk^-½; fox's log decay is its forget gate), w = identity for
    linear mixers (q, k are the features φ(q), φ(k); normalised by the same sum with w(q·k) = q·k
    when the mixer divides by φ(q)ᵀz). q, k `[B, T, H, M]`, v `[B, T, H, Dv]` in the compute
    dtype; `log_decay` float32 `[B, T, H]`, `[B, T, H, M]` (per key dimension), or None."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    log_decay: jax.Array | None


def attention_inputs(mixer, x_BTD: jax.Array) -> AttentionInputs:
    """The featurised queries and keys, values and log decay `mixer` attends with on
    `x[B, T, D]` (a whole sequence from an empty state; projection, conv and rotary as in its
    `__call__`). Softmax, forgetting attention and the linear-attention family only: the delta
    rule's output and a sliding window's are not the causal weighted sum of `AttentionInputs`
    (ValueError)."""
    if not isinstance(mixer, SoftmaxMixer | FoxMixer | LinearMixer):
        raise ValueError(
            f"mixer {mixer.NAME!r} has no attention_inputs: only softmax, fox and the "
            "linear-attention family are a causal weighted sum of (q·k) v over past tokens"
        )
    mixer.check_input(x_BTD, 3, "[B, T, D]")
    q_BTHK, k_BTHK, v_BTHD, _ = mixer.inputs(x_BTD, None, 0)
    if isinstance(mixer, SoftmaxMixer | FoxMixer):
        q_BTHK = q_BTHK * jnp.asarray(mixer.qk_dim**-0.5, q_BTHK.dtype)  # logits = q·k
        log_forget = mixer.log_forget(x_BTD) if isinstance(mixer, FoxMixer) else None
        return AttentionInputs(q_BTHK, k_BTHK, v_BTHD, log_forget)
    phi_q_BTHM, phi_k_BTHM = mixer.featurize(q_BTHK, k_BTHK)
    if isinstance(mixer, GatedMixer):  # grouped q/k heads, k scaled by dt (Mamba-2's options)
        if mixer.skip is not None:
            raise ValueError(
                "a gated mixer with d_skip adds D·v to the weighted sum: no attention_inputs"
            )
        phi_q_BTHM, phi_k_BTHM, log_decay = mixer.per_value_head(x_BTD, phi_q_BTHM, phi_k_BTHM)
        return AttentionInputs(phi_q_BTHM, phi_k_BTHM, v_BTHD, log_decay)
    log_decay = mixer.decay(x_BTD) if mixer.decay is not None else None
    if log_decay is not None:  # [H] (fixed) or [B, T, H] -> [B, T, H]; [B, T, H, M] as is
        b, t, h = q_BTHK.shape[:3]
        shape = (b, t, h) if log_decay.ndim < 4 else (b, t, h, log_decay.shape[-1])
        log_decay = jnp.broadcast_to(log_decay, shape)
    return AttentionInputs(phi_q_BTHM, phi_k_BTHM, v_BTHD, log_decay)


def delta_keys(mixer, x_BTD: jax.Array) -> jax.Array:
    """The unit keys k_t a delta-rule mixer (deltanet, gated_deltanet, gated_deltaproduct,
    kda) writes along on `x[B, T, D]`, a whole sequence from an empty state: the transition
    I − β_t k_t k_tᵀ reflects (β = 2) or removes (β = 1) the state's component along k_t.
    `[B, T, H, K]`, or `[B, T, H, n, K]` with n keys per token (gated_deltaproduct), float32."""
    if not isinstance(mixer, DeltaNetMixer):
        raise ValueError(
            f"mixer {mixer.NAME!r} has no delta_keys: only the delta-rule mixers "
            "(DeltaNetMixer and its subclasses) write along keys"
        )
    mixer.check_input(x_BTD, 3, "[B, T, D]")
    q_BTHK, k_BTHK, v_BTHD, _ = mixer.inputs(x_BTD, None, 0)
    _, k_BTHK, _ = mixer.prepare(q_BTHK, k_BTHK, v_BTHD)
    return k_BTHK.astype(jnp.float32)
