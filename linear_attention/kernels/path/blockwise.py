"""PaTH attention by blocks: the Householder products in UT/WY form inside a block, the queries
carried back across blocks, an online softmax, and a custom VJP that keeps O(T) memory.

Notation (one head): H_t = I − β_t w_t w_tᵀ, and for j ≤ i the transport P_ij = H_i H_{i−1} ⋯
H_{j+1} (P_ii = I), so the logit is s_ij = q_iᵀ P_ij k_j + c_i − c_j (scale folded into q).
Time is cut into blocks of C tokens; block m holds W_m, β_m, K_m, Q_m `[C, ·]` (rows are tokens).

Inside a block (UT transform). With G = strict_lower((β ⊙ W) Wᵀ) and T = (I + G)⁻¹ (unit lower
triangular, `primitives.invert_unit_lower`), the product of the Householders of any contiguous
run S of the block, applied to a column vector, is

    H_max(S) ⋯ H_min(S) = I − W_Sᵀ T_S (β ⊙ W)_S,

and T_S is T's principal submatrix on S (the inverse of a lower-triangular matrix restricted to
a contiguous run is the inverse of the restriction). Taking S = (j, i], (j, end] and [start, i]:

    A_m = I − Wᵀ T (β ⊙ W)                 [D, D]  the whole block, H_last ⋯ H_first
    M   = strict_lower((β ⊙ W) Kᵀ),  TM = T M        M_lj = β_l w_l·k_j for l > j
    k̃_j = k_j − Σ_r TM_rj w_r               k_j carried to the block's end: H_last ⋯ H_{j+1} k_j
    q̃_i = q_i − Σ_{r ≤ i} (q_i·w_r)(T(β ⊙ W))_r        q_iᵀ H_i ⋯ H_first, as a row
    ℓ_ij = q_i·k_j − Σ_{r ≤ i} (q_i·w_r) TM_rj          = q_iᵀ P_ij k_j for j ≤ i in the block

Across blocks. For query i in block n and key j in block m < n,

    q_iᵀ P_ij k_j = q̃_iᵀ A_{n−1} A_{n−2} ⋯ A_{m+1} k̃_j,

so the query is carried back block by block: u_i ← q̃_i at key block n − 1, then u_i ← u_i A_m
after each key block m. One `lax.scan` walks the key blocks from the last to the first with every
query block at once (a query block n takes part once m < n), holding u `[T, D]` and the online
softmax (running max, sum and numerator per query, float32); the in-block logits ℓ start the
sums, so every row has seen its own key. Memory O(T·(D + Dv)) beyond the inputs; work
O(T²·(D + Dv) + T²·D²/C), about twice the causal count since masked block pairs are computed.

Gradient (custom VJP: autodiff of the scan would keep u, `[T, D]`, for every key block, which
is O(T²·D/C); a rematerialised scan keeps the carries all the same). The forward saves only its
inputs, o and the log-sum-exp per query. The backward recomputes the block terms under
`jax.vjp` (their pullback gives the cotangents of q, k, w and β from those of q̃, k̃, A and ℓ)
and then walks the query blocks in a `lax.scan`. For query block n:

  1. u^(m) = q̃_n A_{n−1} ⋯ A_{m+1} for m < n, by a scan from m = n − 1 down (`[T, D]` for this
     block only);
  2. p = exp(s − lse), dS = p ⊙ (dO Vᵀ − rowsum(dO ⊙ O)) against every key block at once;
     dV_m += pᵀ dO, dk̃_m += dSᵀ u^(m), dc_i += Σ_j dS_ij, dc_j −= Σ_i dS_ij;
  3. the cotangent of the carry runs the other way: with h_m = dS_m k̃_m and g^(−1) = 0,
     g^(m) = g^(m−1) A_mᵀ + h_m is the total cotangent of u^(m) (u^(m−1) = u^(m) A_m), so
     dA_m += u^(m)ᵀ g^(m−1) and dq̃_n = g^(n−1), by a scan from m = 0 up.

Nothing of size [T, T] and no per-token state is kept: the accumulators are `[T, D]`, `[T, Dv]`
and one `[D, D]` per block. The in-block logits' cotangent dℓ comes from the same p and dS.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from linear_attention.kernels.primitives.triangular import invert_unit_lower
from linear_attention.kernels.segments import masked_exp


class BlockTerms(NamedTuple):
    """The in-block UT terms of one or more blocks (leading axes batch, blocks)."""

    q: jax.Array  # [..., C, D] q̃: queries carried back to the block's start
    k: jax.Array  # [..., C, D] k̃: keys carried to the block's end
    a: jax.Array  # [..., D, D] A: the block's product H_last ⋯ H_first
    s: jax.Array  # [..., C, C] ℓ: in-block logits q_iᵀ P_ij k_j (meaningful for j ≤ i)


def block_terms(q_XCD, k_XCD, w_XCD, beta_XC) -> BlockTerms:
    """The UT terms of blocks of `C` tokens (float32, any leading axes): module docstring."""
    wb_XCD = w_XCD * beta_XC[..., None]
    t_XCC = invert_unit_lower(jnp.tril(wb_XCD @ jnp.swapaxes(w_XCD, -1, -2), -1))
    twb_XCD = t_XCC @ wb_XCD
    qw_XCC = jnp.tril(q_XCD @ jnp.swapaxes(w_XCD, -1, -2))  # r ≤ i
    tm_XCC = t_XCC @ jnp.tril(wb_XCD @ jnp.swapaxes(k_XCD, -1, -2), -1)
    eye = jnp.eye(w_XCD.shape[-1], dtype=w_XCD.dtype)
    return BlockTerms(
        q=q_XCD - qw_XCC @ twb_XCD,
        k=k_XCD - jnp.swapaxes(tm_XCC, -1, -2) @ w_XCD,
        a=eye - jnp.swapaxes(w_XCD, -1, -2) @ twb_XCD,
        s=q_XCD @ jnp.swapaxes(k_XCD, -1, -2) - qw_XCC @ tm_XCC,
    )


def path_blockwise(q, k, v, w, beta, c, groups, block: int):
    """PaTH attention, `[B, T, H, ·]` float32 (q scaled), c the cumulative log gate and `groups`
    the reset count `[B, T, H]`: o `[B, T, H, Dv]` float32 (module docstring)."""
    B, T, H, _ = q.shape
    C = min(block, T)
    N = -(-T // C)

    def to_blocks(x):  # [B, T, H, ...] -> [B·H, N, C, ...], zero-padded
        x = jnp.moveaxis(x, 2, 1)
        x = jnp.pad(x, [(0, 0), (0, 0), (0, N * C - T)] + [(0, 0)] * (x.ndim - 3))
        return x.reshape(B * H, N, C, *x.shape[3:])

    # padded tokens come after every real one: causality hides them, H = I (w = 0) on them
    o = _path(*map(to_blocks, (q, k, v, w, beta, c, groups)))
    o = o.reshape(B, H, N * C, -1)[:, :, :T]
    return jnp.moveaxis(o, 1, 2)


def _local(terms: BlockTerms, c, groups):
    """The in-block logits with the gate, −inf where masked: [X, N, C, C]."""
    C = c.shape[-1]
    visible = jnp.tril(jnp.ones((C, C), bool)) & (groups[..., :, None] == groups[..., None, :])
    return jnp.where(visible, terms.s + c[..., :, None] - c[..., None, :], -jnp.inf), visible


def _forward(terms: BlockTerms, v, c, groups):
    """o [X, N, C, Dv] and lse [X, N, C] (module docstring, "Across blocks")."""
    N = c.shape[1]
    blocks = jnp.arange(N)
    s_loc, _ = _local(terms, c, groups)
    max0 = jnp.max(s_loc, axis=-1)  # finite: each row sees its own key
    p = jnp.exp(s_loc - max0[..., None])
    init = (terms.q, max0, jnp.sum(p, -1), jnp.einsum("xnij,xnje->xnie", p, v))
    if N == 1:  # one block: nothing to carry (and no all-masked step for XLA to fold)
        return init[3] / init[2][..., None], max0 + jnp.log(init[2])

    def key_block(carry, xs):
        u, mx, total, acc = carry
        k_m, a_m, v_m, c_m, g_m, m = xs
        later = (blocks > m)[None, :, None, None]
        s = jnp.einsum("xnid,xjd->xnij", u, k_m) + c[..., :, None] - c_m[:, None, None, :]
        seen = later & (groups[..., :, None] == g_m[:, None, None, :])
        s = jnp.where(seen, s, -jnp.inf)
        new_mx = jnp.maximum(mx, jnp.max(s, axis=-1))
        p = jnp.exp(s - new_mx[..., None])
        rescale = jnp.exp(mx - new_mx)
        total = rescale * total + jnp.sum(p, -1)
        acc = rescale[..., None] * acc + jnp.einsum("xnij,xje->xnie", p, v_m)
        u = jnp.where(later, jnp.einsum("xnid,xde->xnie", u, a_m), u)
        return (u, new_mx, total, acc), None

    xs = (*(jnp.moveaxis(x, 1, 0) for x in (terms.k, terms.a, v, c, groups)), blocks)
    (_, mx, total, acc), _ = jax.lax.scan(key_block, init, xs, reverse=True)
    return acc / total[..., None], mx + jnp.log(total)


def _backward(terms: BlockTerms, v, c, groups, o, lse, do):
    """Cotangents of (terms, v, c) from do (module docstring, "Gradient")."""
    N = c.shape[1]
    blocks = jnp.arange(N)
    delta = jnp.sum(do * o, axis=-1)  # Σ_j p_ij (do_i·v_j), one per query
    s_loc, visible = _local(terms, c, groups)
    p_loc = masked_exp(visible, s_loc - lse[..., None])
    ds_loc = p_loc * (jnp.einsum("xnie,xnje->xnij", do, v) - delta[..., None])
    dv = jnp.einsum("xnij,xnie->xnje", p_loc, do)
    dc = jnp.sum(ds_loc, -1) - jnp.sum(ds_loc, -2)
    if N == 1:
        return (
            BlockTerms(
                q=jnp.zeros_like(terms.q),
                k=jnp.zeros_like(terms.k),
                a=jnp.zeros_like(terms.a),
                s=ds_loc,
            ),
            dv,
            dc,
        )
    a_seq = jnp.moveaxis(terms.a, 1, 0)

    def query_block(carry, xs):
        dk, da, dv, dc = carry
        q_n, do_n, c_n, g_n, lse_n, delta_n, n = xs

        def down(u, xs):  # u^(m) for m < n: emitted, then carried past block m
            a_m, m = xs
            return jnp.where(n > m, u @ a_m, u), u

        _, u_seq = jax.lax.scan(down, q_n, (a_seq, blocks), reverse=True)
        u_all = jnp.moveaxis(u_seq, 0, 1)  # [X, N, C, D]
        s = jnp.einsum("xmid,xmjd->xmij", u_all, terms.k)
        s = s + c_n[:, None, :, None] - c[:, :, None, :]
        seen = (blocks < n)[None, :, None, None] & (g_n[:, None, :, None] == groups[:, :, None, :])
        p = masked_exp(seen, s - lse_n[:, None, :, None])
        ds = p * (jnp.einsum("xie,xmje->xmij", do_n, v) - delta_n[:, None, :, None])
        dv = dv + jnp.einsum("xmij,xie->xmje", p, do_n)
        dk = dk + jnp.einsum("xmij,xmid->xmjd", ds, u_all)
        dc = (dc - jnp.sum(ds, axis=2)).at[:, n].add(jnp.sum(ds, axis=(1, 3)))
        h_seq = jnp.moveaxis(jnp.einsum("xmij,xmjd->xmid", ds, terms.k), 1, 0)

        def up(g, xs):  # g = g^(m−1) on entry
            a_m, h_m, u_m, m = xs
            live = m < n
            da_m = jnp.where(live, jnp.einsum("xid,xie->xde", u_m, g), 0.0)
            g = jnp.where(live, jnp.einsum("xie,xde->xid", g, a_m) + h_m, g)
            return g, da_m

        dq_n, da_seq = jax.lax.scan(up, jnp.zeros_like(q_n), (a_seq, h_seq, u_seq, blocks))
        return (dk, da + jnp.moveaxis(da_seq, 0, 1), dv, dc), dq_n

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (terms.q, do, c, groups, lse, delta)) + (blocks,)
    init = (jnp.zeros_like(terms.k), jnp.zeros_like(terms.a), dv, dc)
    (dk, da, dv, dc), dq_seq = jax.lax.scan(query_block, init, xs)
    dterms = BlockTerms(q=jnp.moveaxis(dq_seq, 0, 1), k=dk, a=da, s=ds_loc)
    return dterms, dv, dc


@jax.custom_vjp
def _path(q, k, v, w, beta, c, groups):
    return _forward(block_terms(q, k, w, beta), v, c, groups)[0]


def _path_fwd(q, k, v, w, beta, c, groups):
    o, lse = _forward(block_terms(q, k, w, beta), v, c, groups)
    return o, (q, k, v, w, beta, c, groups, o, lse)


def _path_bwd(residuals, do):
    q, k, v, w, beta, c, groups, o, lse = residuals
    terms, pullback = jax.vjp(block_terms, q, k, w, beta)
    dterms, dv, dc = _backward(terms, v, c, groups, o, lse, do)
    dq, dk, dw, dbeta = pullback(dterms)
    return dq, dk, dv, dw, dbeta, dc, None  # groups: integers, no cotangent


_path.defvjp(_path_fwd, _path_bwd)
