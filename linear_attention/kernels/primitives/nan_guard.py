"""A NaN stays where it arose: the guard every recurrent kernel runs its methods inside.

In the recurrence a non-finite input at token s (a key, value, gate or log decay that is NaN or
+inf) reaches the outputs t ≥ s of its own head until the next reset, and nothing else: a reset
forgets it and no earlier output reads it. The fast forms cannot keep that by themselves. A reset
is a decay factor exp(−inf) = 0 and 0·NaN = NaN, and a chunk form's causal mask is a product
with a masked matrix, so a NaN at s spreads to every row of its chunk (earlier ones included)
and through every reset after it. So no NaN enters the arithmetic at all:

  1. `nan_guard` finds the bad tokens (`ok` False: some write input of the token is non-finite,
     per batch row and head) and the outputs they reach (`poisoned`: t ≥ s with no reset in
     (s, t], the recurrence's own rule; also the outputs before the first reset when the initial
     state is non-finite);
  2. the kernel runs on clean inputs (`clean`: a bad token writes nothing; `clean_log_decay`: a
     NaN log decay is 0, a reset stays, since the reset is what stops the NaN);
  3. the outputs it reaches are selected to NaN (`poison`, `poison_state`).

Every step is a select, never a product with 0, so every other output is bit-for-bit the output
of the same call without the NaN (the clean token's terms enter those outputs only through
factors that are exactly 0 in both runs). A query enters only its own output, which every form
computes row by row, so queries need no guard. The gradient of a loss on the finite outputs is
finite: a poisoned output's cotangent stops at the select, and a bad input gets a zero one.
Cost: one pass over the inputs (an `isfinite` reduction each), a parallel prefix over `[B, T, H]`
booleans and the selects (BENCHMARKS.md).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class NanGuard(NamedTuple):
    """ok_BTH: the token's write inputs are finite; poisoned_BTH: a bad token (or a bad initial
    state) reaches the token's output; both `[B, T, H]` bool."""

    ok_BTH: jax.Array
    poisoned_BTH: jax.Array


def _finite_per_token(x, shape_BTH):
    """`[B, T, H]` bool: every entry of token (b, t, h) of `x` `[B, T, H or 1, ...]` is finite.
    A sum is finite iff every term is (one reduction, not an elementwise test per entry), unless
    finite terms overflow it, which only marks a token of huge values bad."""
    x = jnp.asarray(x, jnp.float32)
    total = jnp.sum(x, axis=tuple(range(3, x.ndim)))  # (axes, not a reshape: B or H may be 0)
    return jnp.broadcast_to(jnp.isfinite(total), shape_BTH)


def _bad_log_decay(a_BTHX):
    """A log decay entry that is NaN or +inf (−inf is a reset, finite values are decays)."""
    return jnp.isnan(a_BTHX) | jnp.isposinf(a_BTHX)


def nan_guard(shape_BTH, inputs, log_decay=None, *, resets=None, initial_states=()) -> NanGuard:
    """The guard of one call: `shape_BTH` = (B, T, H); `inputs` the write inputs `[B, T, H or 1,
    ...]` (None entries skipped); `log_decay` `[B, T, H]` or `[B, T, H, K]` with the resets
    folded in, or None; `resets` `[B, T]` or `[B, T, H]` bool, the tokens before which the whole
    state is zeroed (None: where `log_decay` is −inf in every key channel; a family whose −inf
    decay keeps part of its state passes its own); `initial_states` arrays `[B, H, ...]` whose
    non-finite entries poison their head up to its first reset."""
    ok_BTH = jnp.ones(shape_BTH, bool)
    for x in inputs:
        if x is not None:
            ok_BTH = ok_BTH & _finite_per_token(x, shape_BTH)
    a = None
    if log_decay is not None:
        a = log_decay if log_decay.ndim == 4 else log_decay[..., None]
        ok_BTH = ok_BTH & ~jnp.any(_bad_log_decay(a), -1)
    if resets is None:
        resets = jnp.zeros(shape_BTH, bool) if a is None else jnp.all(jnp.isneginf(a), -1)
    resets_BTH = jnp.broadcast_to(resets if resets.ndim == 3 else resets[..., None], shape_BTH)

    def compose(earlier, later):  # (a reset in the span, a bad token after its last reset)
        (r1, b1), (r2, b2) = earlier, later
        return r1 | r2, b2 | (b1 & ~r2)

    # a parallel prefix, not cumsum/cummax: on the CPU those lower to O(T) windows per token
    reset_seen_BTH, poisoned_BTH = jax.lax.associative_scan(compose, (resets_BTH, ~ok_BTH), axis=1)
    for s in initial_states:
        if s is not None:
            s = jnp.asarray(s, jnp.float32)
            bad_BH = ~jnp.isfinite(jnp.sum(s, axis=tuple(range(2, s.ndim))))
            poisoned_BTH = poisoned_BTH | (bad_BH[:, None] & ~reset_seen_BTH)
    return NanGuard(ok_BTH, poisoned_BTH)


def guard_inputs(shape_BTH, writes, log_decay, initial_states=(), *, resets=None, split=False):
    """`nan_guard` and the clean inputs of one call: `(guard, clean writes, clean log decay,
    clean initial states)`. With `split` (time split over a mesh axis) the initial states are
    left as they are: the combine (`combine.prefix`) carries their NaN itself."""
    guard = nan_guard(
        shape_BTH, writes, log_decay, resets=resets, initial_states=() if split else initial_states
    )
    states = tuple(initial_states) if split else tuple(clean_initial(s) for s in initial_states)
    return guard, tuple(clean(guard, x) for x in writes), clean_log_decay(log_decay), states


def _token_mask(mask_BTH, x):
    """`[B, T, H]` broadcast against `x` `[B, T, H or 1, ...]` (heads shared: any of them)."""
    if x.shape[2] != mask_BTH.shape[2]:
        mask_BTH = jnp.all(mask_BTH, axis=2, keepdims=True)
    return mask_BTH.reshape(mask_BTH.shape + (1,) * (x.ndim - 3))


def clean(guard: NanGuard, x):
    """`x` `[B, T, H or 1, ...]` with the bad tokens' entries 0 (None stays None). Inputs whose
    heads are shared (H = 1 under the guard's H) are zeroed where any head is bad."""
    if x is None:
        return None
    return jnp.where(_token_mask(guard.ok_BTH, x), x, jnp.zeros((), x.dtype))


def clean_initial(s):
    """An initial state `[B, H, ...]` with non-finite entries 0 (its outputs are poisoned)."""
    if s is None:
        return None
    return jnp.where(jnp.isfinite(s), s, jnp.zeros((), s.dtype))


def clean_log_decay(a):
    """A log decay `[B, T, H]` or `[B, T, H, K]` with its NaN and +inf entries 0 and every other
    entry as it is: resets (−inf) stay, since a reset is what stops the NaN, and a finite decay
    of a bad token stays, since a later document's chunk sums may read it (a cumulative sum
    across the reset, exact up to rounding)."""
    if a is None:
        return None
    return jnp.where(_bad_log_decay(a), 0.0, a)


def poison(guard: NanGuard, o):
    """The outputs `o` `[B, T, H, ...]` a bad token reaches set to NaN."""
    return jnp.where(_token_mask(guard.poisoned_BTH, o), jnp.nan, o)


def poison_state(guard: NanGuard, s):
    """A final state `[B, H, ...]` set to NaN where the last token is poisoned."""
    if s is None:
        return None
    bad_BH = guard.poisoned_BTH[:, -1]
    return jnp.where(bad_BH.reshape(bad_BH.shape + (1,) * (s.ndim - 2)), jnp.nan, s)
