"""Mamba-1's selective scan: a diagonal state `[D, N]` per sequence, input-dependent Δ, B and C.

Per channel d of a `[B, T, D]` input x, with a step size Δ_t > 0 per channel (the mixer's
softplus of its projection and bias), a fixed A `[D, N]` (negative: A = −exp(A_log)), an input
map B_t and a read-out C_t `[N]` shared by the channels, and a skip D `[D]`, the zero-order-hold
discretisation of h' = A h + B x (with Mamba's simplified B̄ = Δ B) gives

    h_t = exp(Δ_t A) ⊙ h_{t−1} + Δ_t x_t B_t,     y_t = C_t · h_t + D ⊙ x_t,

h_t `[D, N]`, a scalar recurrence per (d, n): a diagonal recurrence (`primitives/diagonal.py`)
with log decay a_t = Δ_t A `[D, N]` (≤ 0; a reset of `segment_ids` is −inf) and write
u_t = (Δ_t x_t) ⊗ B_t. "scan" runs it token by token and reads y_t out at each step (no state
per token is kept); "associative_scan" is the parallel prefix over the affine maps
(a₁, u₁)∘(a₂, u₂) = (a₁ + a₂, exp(a₂) u₁ + u₂), which keeps a `[B, T, D, N]` state per token;
`axis_name` splits time over a mesh axis through the shared combine (`combine.prefix`). The
output gate y ⊙ silu(z) and the projections are the mixer's.
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


def selective_scan(x_BTD, delta_BTD, A_DN, B_BTN, C_BTN, D_D=None, *, initial_state=None,
                   segment_ids=None, method="scan", axis_name=None):  # fmt: skip
    """The selective scan over a sequence: `(y_BTD, h_BDN)` (module docstring).

    `x_BTD` the input, `delta_BTD` Δ_t > 0, `A_DN` the (negative) state matrix, `B_BTN` and
    `C_BTN` the input map and the read-out, `D_D` the skip (None: no skip); `initial_state`
    `[B, D, N]` (None: zeros); `segment_ids` `[B, T]` packed rows (the state is zeroed at each
    document start); `method` "scan" or "associative_scan"; `axis_name` a mesh axis time is
    split over (inside `jax.shard_map`; the final state is then the global one on every
    shard). The outputs take x's dtype; the state is float32. A non-finite x, Δ, A or B
    poisons its channel's outputs up to the next reset, and nothing else.
    """
    method = SELECTIVE_SCAN.resolve(method, "selective_scan")
    arrays = {
        "x": (x_BTD, "[B, T, D]"),
        "delta": (delta_BTD, "[B, T, D]"),
        "A": (A_DN, "[D, N]"),
        "B": (B_BTN, "[B, T, N]"),
        "C": (C_BTN, "[B, T, N]"),
    }
    if D_D is not None:
        arrays["D"] = (D_D, "[D]")
    if initial_state is not None:
        arrays["initial_state"] = (initial_state, "[B, D, N]")
    sizes = check_layouts(**arrays)
    check_float(tuple(arrays), [x for x, _ in arrays.values()])
    Bn, T, D, N = sizes["B"], sizes["T"], sizes["D"], sizes["N"]
    f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)  # noqa: E731
    x, delta, A, Bm, C, skip = map(f32, (x_BTD, delta_BTD, A_DN, B_BTN, C_BTN, D_D))
    a_BTDN, u_BTDN = _decay_and_write(x, delta, A, Bm)
    a_BTDN = fold_resets(segment_resets(segment_ids, Bn, T, axis_name), a_BTDN, D)
    h0_BDN = jnp.zeros((Bn, D, N), jnp.float32) if initial_state is None else f32(initial_state)
    y_BTD, h_BDN = diagonal_call(method, a_BTDN, u_BTDN, h0_BDN, axis_name, _read, C)
    if skip is not None:
        y_BTD = y_BTD + skip * x
    return y_BTD.astype(x_BTD.dtype), h_BDN


def selective_scan_step(x_BD, delta_BD, A_DN, B_BN, C_BN, D_D, state_BDN):
    """One token of the selective scan: `(y_BD, h_BDN)` from the state `[B, D, N]` (float32),
    the same arithmetic as one step of `selective_scan(method="scan")`; `D_D` may be None."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    x = f32(x_BD)
    a_BDN, u_BDN = _decay_and_write(x, f32(delta_BD), f32(A_DN), f32(B_BN))
    h_BDN = decay_state(a_BDN, f32(state_BDN)) + u_BDN
    y_BD = _read(h_BDN, f32(C_BN))
    if D_D is not None:
        y_BD = y_BD + f32(D_D) * x
    return y_BD.astype(x_BD.dtype), h_BDN


def _decay_and_write(x_D, delta_D, A_DN, B_N):
    """The log decay Δ A and the write (Δ x) ⊗ B, `[..., D, N]`, for any leading axes."""
    return delta_D[..., None] * A_DN, (delta_D * x_D)[..., None] * B_N[..., None, :]


def _read(h_DN, c_N):
    """C · h per channel, `[..., D]`, for any leading axes (a state per token or one)."""
    return jnp.einsum("...dn,...n->...d", h_DN, c_N)


def selective_scan_flops(*, width, state_size, **_):
    """Forward FLOPs per token, either method: per entry of the `[D, N]` state 2 for
    h ↦ exp(Δ A) h + u, 2 for the write (Δ A and (Δ x) B) and 2 for the read-out C · h, and 2·D
    for the skip D x (the `exp` not counted, as in the other families). `width` = D,
    `state_size` = N."""
    return 6.0 * width * state_size + 2.0 * width


# The family's descriptor (`primitives.family`): both methods are exact; they differ in how the
# time axis is walked (a `lax.scan`, or the affine combine's parallel prefix).
SELECTIVE_SCAN = Family(
    name="selective_scan",
    methods={
        "scan": Method(diagonal_scan, selective_scan_flops),
        "associative_scan": Method(diagonal_associative, selective_scan_flops),
    },
    step=selective_scan_step,
    state=jax.Array,  # [B, D] (RG-LRU) or [B, D, N] (Mamba-1), float32
    splits_time=True,
)
