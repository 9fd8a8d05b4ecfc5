"""Conjugate gradient with a fixed number of iterations, batched over every leading axis.

For a symmetric positive definite A (MesaNet's H_kk,t + Λ, λ > 0) and a right-hand side b, CG
from x₀ = 0 builds x_i in the Krylov space span{b, Ab, …, A^{i−1}b} minimising the A-norm of the
error: exact after K iterations in exact arithmetic (A is K×K), and the error falls like
((√κ − 1)/(√κ + 1))^i with κ the condition number. The count is static, so the loop compiles to
a fixed `fori_loop` (reverse-differentiable: the recurrent reference differentiates through it;
the chunked form differentiates the solve implicitly instead).

Per iteration, each right-hand side (a row of the leading axes) carries x, the residual
r = b − Ax, the direction p and δ = rᵀr:

    α = δ / pᵀAp,   x ← x + αp,   r ← r − αAp,   δ' = rᵀr,   p ← r + (δ'/δ) p

A converged row (r = 0, or b = 0 as for the padding tokens of a chunk) has pᵀAp = 0: its α and
the ratio are taken as 0 there (`_ratio`), so it stays put instead of dividing 0 by 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def conjugate_gradient(matvec, b, steps: int):
    """x ≈ A⁻¹ b after `steps` CG iterations from x₀ = 0, `matvec(p) = A p` on `[..., K]` rows
    (A symmetric positive definite per row). float32 in, float32 out."""

    def body(_, carry):
        x, r, p, delta = carry
        ap = matvec(p)
        alpha = _ratio(delta, jnp.sum(p * ap, -1))[..., None]
        x = x + alpha * p
        r = r - alpha * ap
        delta_next = jnp.sum(r * r, -1)
        p = r + _ratio(delta_next, delta)[..., None] * p
        return x, r, p, delta_next

    init = (jnp.zeros_like(b), b, b, jnp.sum(b * b, -1))
    return jax.lax.fori_loop(0, steps, body, init)[0]


def _ratio(num, den):
    """num / den where den > 0, else 0 (masked before the division: no NaN, no NaN gradient)."""
    ok = den > 0
    return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)
