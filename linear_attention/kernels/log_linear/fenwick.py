"""The Fenwick-tree arithmetic of log-linear attention, shared by every method.

Positions are absolute (0-based). Query i sees key j ≤ i at level

    ℓ(i, j) = bit_length(i XOR j)

ℓ = 0 is the token itself; for j < i, ℓ − 1 is the highest bit where i and j differ (i has it
set, j not), so level ℓ of position i is the bucket [i with its low ℓ bits cleared, i with its
low ℓ − 1 bits cleared): 2^(ℓ−1) keys, present iff bit ℓ − 1 of i is set. These are the buckets
of the Fenwick decomposition of i's prefix, and the convention of FLA's `naive.py`
(`construct_level_mask`: bit ℓ − 1 of i set, i − 2^(ℓ−1) − (i mod 2^(ℓ−1)) ≤ j <
i − (i mod 2^(ℓ−1))). With L level weights (levels 0..L − 1) positions up to 2^(L−1) − 1 are
covered; later ones are an overflow.

The state between tokens (after t tokens, before position t) is the list of level states
S^ℓ = Σ_{j: ℓ(t, j) = ℓ} exp(Σ_{j<u<t} a_u) k_j v_jᵀ for ℓ = 1..L, stored as one array
`[B, H, L, K, V]` whose slot s holds level s + 1 (level L is filled only when t = 2^(L−1), the
capacity). Token t then
  1. decays every level by exp(a_t) and reads o_t = λ⁰ (q_t·k_t) v_t + Σ_ℓ λ^ℓ q_tᵀ S^ℓ;
  2. moves to position t + 1: with r the number of trailing ones of t (bit_length(t ⊕ (t+1))
     − 1), levels 1..r and the token itself merge into level r + 1 (empty before, since bit r of
     t is 0), levels above r keep their keys (t + 1 agrees with t above bit r), and levels 1..r
     are left empty.

Two facts make a state usable anywhere (an initial state at position P, not aligned to chunks;
a final state at E = P + T): for a query i ≥ P, the keys of P's level ℓ all sit at level
max(ℓ, bit_length(i ⊕ P)) of i (if i agrees with P above bit ℓ − 1 it has bit ℓ − 1 set as P
does, otherwise the highest bit where i and P differ decides for every key of the bucket); and
a key j < E sits at level bit_length(E ⊕ j) of E. So an initial state is read and a final state
collected in parallel, without walking the tokens in between (`read_state`, `final_state`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention.kernels.segments import cumulative_log_decay, masked_exp


def bit_length(x):
    """The number of bits of the non-negative int32 `x` (0 for 0)."""
    x = jnp.asarray(x, jnp.int32)
    return 32 - jax.lax.clz(x)


def levels_needed(length: int) -> int:
    """L, the level weights positions 0..length − 1 need: bit_length(length − 1) + 1."""
    return int(length - 1).bit_length() + 1


def capacity(num_levels: int) -> int:
    """The positions L level weights cover: 2^(L−1)."""
    return 1 << (num_levels - 1)


def level_table(size: int) -> np.ndarray:
    """`[size, size]` int: ℓ(i, j) for 0 ≤ j ≤ i < size (−1 above the diagonal), the levels inside
    a block aligned to a multiple of `size` (a power of two): they depend on i, j mod size only."""
    i, j = np.arange(size)[:, None], np.arange(size)[None, :]
    xor = i ^ j
    level = np.zeros_like(xor)
    for bit in range(int(size).bit_length()):
        level = np.where(xor >= (1 << bit), bit + 1, level)
    return np.where(j <= i, level, -1)


def merge(levels_BHLKV, u_BHKV, position):
    """The Fenwick merge after the token (or chunk) at `position`: levels 1..r and `u` (the
    token's or chunk's own keys, decayed like the levels) become level r + 1, r the trailing
    ones of `position` (see the module docstring). Slots past the last are dropped (overflow)."""
    p = jnp.asarray(position, jnp.int32)
    r = bit_length(p ^ (p + 1)) - 1
    slot = jnp.arange(levels_BHLKV.shape[2])[:, None, None]
    below = slot < r
    merged_BHKV = u_BHKV + jnp.sum(jnp.where(below, levels_BHLKV, 0.0), axis=2)
    kept = jnp.where(below, 0.0, levels_BHLKV)
    return kept + jnp.where(slot == r, merged_BHKV[:, :, None], 0.0)


def padded_weights(lam_BTHL):
    """λ with a zero weight for level L (filled only at the capacity, never read in range)."""
    return jnp.concatenate([lam_BTHL, jnp.zeros_like(lam_BTHL[..., :1])], axis=-1)


def read_state(q_BTHK, lam_BTHL, a_BTH, s0_BHLKV, position):
    """The initial state's part of every output: token i (at position P + i) reads slot s of the
    state at P (level s + 1) at its level max(s + 1, bit_length((P + i) ⊕ P)), decayed by
    exp(Σ_{u ≤ i} a_u) (0 past a reset)."""
    T, L = q_BTHK.shape[1], s0_BHLKV.shape[2]
    p = jnp.asarray(position, jnp.int32)
    low_T = bit_length((p + jnp.arange(T, dtype=jnp.int32)) ^ p)
    level_TL = jnp.maximum(jnp.arange(1, L + 1)[None, :], low_T[:, None])
    lam_BTHL1 = padded_weights(lam_BTHL)
    idx = jnp.minimum(level_TL, lam_BTHL1.shape[-1] - 1)
    w_BTHL = jnp.take_along_axis(lam_BTHL1, idx[None, :, None, :], axis=-1)
    b_BTH, n_BTH = cumulative_log_decay(a_BTH, axis=1, restart=True)
    w_BTHL = w_BTHL * masked_exp(n_BTH == 0, b_BTH)[..., None]
    return jnp.einsum("bthl,bthk,bhlkv->bthv", w_BTHL, q_BTHK, s0_BHLKV)


def final_state(k_BTHK, v_BTHV, a_BTH, s0_BHLKV, position):
    """The state after the T tokens at positions P..P + T − 1 (E = P + T): key j goes to slot
    bit_length(E ⊕ (P + j)) − 1 decayed by exp(Σ_{j<u<T} a_u), the initial state's slot s to
    slot max(s, bit_length(E ⊕ P) − 1) decayed by exp(Σ_u a_u); 0 across a reset. A [T, L]
    one-hot per token: O(T·L·K·V), the cost of the initial state's read."""
    T, L = k_BTHK.shape[1], s0_BHLKV.shape[2]
    p = jnp.asarray(position, jnp.int32)
    end = p + T
    slot_T = bit_length(end ^ (p + jnp.arange(T, dtype=jnp.int32))) - 1
    b_BTH, n_BTH = cumulative_log_decay(a_BTH, axis=1, restart=True)
    b_last, n_last = b_BTH[:, -1:], n_BTH[:, -1:]
    w_BTH = masked_exp(n_BTH == n_last, b_last - b_BTH)
    onehot_TL = (slot_T[:, None] == jnp.arange(L)[None, :]).astype(jnp.float32)
    w_BTHL = w_BTH[..., None] * onehot_TL[None, :, None, :]
    s_BHLKV = jnp.einsum("bthl,bthk,bthv->bhlkv", w_BTHL, k_BTHK, v_BTHV)
    # the old slots: s -> max(s, bit_length(E ⊕ P) − 1), all decayed by the whole span
    low = bit_length(end ^ p) - 1
    move_SL = (jnp.maximum(jnp.arange(L), low)[:, None] == jnp.arange(L)[None, :]).astype(
        jnp.float32
    )
    total_BH = masked_exp(n_last[:, 0] == 0, b_last[:, 0])
    moved = jnp.einsum("sl,bhskv->bhlkv", move_SL, s0_BHLKV)
    return s_BHLKV + total_BH[..., None, None, None] * moved
