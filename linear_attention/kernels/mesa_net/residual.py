"""How far MesaNet's conjugate gradient is from the exact solve: the relative residual of every
token's solve, and the eager-mode warning of `mesa_net` when it is large.

With A_t = H_kk,t + Λ and x_t the solution after `cg_steps` iterations from x₀ = 0 (the same
iterates in the chunked, recurrent and decoding forms), the residual is

    r_t = ‖A_t x_t − q_t‖ / ‖q_t‖          (0 where q_t = 0)

CG's error falls like ((√κ − 1)/(√κ + 1))^i with κ = cond(A_t) ≤ (λ_max(H_kk,t) + max λ) / min λ,
and it is exact after K iterations in exact arithmetic (A is K×K). So the count must grow when
λ is small beside the key statistics: a small regulariser, or slow decay (γ near 1) with many
writes β_t k_t k_tᵀ, which make H_kk large. Raise `cg_steps` (up to K, or past it in float32)
when this residual is not small; `method="exact"` is the reference.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention.kernels.mesa_net.recurrent import update
from linear_attention.kernels.mesa_net.solve import conjugate_gradient

# The largest relative residual `mesa_net` accepts without a warning (eager calls).
CG_TOLERANCE = 1e-3


@functools.partial(jax.jit, static_argnames=("cg_steps",))
def cg_residual(q_BTHK, kb_BTHK, k_BTHK, a_BTH, lam_HK, kk0_BHKK, cg_steps: int):
    """r_t `[B, T, H]` float32 (module docstring) on float32 inputs (kb = β k; `a_BTH` None: no
    decay, −inf a reset), by a scan over tokens of the statistics and each token's CG."""
    B, _, H, K = q_BTHK.shape
    no_values = jnp.zeros((B, H, 0), jnp.float32)  # H_kk only: the values take no part

    def token(kk_BHKK, inputs):
        q, kb, k, a = inputs
        kk_BHKK, _ = update(kk_BHKK, jnp.zeros((B, H, K, 0)), k, kb, no_values, a)

        def matvec(p_BHK):
            return jnp.einsum("bhij,bhj->bhi", kk_BHKK, p_BHK) + lam_HK * p_BHK

        x_BHK = conjugate_gradient(matvec, q, cg_steps)
        size = jnp.linalg.norm(q, axis=-1)
        miss = jnp.linalg.norm(matvec(x_BHK) - q, axis=-1)
        return kk_BHKK, jnp.where(size > 0, miss / jnp.where(size > 0, size, 1.0), 0.0)

    xs = [None if x is None else jnp.moveaxis(x, 1, 0) for x in (q_BTHK, kb_BTHK, k_BTHK, a_BTH)]
    _, r_TBH = jax.lax.scan(token, kk0_BHKK, xs)
    return jnp.moveaxis(r_TBH, 0, 1)


def warn_unconverged(residual_BTH, cg_steps: int, key_dim: int) -> None:
    """Warn (a `RuntimeWarning`) when the largest concrete residual exceeds `CG_TOLERANCE`."""
    r = np.asarray(residual_BTH)
    worst = float(np.max(r, initial=0.0))
    if not worst <= CG_TOLERANCE:  # (NaN included)
        at = tuple(int(i) for i in np.unravel_index(np.nanargmax(r), r.shape)) if r.size else ()
        warnings.warn(
            f"mesa_net: conjugate gradient did not converge in cg_steps={cg_steps}: relative "
            f"residual {worst:.3g} at [B, T, H] index {at} (tolerance {CG_TOLERANCE:g}); raise "
            f"cg_steps (K = {key_dim} is exact in exact arithmetic) or lambda_, or use "
            'method="exact" (kernels.mesa_net_residual gives every token\'s residual)',
            RuntimeWarning,
            stacklevel=3,
        )
