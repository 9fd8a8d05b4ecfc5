"""Griffin's Real-Gated Linear Recurrent Unit (RG-LRU), the recurrence of RecurrentGemma.

Per channel d of a `[B, T, D]` sequence, with a recurrence gate r_t, an input gate i_t and a
learnt Λ (the future mixer computes them), Griffin sets a_t = σ(Λ)^(c·r_t) (c = 8) and

    h_t = a_t ⊙ h_{t−1} + √(1 − a_t²) ⊙ (i_t ⊙ x_t),     y_t = h_t.

The kernel takes what varies with the recurrence itself, not the gates:

- `log_a_BTD` = log a_t = −c·r_t·softplus(−Λ) ≤ 0, in log space (a product of decays is a sum,
  a reset a −inf, as in every family here; σ(Λ)^(c·r) is never formed);
- `x_BTD` = i_t ⊙ x_t, the gated input.

It forms the write u_t = √(1 − exp(2 log a_t)) ⊙ x_t itself (with `expm1`, exact for a_t near
1, where 1 − a² loses every digit in float32): the normalisation keeps h_t's scale that of x_t
whatever a_t, and its derivative belongs to the recurrence. At a reset (a document start of
`segment_ids`) the write is x_t unscaled, as in RecurrentGemma: the state is zeroed there, so
nothing needs to be balanced against it. √ has an unbounded derivative at a_t = 1 (log a = 0,
a gate r_t = 0 exactly); there the write is 0 and so is its gradient.

Then h_t = exp(log a_t) h_{t−1} + u_t is a diagonal recurrence (`primitives/diagonal.py`):
"scan" token by token, "associative_scan" as a parallel prefix over the affine maps
(a₁, u₁)∘(a₂, u₂) = (a₁ + a₂, exp(a₂) u₁ + u₂), and `axis_name` splits time over a mesh axis
through the shared combine (`combine.prefix`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention.kernels.checks import check_float, check_layouts
from linear_attention.kernels.primitives.diagonal import (
    diagonal_associative,
    diagonal_call,
    diagonal_scan,
)
from linear_attention.kernels.primitives.family import Family, Method
from linear_attention.kernels.segments import decay_state, fold_resets, segment_resets


def rg_lru(x_BTD, log_a_BTD, *, initial_state=None, segment_ids=None, method="scan",
           axis_name=None):  # fmt: skip
    """The RG-LRU over a sequence: `(y_BTD, h_BD)` (module docstring).

    `x_BTD` the gated input i_t ⊙ x_t; `log_a_BTD` log a_t ≤ 0; `initial_state` `[B, D]` (None:
    zeros); `segment_ids` `[B, T]` packed rows (the state is zeroed at each document start);
    `method` "scan" or "associative_scan"; `axis_name` a mesh axis time is split over (inside
    `jax.shard_map`; the final state is then the global one on every shard). The outputs take
    the input dtype; the state is float32. A non-finite input poisons its channel's outputs up
    to the next reset, and nothing else.
    """
    method = RG_LRU.resolve(method, "rg_lru")
    arrays = {"x": (x_BTD, "[B, T, D]"), "log_a": (log_a_BTD, "[B, T, D]")}
    if initial_state is not None:
        arrays["initial_state"] = (initial_state, "[B, D]")
    sizes = check_layouts(**arrays)
    check_float(tuple(arrays), [x for x, _ in arrays.values()])
    B, T, D = sizes["B"], sizes["T"], sizes["D"]
    resets_BT = segment_resets(segment_ids, B, T, axis_name)
    log_a_BTD = jnp.asarray(log_a_BTD, jnp.float32)
    u_BTD = rg_lru_write(jnp.asarray(x_BTD, jnp.float32), log_a_BTD, resets_BT)
    a_BTD = fold_resets(resets_BT, log_a_BTD, D)
    h0_BD = (
        jnp.zeros((B, D), jnp.float32)
        if initial_state is None
        else jnp.asarray(initial_state, jnp.float32)
    )
    y_BTD, h_BD = diagonal_call(method, a_BTD, u_BTD, h0_BD, axis_name)
    return y_BTD.astype(x_BTD.dtype), h_BD


def rg_lru_step(x_BD, log_a_BD, state_BD):
    """One token of the RG-LRU: `(y_BD, h_BD)` from the state `[B, D]` (float32), the same
    arithmetic as one step of `rg_lru(method="scan")`."""
    log_a_BD = jnp.asarray(log_a_BD, jnp.float32)
    u_BD = rg_lru_write(jnp.asarray(x_BD, jnp.float32), log_a_BD)
    h_BD = decay_state(log_a_BD, jnp.asarray(state_BD, jnp.float32)) + u_BD
    return h_BD.astype(x_BD.dtype), h_BD


def rg_lru_write(x, log_a, resets_BT=None):
    """u = √(1 − exp(2 log a)) ⊙ x, x unscaled at the resets `[B, T]` (None: no reset).

    1 − a² = −expm1(2 log a), exact near a = 1; where it is 0 (a = 1) the factor and its
    gradient are 0, not √0's infinite derivative."""
    one_minus_a2 = -jnp.expm1(2.0 * log_a)
    positive = one_minus_a2 > 0
    factor = jnp.where(positive, jnp.sqrt(jnp.where(positive, one_minus_a2, 1.0)), 0.0)
    if resets_BT is not None:
        factor = jnp.where(resets_BT[..., None], 1.0, factor)
    return factor * x


def rg_lru_flops(*, width, **_):
    """Forward FLOPs per token, either method: 2·D for h ↦ a h + u and 2·D for the write
    √(1 − a²) x (`expm1`, `sqrt` and `exp` not counted, as in the other families). `width` = D,
    the family size the future mixer passes (the descriptor's `Method.flops`)."""
    return 4.0 * width


# The family's descriptor (`primitives.family`): both methods are exact; they differ in how the
# time axis is walked (a `lax.scan`, or the affine combine's parallel prefix).
RG_LRU = Family(
    name="rg_lru",
    methods={
        "scan": Method(diagonal_scan, rg_lru_flops),
        "associative_scan": Method(diagonal_associative, rg_lru_flops),
    },
    step=rg_lru_step,
    state=jax.Array,  # [B, D] (RG-LRU) or [B, D, N] (Mamba-1), float32
    splits_time=True,
)
