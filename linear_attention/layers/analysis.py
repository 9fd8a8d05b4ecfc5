"""What a mixer attends with, for analysis: `attention_inputs(mixer, x)` (attention maps) and
`delta_keys(mixer, x)` (the keys a delta rule writes along).

Each mixer says what it attends with (`Mixer.attends_with`) and which keys it writes along
(`Mixer.write_keys`); the model never calls them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax


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
    `__call__`), as the mixer reports them (`Mixer.attends_with`): softmax, forgetting
    attention and the linear-attention family; the delta rule's output and a sliding window's
    are not the causal weighted sum of `AttentionInputs` (ValueError)."""
    mixer.check_input(x_BTD, 3, "[B, T, D]")
    inputs = mixer.attends_with(x_BTD)
    if inputs is None:
        raise ValueError(
            f"mixer {mixer.NAME!r} has no attention_inputs: only softmax, fox and the "
            "linear-attention family are a causal weighted sum of (q·k) v over past tokens"
        )
    return AttentionInputs(*inputs)


def delta_keys(mixer, x_BTD: jax.Array) -> jax.Array:
    """The unit keys k_t a delta-rule mixer (deltanet, gated_deltanet, gated_deltaproduct,
    kda) writes along on `x[B, T, D]`, a whole sequence from an empty state
    (`Mixer.write_keys`): the transition I − β_t k_t k_tᵀ reflects (β = 2) or removes (β = 1)
    the state's component along k_t. `[B, T, H, K]`, or `[B, T, H, n, K]` with n keys per token
    (gated_deltaproduct), float32."""
    mixer.check_input(x_BTD, 3, "[B, T, D]")
    keys = mixer.write_keys(x_BTD)
    if keys is None:
        raise ValueError(
            f"mixer {mixer.NAME!r} has no delta_keys: only the delta-rule mixers "
            "(DeltaNetMixer and its subclasses) write along keys"
        )
    return keys
