"""The sequential part of the delta family's chunk kernels: one affine map of the entering state
per chunk, walked by a `lax.scan` over groups of chunks, and its hand-written gradient.

Per chunk, with S the state entering it and the chunk's own (state-independent) terms
W [C, K], X₀ [C, Dv], Q [C, K], P [C, C], O₀ [C, Dv], E [C, K], U₀ [K, Dv], g [K] (or [1]):

    X  = W S                              (the state's effect on the chunk's writes)
    O  = Q S + P (X + X₀) + O₀
    S' = diag(g) S + Eᵀ (X + X₀) + U₀

Backward, given dO and dS' (the cotangent of the state leaving the chunk):

    dX = Pᵀ dO + E dS'
    dW = dX Sᵀ,   dQ = dO Sᵀ,   dP = dO Xᵀ,   dO₀ = dO,   dE = X dS'ᵀ,   dU₀ = dS'
    dg = Σ_d dS' ⊙ S   (summed over the value columns; over the keys too for g [1])
    dS = Qᵀ dO + Wᵀ dX + diag(g) dS'        (the cotangent carried to the previous chunk)

X₀ is the state-independent part of the writes (the delta rule's U = (I + A)⁻¹ diag(β) V: its
writes are U − W S), added to X before the two products that read it: P X₀ and Eᵀ X₀ cost no
matmul of their own, in the forward pass or the backward one. The backward pass reads X + X₀
where the lines above read X (dP = dO (X + X₀)ᵀ, dE = (X + X₀) dS'ᵀ) and dX₀ = dX, so that a
family's pullback needs no matmul of its own for X₀ either.

The forward pass keeps the state entering each chunk (one [K, Dv] state per chunk, never one
per token) and whatever small per-chunk residuals the family's `forward` returns; the backward
pass walks the groups last to first carrying dS, rebuilds each group's terms from those
residuals (`backward`), applies the lines above chunk by chunk, and hands the terms' cotangents
to the family's pullback, which maps them to its inputs by hand-derived matmuls.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Tokens per scan step: the state-independent work of a step's chunks is batched (fewer, larger
# ops than one chunk per step), while a step's temporaries stay small (never materialised for
# the whole sequence).
TOKENS_PER_STEP = 128


def chunks_per_step(chunk_size: int, num_chunks: int) -> int:
    """G: the chunks one scan step takes (T is padded to a multiple of G·C)."""
    return max(1, min(num_chunks, TOKENS_PER_STEP // chunk_size))


def affine_chunk_scan(s0_BHKD, xs, forward, group: int, backward=None):
    """Walk the chunks of a kernel whose chunk maps its entering state S affinely (see the module
    docstring), with a hand-written VJP when `backward` is given.

    `xs`: chunk-major inputs `[N, B, H, C, ...]` (N a multiple of `group`; integer arrays such
    as reset counts are allowed and get no cotangent). `forward(*xs_group) -> (terms, res)`:
    `terms = (W, X0, Q, P, O0, E, U0, g)` for `group` chunks, batched with a leading `[group]`
    axis (X0, O0 or U0 None where a family has none; g `[.., K]` or `[.., 1]`, or None for no
    decay), and `res` a tuple of arrays the backward pass needs (stored for every group: keep it
    to a few [C, C]- and [C, K]-sized arrays per chunk).
    `backward(xs_group, res_group) -> ((W, X0, Q, P, E, g), pullback)` rebuilds the terms the
    chain above reads, and `pullback(dW, dX0, dQ, dP, dO0, dE, dU0, dg)` returns the
    cotangents of `xs_group` (None for an integer input); dP and dE already hold X0's share.

    Without `backward`, autodiff differentiates `forward` through a rematerialised scan step.
    Returns `(O [N, B, H, C, Dv], S_final)`.
    """
    xs = tuple(xs)
    if backward is None:
        return _autodiff_scan(s0_BHKD, xs, forward, group)
    return _hand_scan(forward, backward, group, s0_BHKD, xs)


def _grouped(x, group):
    return x.reshape(x.shape[0] // group, group, *x.shape[1:])


def _ungrouped(x):
    # (sizes, not -1: an empty batch leaves -1 undetermined)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _chunk_maps(s_BHKD, terms, group, *, keep):
    """The affine maps of a group's chunks in order; the outputs `[group, ...]`, the leaving
    state, and with `keep` the state entering each chunk `[group, ...]`."""
    w, x0, q, p, o0, e, u0, g = terms
    outs, entering = [], []
    for i in range(group):  # a static loop over the step's chunks, not over time
        entering.append(s_BHKD)
        x = w[i] @ s_BHKD
        if x0 is not None:
            x = x + x0[i]
        o = q[i] @ s_BHKD + p[i] @ x
        outs.append(o if o0 is None else o + o0[i])
        decayed = s_BHKD if g is None else g[i][..., :, None] * s_BHKD
        s_BHKD = decayed + e[i].mT @ x
        if u0 is not None:
            s_BHKD = s_BHKD + u0[i]
    return jnp.stack(outs), s_BHKD, (jnp.stack(entering) if keep else None)


def _autodiff_scan(s0_BHKD, xs, forward, group):
    def step(s_BHKD, inputs):
        terms, _ = forward(*inputs)
        o, s_BHKD, _ = _chunk_maps(s_BHKD, terms, group, keep=False)
        return s_BHKD, o

    # Rematerialised: the backward pass keeps the state entering each step, not `forward`'s
    # intermediates for the whole sequence.
    s_BHKD, o = jax.lax.scan(jax.checkpoint(step), s0_BHKD, [_grouped(x, group) for x in xs])
    return _ungrouped(o), s_BHKD


def _walk(forward, group, s0_BHKD, xs, keep):
    def step(s_BHKD, inputs):
        terms, res = forward(*inputs)
        o, s_BHKD, entering = _chunk_maps(s_BHKD, terms, group, keep=keep)
        return s_BHKD, (o, entering, res if keep else None)

    s_BHKD, (o, entering, res) = jax.lax.scan(step, s0_BHKD, [_grouped(x, group) for x in xs])
    return _ungrouped(o), s_BHKD, entering, res


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _hand_scan(forward, backward, group, s0_BHKD, xs):
    o, s_BHKD, _, _ = _walk(forward, group, s0_BHKD, xs, keep=False)
    return o, s_BHKD


def _hand_scan_fwd(forward, backward, group, s0_BHKD, xs):
    o, s_BHKD, entering, res = _walk(forward, group, s0_BHKD, xs, keep=True)
    # Residuals: the inputs, the state entering each chunk and the family's per-chunk residuals.
    return (o, s_BHKD), (xs, entering, res)


def _hand_scan_bwd(forward, backward, group, residuals, cotangents):
    xs, entering, res = residuals
    do_N, ds_BHKD = cotangents

    def step(ds_next, inputs):
        x_group, s_group, do_group, res_group = inputs
        (w, x0, q, p, e, g), pullback = backward(x_group, res_group)
        d_terms = [[None] * group for _ in range(8)]
        for i in reversed(range(group)):
            s, do = s_group[i], do_group[i]
            x = w[i] @ s
            if x0 is not None:
                x = x + x0[i]
            dx = p[i].mT @ do + e[i] @ ds_next
            d_terms[0][i] = dx @ s.mT  # dW
            d_terms[1][i] = dx  # dX0
            d_terms[2][i] = do @ s.mT  # dQ
            d_terms[3][i] = do @ x.mT  # dP
            d_terms[4][i] = do  # dO0
            d_terms[5][i] = x @ ds_next.mT  # dE
            d_terms[6][i] = ds_next  # dU0
            ds = q[i].mT @ do + w[i].mT @ dx
            if g is not None:
                dg = jnp.sum(ds_next * s, -1)
                d_terms[7][i] = jnp.sum(dg, -1, keepdims=True) if g.shape[-1] == 1 else dg
                ds = ds + g[i][..., :, None] * ds_next
            else:
                ds = ds + ds_next
            ds_next = ds
        stacked = [None if parts[0] is None else jnp.stack(parts) for parts in d_terms]
        return ds_next, tuple(pullback(*stacked))

    inputs = ([_grouped(x, group) for x in xs], entering, _grouped(do_N, group), res)
    ds0_BHKD, dxs = jax.lax.scan(step, ds_BHKD, inputs, reverse=True)
    return ds0_BHKD, tuple(None if dx is None else _ungrouped(dx) for dx in dxs)


_hand_scan.defvjp(_hand_scan_fwd, _hand_scan_bwd)
