"""Diagonal recurrences h_t = exp(a_t) ⊙ h_{t−1} + u_t: the core of RG-LRU and the selective scan.

Every channel of the state `[B, *S]` (S = (D,) for RG-LRU, (D, N) for Mamba-1) is its own
scalar recurrence, with a log decay a_t ≤ 0 (−inf: a reset, the state zeroed before u_t is
written) and a write u_t. Three forms, float32 throughout:

- `diagonal_scan`: token by token (`lax.scan`), reading each state out as it goes, so no state
  per token is kept;
- `diagonal_associative`: the parallel prefix. A token is the affine map h ↦ exp(a) h + u, and
  two such maps compose associatively,

      (a₁, u₁) then (a₂, u₂)  =  (a₁ + a₂, exp(a₂) u₁ + u₂),

  so `lax.associative_scan` gives every h_t in O(log T) depth (a −inf log decay needs no care:
  the combine only adds log decays and multiplies by exp(a) = 0); it keeps a state per token;
- `diagonal_sequence_parallel`: time split over a mesh axis. A span is the affine map
  h_out = exp(Σ a_t) ⊙ h_in + U, the same map with a diagonal transition as causal linear
  attention's, so the shards' summaries compose by the shared `combine.prefix`; each shard
  then adds exp(b_t) ⊙ h_in to its states, b_t the cumulative log decay from its start.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention.kernels.primitives.combine import prefix, vary_like
from linear_attention.kernels.primitives.nan_guard import guard_inputs, poison, poison_state
from linear_attention.kernels.segments import decay_state


def diagonal_scan(a_BTS, u_BTS, h0_BS, read=None, c_BTX=None):
    """`(y_BT…, h_BS)` by `lax.scan`: y_t = read(h_t, c_t) (h_t itself for `read` None)."""

    def step(h, xs):
        a, u, c = xs
        h = decay_state(a, h) + u  # a select at a reset: 0·(a NaN state) never enters
        return h, h if read is None else read(h, c)

    move = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)  # noqa: E731
    h_BS, y_TB = jax.lax.scan(step, h0_BS, (move(a_BTS), move(u_BTS), move(c_BTX)))
    return jnp.moveaxis(y_TB, 0, 1), h_BS


def diagonal_associative(a_BTS, u_BTS, h0_BS):
    """`(h_BTS, h_BS)`: every state by the parallel prefix (module docstring)."""
    # the initial state enters as part of the first token's write
    u_BTS = u_BTS.at[:, 0].add(decay_state(a_BTS[:, 0], h0_BS))

    def combine(earlier, later):
        (a1, u1), (a2, u2) = earlier, later
        return a1 + a2, decay_state(a2, u1) + u2

    _, h_BTS = jax.lax.associative_scan(combine, (a_BTS, u_BTS), axis=1)
    return h_BTS, h_BTS[:, -1]


def diagonal_states(method, a_BTS, u_BTS, h0_BS):
    """`(h_BTS, h_BS)`, every state, by `method` ("scan" or "associative_scan")."""
    if method == "scan":
        return diagonal_scan(a_BTS, u_BTS, h0_BS)
    return diagonal_associative(a_BTS, u_BTS, h0_BS)


def diagonal_sequence_parallel(method, a_BTS, u_BTS, h0_BS, bad_end_BC, axis_name):
    """Every state with time split over `axis_name`: `(h_BTS, bad_in_BTC, h_BS)`.

    `a_BTS`, `u_BTS` this shard's clean log decays (resets folded in, its first token's too) and
    writes; `h0_BS` the global initial state (NaN entries allowed: `prefix` carries them);
    `bad_end_BC` whether a bad token of this span reaches its end, per channel C = S[0] (the
    NaN guard's `poisoned[:, -1]`). The states are the global ones (the entering state added);
    `bad_in_BTC` marks the tokens a bad entering state reaches (up to a reset); the final
    state is the global one on every shard, NaN in a channel a bad token reaches.
    """
    B, T = a_BTS.shape[:2]
    zero_BS = vary_like(jnp.zeros(h0_BS.shape, jnp.float32), u_BTS)
    h_BTS, u_BS = diagonal_states(method, a_BTS, u_BTS, zero_BS)
    b_BTS = jnp.cumsum(a_BTS, axis=1)  # −inf after a reset: exp gives 0, never NaN
    w_BTS = jnp.exp(b_BTS)
    # as the combine's [B, H, K, Dv] with H the channels: a NaN flag per channel
    to4 = lambda x: x.reshape(B, h0_BS.shape[1], -1, 1)  # noqa: E731
    reset_BTC = jnp.all(jnp.isneginf(b_BTS).reshape(B, T, h0_BS.shape[1], -1), -1)
    u_BS = jnp.where(bad_end_BC.reshape(bad_end_BC.shape + (1,) * (u_BS.ndim - 2)), jnp.nan, u_BS)
    s_in, bad_in_BC, s_out = prefix(
        to4(w_BTS[:, -1]), to4(u_BS), to4(h0_BS), reset_BTC[:, -1], axis_name, jnp.multiply
    )
    h_BTS = h_BTS + w_BTS * s_in.reshape(h0_BS.shape)[:, None]
    return h_BTS, bad_in_BC[:, None] & ~reset_BTC, s_out.reshape(h0_BS.shape)


def diagonal_call(method, a_BTS, u_BTS, h0_BS, axis_name=None, read=None, c_BTX=None):
    """A diagonal recurrence on float32 arrays, guarded: `(y_BT…, h_BS)`.

    `a_BTS` the log decays with the resets folded in (−inf), `u_BTS` the writes, `h0_BS` the
    initial state, `S = (C, …)` with C the channels the NaN guard tracks (a non-finite write
    or log decay poisons its channel's outputs up to the next reset, `nan_guard`). The outputs
    are y_t = read(h_t, c_t), `read` taking a state `[B, …, *S]` and `c` `[B, …, X]` with any
    leading time axis (h_t itself for `read` None). `axis_name`: time split over that mesh
    axis (`diagonal_sequence_parallel`); the final state is then the global one.
    """
    B, T = a_BTS.shape[:2]
    full = (lambda h, c: h) if read is None else read
    if T == 0:  # no token: the state passes through (and the guard has no last token to read)
        return full(u_BTS, c_BTX), h0_BS
    split = axis_name is not None
    shape_BTC = (B, T, h0_BS.shape[1])
    guard, (u_BTS,), a_BTS, (h0_BS,) = guard_inputs(
        shape_BTC, (u_BTS,), a_BTS, (h0_BS,), split=split
    )
    if split:
        h_BTS, bad_in_BTC, h_BS = diagonal_sequence_parallel(
            method, a_BTS, u_BTS, h0_BS, guard.poisoned_BTH[:, -1], axis_name
        )
        y = full(h_BTS, c_BTX)
        return poison(guard._replace(poisoned_BTH=guard.poisoned_BTH | bad_in_BTC), y), h_BS
    if method == "scan":
        y, h_BS = diagonal_scan(a_BTS, u_BTS, h0_BS, read, c_BTX)
    else:
        h_BTS, h_BS = diagonal_associative(a_BTS, u_BTS, h0_BS)
        y = full(h_BTS, c_BTX)
    return poison(guard, y), poison_state(guard, h_BS)
