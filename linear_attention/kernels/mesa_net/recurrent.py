"""MesaNet token by token: the reference forms (`lax.scan` over time) and the decoding step.

Per token, with γ_t = exp(a_t) and the write weight β_t ≥ 0,

    H_kk,t = γ_t H_kk,t−1 + β_t k_t k_tᵀ          [K, K]
    H_kv,t = γ_t H_kv,t−1 + β_t k_t v_tᵀ          [K, Dv]
    x_t    = (H_kk,t + Λ)⁻¹ q_t                   Λ = diag(λ), λ > 0 per head and key channel
    o_t    = H_kv,tᵀ x_t

solved exactly (`jnp.linalg.solve`, `cg_steps=None`) or by `cg_steps` conjugate-gradient
iterations (`solve.conjugate_gradient`, the numbers the chunked form and decoding give). Autodiff
of the scan keeps a [K, K] and a [K, Dv] state per token: these are references and the decoding
path, not the training path (`chunked.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention.kernels.mesa_net.solve import conjugate_gradient
from linear_attention.kernels.segments import decay_state


def update(kk_BHKK, kv_BHKD, k_BHK, kb_BHK, v_BHD, a_BH):
    """Both statistics after one token: decay (a_BH None: none; −inf: a reset), then write."""
    if a_BH is not None:
        a = a_BH[..., None, None]  # −inf: a reset, zero statistics selected (NaN ones too)
        kk_BHKK, kv_BHKD = decay_state(a, kk_BHKK), decay_state(a, kv_BHKD)
    kk_BHKK = kk_BHKK + kb_BHK[..., :, None] * k_BHK[..., None, :]
    kv_BHKD = kv_BHKD + kb_BHK[..., :, None] * v_BHD[..., None, :]
    return kk_BHKK, kv_BHKD


def read(kk_BHKK, kv_BHKD, q_BHK, lam_HK, cg_steps: int | None):
    """o = H_kvᵀ (H_kk + Λ)⁻¹ q for one token, `[B, H, Dv]`: exact for `cg_steps=None`."""
    if cg_steps is None:
        lam_HKK = lam_HK[..., :, None] * jnp.eye(lam_HK.shape[-1], dtype=jnp.float32)
        x_BHK = jnp.linalg.solve(kk_BHKK + lam_HKK, q_BHK[..., None])[..., 0]
    else:

        def matvec(p_BHK):
            return jnp.einsum("bhij,bhj->bhi", kk_BHKK, p_BHK) + lam_HK * p_BHK

        x_BHK = conjugate_gradient(matvec, q_BHK, cg_steps)
    return jnp.einsum("bhkd,bhk->bhd", kv_BHKD, x_BHK)


def recurrent(q_BTHK, kb_BTHK, k_BTHK, v_BTHD, a_BTH, lam_HK, kk0_BHKK, kv0_BHKD, cg_steps):
    """The recurrence by `lax.scan` on float32 arrays (kb = β k): `(o_BTHD, kk_BHKK, kv_BHKD)`."""

    def step(carry, inputs):
        q, kb, k, v, a = inputs
        kk, kv = update(*carry, k, kb, v, a)
        return (kk, kv), read(kk, kv, q, lam_HK, cg_steps)

    time_major = [
        None if x is None else jnp.moveaxis(x, 1, 0)
        for x in (q_BTHK, kb_BTHK, k_BTHK, v_BTHD, a_BTH)
    ]
    (kk_BHKK, kv_BHKD), o_TBHD = jax.lax.scan(step, (kk0_BHKK, kv0_BHKD), time_major)
    return jnp.moveaxis(o_TBHD, 0, 1), kk_BHKK, kv_BHKD
