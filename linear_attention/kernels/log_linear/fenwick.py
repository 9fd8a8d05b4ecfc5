"""The Fenwick-tree arithmetic of log-linear attention, shared by every method.

Each token has a Fenwick position p: the number of tokens before it in its sequence (0 at a
reset or a document start, which begins a new sequence). Query i sees key j of its sequence
(j ≤ i) at level

    ℓ(i, j) = bit_length(p_i XOR p_j)

ℓ = 0 is the token itself; for j < i, ℓ − 1 is the highest bit where p_i and p_j differ (p_i has
it set, p_j not), so level ℓ of position p is the bucket [p with its low ℓ bits cleared, p with
its low ℓ − 1 bits cleared): 2^(ℓ−1) keys, present iff bit ℓ − 1 of p is set. These are the
buckets of the Fenwick decomposition of p's prefix, the convention of FLA's `naive.py`
(`construct_level_mask`: bit ℓ − 1 of i set, i − 2^(ℓ−1) − (i mod 2^(ℓ−1)) ≤ j <
i − (i mod 2^(ℓ−1))). L level weights (levels 0..L − 1) cover positions below 2^(L−1)
(`capacity`); later ones are an overflow.

The state after P tokens of a sequence is the list of its level states, slot s holding level
s + 1 (L slots, level L filled only when P = 2^(L−1)):

    S^ℓ = Σ_{j: ℓ(P, j) = ℓ} exp(Σ_{j<u<P} a_u) k_j v_jᵀ

One token at position P decays every level by exp(a), reads o = λ⁰ (q·k) v + Σ_ℓ λ^ℓ qᵀ S^ℓ,
and moves the state to P + 1 (`merge`): with r the number of trailing ones of P
(bit_length(P ⊕ (P + 1)) − 1), levels 1..r and the token merge into level r + 1 (empty before:
bit r of P is 0), levels above r keep their keys (P + 1 agrees with P above bit r).

Two facts let a state be read and moved across many tokens at once, so the chunk form needs no
alignment of chunks to positions: for a query at position p ≥ P, the keys of P's level ℓ all sit
at level max(ℓ, bit_length(p ⊕ P)) (if p agrees with P above bit ℓ − 1 it has bit ℓ − 1 set, as
P does; otherwise the highest bit where p and P differ decides for every key of the bucket:
`read_weights`); and a key at p_j < E sits at level bit_length(E ⊕ p_j) of the state at E
(`write_slots`), so the state at P moves to E slot by slot (`move`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LogLinearState(NamedTuple):
    """The decoding state of log-linear attention: `levels [B, H, L, K, V]` float32 (slot s:
    level s + 1) and `position [B, H]` int32, the tokens of the current sequence seen (per head:
    a −inf log decay of one head restarts that head's sequence). A pytree."""

    levels: jax.Array
    position: jax.Array

    @classmethod
    def zeros(cls, batch: int, heads: int, num_levels: int, key_dim: int, value_dim: int):
        """The state before the first token."""
        return cls(
            levels=jnp.zeros((batch, heads, num_levels, key_dim, value_dim), jnp.float32),
            position=jnp.zeros((batch, heads), jnp.int32),
        )


def bit_length(x):
    """The number of bits of the non-negative int32 `x` (0 for 0)."""
    return 32 - jax.lax.clz(jnp.asarray(x, jnp.int32))


def capacity(num_levels: int) -> int:
    """The positions L level weights cover: 2^(L−1)."""
    return 1 << (num_levels - 1)


def positions(a_BTH, p0_BH):
    """`[B, T, H]` int32 Fenwick positions: p0 + t until the first reset (a = −inf), then the
    tokens since the last reset."""
    T = a_BTH.shape[1]
    t = jnp.arange(T, dtype=jnp.int32)[None, :, None]
    last = jax.lax.cummax(jnp.where(jnp.isneginf(a_BTH), t, -1), axis=1)
    return jnp.where(last >= 0, t - last, p0_BH[:, None, :] + t)


def padded_weights(lam):
    """λ `[..., L]` with a zero weight for level L (filled only at the capacity)."""
    return jnp.concatenate([lam, jnp.zeros_like(lam[..., :1])], axis=-1)


def gather_levels(lam, level):
    """λ `[..., L]` at integer levels `level [..., X]` (0 past the weights: an overflow)."""
    lam1 = padded_weights(lam)
    return jnp.take_along_axis(lam1, jnp.clip(level, 0, lam1.shape[-1] - 1), axis=-1)


def read_weights(lam, p, P, num_slots: int):
    """`[..., C, L]`: the weight with which a query at position p `[..., C]` (λ `[..., C, L]`)
    reads slot s of the state at position P `[...]`: λ at level max(s + 1, bit_length(p ⊕ P))."""
    low = bit_length(p ^ P[..., None])
    level = jnp.maximum(jnp.arange(1, num_slots + 1), low[..., None])
    return gather_levels(lam, level)


def write_slots(p, E, num_slots: int):
    """`[..., C, L]` float32 one-hot: the slot bit_length(E ⊕ p) − 1 of the state at E `[...]`
    holding the key at position p `[..., C]` (none for a key past the capacity)."""
    slot = bit_length(p ^ E[..., None]) - 1
    return (slot[..., None] == jnp.arange(num_slots)).astype(jnp.float32)


def move(P, E, num_slots: int):
    """`[..., L, L]` float32 one-hot: slot s of the state at P `[...]` becomes slot
    max(s, bit_length(E ⊕ P) − 1) of the state at E > P."""
    low = bit_length(E ^ P) - 1
    target = jnp.maximum(jnp.arange(num_slots), low[..., None])  # [..., L]
    return (target[..., None] == jnp.arange(num_slots)).astype(jnp.float32)


def merge(levels_BHLKV, u_BHKV, P_BH):
    """The Fenwick merge after the token at position P `[B, H]`: levels 1..r and `u` (the
    token's k vᵀ) become level r + 1, r the trailing ones of P (see the module docstring)."""
    r = (bit_length(P_BH ^ (P_BH + 1)) - 1)[..., None, None, None]
    slot = jnp.arange(levels_BHLKV.shape[2])[:, None, None]
    below = slot < r
    merged_BHKV = u_BHKV + jnp.sum(jnp.where(below, levels_BHLKV, 0.0), axis=2)
    kept = jnp.where(below, 0.0, levels_BHLKV)
    return kept + jnp.where(slot == r, merged_BHKV[:, :, None], 0.0)
