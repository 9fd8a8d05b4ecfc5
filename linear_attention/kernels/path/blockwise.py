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


def path_blockwise(q_BTHD, k_BTHD, v_BTHE, w_BTHD, beta_BTH, c_BTH, groups_BTH, block: int):
    """PaTH attention, `[B, T, H, ·]` float32 (q scaled), c the cumulative log gate and `groups`
    the reset count `[B, T, H]`: o `[B, T, H, Dv]` float32 (module docstring)."""
    B, T, H, _ = q_BTHD.shape
    C = min(block, T)
    N = -(-T // C)

    def to_blocks(x):  # [B, T, H, ...] -> [B·H, N, C, ...], zero-padded
        x = jnp.moveaxis(x, 2, 1)
        x = jnp.pad(x, [(0, 0), (0, 0), (0, N * C - T)] + [(0, 0)] * (x.ndim - 3))
        return x.reshape(B * H, N, C, *x.shape[3:])

    # padded tokens come after every real one: causality hides them, H = I (w = 0) on them
    o_XNCE = _path(*map(to_blocks, (q_BTHD, k_BTHD, v_BTHE, w_BTHD, beta_BTH, c_BTH, groups_BTH)))
    o_BHTE = o_XNCE.reshape(B, H, N * C, -1)[:, :, :T]
    return jnp.moveaxis(o_BHTE, 1, 2)


def _local(terms: BlockTerms, c_XNC, g_XNC):
    """The in-block logits with the gate, −inf where masked: [X, N, C, C]."""
    C = c_XNC.shape[-1]
    visible_XNCC = jnp.tril(jnp.ones((C, C), bool)) & (g_XNC[..., :, None] == g_XNC[..., None, :])
    return jnp.where(
        visible_XNCC, terms.s + c_XNC[..., :, None] - c_XNC[..., None, :], -jnp.inf
    ), visible_XNCC


def _forward(terms: BlockTerms, v_XNCE, c_XNC, g_XNC):
    """o [X, N, C, Dv] and lse [X, N, C] (module docstring, "Across blocks")."""
    N = c_XNC.shape[1]
    blocks = jnp.arange(N)
    sloc_XNCC, _ = _local(terms, c_XNC, g_XNC)
    max0_XNC = jnp.max(sloc_XNCC, axis=-1)  # finite: each row sees its own key
    p_XNCC = jnp.exp(sloc_XNCC - max0_XNC[..., None])
    init = (terms.q, max0_XNC, jnp.sum(p_XNCC, -1), jnp.einsum("xnij,xnje->xnie", p_XNCC, v_XNCE))
    if N == 1:  # one block: nothing to carry (and no all-masked step for XLA to fold)
        return init[3] / init[2][..., None], max0_XNC + jnp.log(init[2])

    def key_block(carry, xs):
        u_XNCD, max_XNC, sum_XNC, acc_XNCE = carry
        k_XCD, a_XDD, v_XCE, c_XC, g_XC, m = xs
        later_N = (blocks > m)[None, :, None, None]
        s_XNCC = (
            jnp.einsum("xnid,xjd->xnij", u_XNCD, k_XCD)
            + c_XNC[..., :, None]
            - c_XC[:, None, None, :]
        )
        seen_XNCC = later_N & (g_XNC[..., :, None] == g_XC[:, None, None, :])
        s_XNCC = jnp.where(seen_XNCC, s_XNCC, -jnp.inf)
        new_max_XNC = jnp.maximum(max_XNC, jnp.max(s_XNCC, axis=-1))
        p_XNCC = jnp.exp(s_XNCC - new_max_XNC[..., None])
        rescale_XNC = jnp.exp(max_XNC - new_max_XNC)
        sum_XNC = rescale_XNC * sum_XNC + jnp.sum(p_XNCC, -1)
        acc_XNCE = rescale_XNC[..., None] * acc_XNCE + jnp.einsum("xnij,xje->xnie", p_XNCC, v_XCE)
        u_XNCD = jnp.where(later_N, jnp.einsum("xnid,xde->xnie", u_XNCD, a_XDD), u_XNCD)
        return (u_XNCD, new_max_XNC, sum_XNC, acc_XNCE), None

    xs = (*(jnp.moveaxis(x, 1, 0) for x in (terms.k, terms.a, v_XNCE, c_XNC, g_XNC)), blocks)
    (_, max_XNC, sum_XNC, acc_XNCE), _ = jax.lax.scan(key_block, init, xs, reverse=True)
    return acc_XNCE / sum_XNC[..., None], max_XNC + jnp.log(sum_XNC)


def _local_backward(terms: BlockTerms, v_XNCE, c_XNC, g_XNC, lse_XNC, do_XNCE, delta_XNC):
    """The cotangents from each query block's own keys: `(ds of the local scores, dv, dc)`."""
    sloc_XNCC, visible_XNCC = _local(terms, c_XNC, g_XNC)
    ploc_XNCC = masked_exp(visible_XNCC, sloc_XNCC - lse_XNC[..., None])
    dsloc_XNCC = ploc_XNCC * (jnp.einsum("xnie,xnje->xnij", do_XNCE, v_XNCE) - delta_XNC[..., None])
    dv_XNCE = jnp.einsum("xnij,xnie->xnje", ploc_XNCC, do_XNCE)
    dc_XNC = jnp.sum(dsloc_XNCC, -1) - jnp.sum(dsloc_XNCC, -2)
    return dsloc_XNCC, dv_XNCE, dc_XNC


def _backward(terms: BlockTerms, v_XNCE, c_XNC, g_XNC, o_XNCE, lse_XNC, do_XNCE):
    """Cotangents of (terms, v, c) from do (module docstring, "Gradient")."""
    N = c_XNC.shape[1]
    blocks = jnp.arange(N)
    delta_XNC = jnp.sum(do_XNCE * o_XNCE, axis=-1)  # Σ_j p_ij (do_i·v_j), one per query
    dsloc_XNCC, dv_XNCE, dc_XNC = _local_backward(
        terms, v_XNCE, c_XNC, g_XNC, lse_XNC, do_XNCE, delta_XNC
    )
    if N == 1:  # q̃, k̃ and A only link blocks: with one, the local logits carry it all
        zeros = {name: jnp.zeros_like(getattr(terms, name)) for name in ("q", "k", "a")}
        return BlockTerms(**zeros, s=dsloc_XNCC), dv_XNCE, dc_XNC
    a_seq = jnp.moveaxis(terms.a, 1, 0)

    def query_block(carry, xs):
        dk_XNCD, da_XNDD, dv_XNCE, dc_XNC = carry
        q_XCD, do_XCE, c_XC, g_XC, lse_XC, delta_XC, n = xs

        def down(u_XCD, xs):  # u^(m) for m < n: emitted, then carried past block m
            a_XDD, m = xs
            return jnp.where(n > m, u_XCD @ a_XDD, u_XCD), u_XCD

        _, u_NXCD = jax.lax.scan(down, q_XCD, (a_seq, blocks), reverse=True)
        u_XNCD = jnp.moveaxis(u_NXCD, 0, 1)  # [X, N, C, D]
        s_XNCC = jnp.einsum("xmid,xmjd->xmij", u_XNCD, terms.k)
        s_XNCC = s_XNCC + c_XC[:, None, :, None] - c_XNC[:, :, None, :]
        seen_XNCC = (blocks < n)[None, :, None, None] & (
            g_XC[:, None, :, None] == g_XNC[:, :, None, :]
        )
        p_XNCC = masked_exp(seen_XNCC, s_XNCC - lse_XC[:, None, :, None])
        ds_XNCC = p_XNCC * (
            jnp.einsum("xie,xmje->xmij", do_XCE, v_XNCE) - delta_XC[:, None, :, None]
        )
        dv_XNCE = dv_XNCE + jnp.einsum("xmij,xie->xmje", p_XNCC, do_XCE)
        dk_XNCD = dk_XNCD + jnp.einsum("xmij,xmid->xmjd", ds_XNCC, u_XNCD)
        dc_XNC = (dc_XNC - jnp.sum(ds_XNCC, axis=2)).at[:, n].add(jnp.sum(ds_XNCC, axis=(1, 3)))
        h_NXCD = jnp.moveaxis(jnp.einsum("xmij,xmjd->xmid", ds_XNCC, terms.k), 1, 0)

        def up(g_XCD, xs):  # g = g^(m−1) on entry
            a_XDD, h_XCD, um_XCD, m = xs
            live = m < n
            da_XDD = jnp.where(live, jnp.einsum("xid,xie->xde", um_XCD, g_XCD), 0.0)
            g_XCD = jnp.where(live, jnp.einsum("xie,xde->xid", g_XCD, a_XDD) + h_XCD, g_XCD)
            return g_XCD, da_XDD

        dq_XCD, da_NXDD = jax.lax.scan(up, jnp.zeros_like(q_XCD), (a_seq, h_NXCD, u_NXCD, blocks))
        return (dk_XNCD, da_XNDD + jnp.moveaxis(da_NXDD, 0, 1), dv_XNCE, dc_XNC), dq_XCD

    xs = tuple(
        jnp.moveaxis(x, 1, 0) for x in (terms.q, do_XNCE, c_XNC, g_XNC, lse_XNC, delta_XNC)
    ) + (blocks,)
    init = (jnp.zeros_like(terms.k), jnp.zeros_like(terms.a), dv_XNCE, dc_XNC)
    (dk_XNCD, da_XNDD, dv_XNCE, dc_XNC), dq_NXCD = jax.lax.scan(query_block, init, xs)
    dterms = BlockTerms(q=jnp.moveaxis(dq_NXCD, 0, 1), k=dk_XNCD, a=da_XNDD, s=dsloc_XNCC)
    return dterms, dv_XNCE, dc_XNC


@jax.custom_vjp
def _path(q_XNCD, k_XNCD, v_XNCE, w_XNCD, beta_XNC, c_XNC, g_XNC):
    return _forward(block_terms(q_XNCD, k_XNCD, w_XNCD, beta_XNC), v_XNCE, c_XNC, g_XNC)[0]


def _path_fwd(q_XNCD, k_XNCD, v_XNCE, w_XNCD, beta_XNC, c_XNC, g_XNC):
    o_XNCE, lse_XNC = _forward(block_terms(q_XNCD, k_XNCD, w_XNCD, beta_XNC), v_XNCE, c_XNC, g_XNC)
    return o_XNCE, (q_XNCD, k_XNCD, v_XNCE, w_XNCD, beta_XNC, c_XNC, g_XNC, o_XNCE, lse_XNC)


def _path_bwd(residuals, do_XNCE):
    q_XNCD, k_XNCD, v_XNCE, w_XNCD, beta_XNC, c_XNC, g_XNC, o_XNCE, lse_XNC = residuals
    terms, pullback = jax.vjp(block_terms, q_XNCD, k_XNCD, w_XNCD, beta_XNC)
    dterms, dv_XNCE, dc_XNC = _backward(terms, v_XNCE, c_XNC, g_XNC, o_XNCE, lse_XNC, do_XNCE)
    dq_XNCD, dk_XNCD, dw_XNCD, dbeta_XNC = pullback(dterms)
    return (
        dq_XNCD,
        dk_XNCD,
        dv_XNCE,
        dw_XNCD,
        dbeta_XNC,
        dc_XNC,
        None,
    )  # groups: integers, no cotangent


_path.defvjp(_path_fwd, _path_bwd)
