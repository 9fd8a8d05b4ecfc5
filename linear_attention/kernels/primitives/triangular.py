"""The unit-lower-triangular inverse of the UT transform (delta rule, KDA, DPLR, DeltaProduct)."""

from __future__ import annotations

import jax.numpy as jnp


def invert_unit_lower(a_CC):
    """(I + A)⁻¹ for strictly lower-triangular A [..., C, C], by doubling the block size.

    With the inverses D₁, D₂ of two diagonal blocks of size b known, the block of size 2b is
    [[L₁₁, 0], [L₂₁, L₂₂]]⁻¹ = [[D₁, 0], [−D₂ L₂₁ D₁, D₂]]: log₂ C rounds of batched matmuls, as
    stable as forward substitution (no powers of A are formed). On CPU it is several times
    faster than `lax.linalg.triangular_solve` on these many small systems
    (docs/results/delta_rule_bench_cpu.md), and the product form
    (I − N)⁻¹ = Π(I + N^(2^j)) is unstable for β near 2 (its powers of A blow up).
    """
    C = a_CC.shape[-1]
    P = 1 << (C - 1).bit_length()  # pad to a power of two: (I + 0) on the padding
    if P != C:
        a_CC = jnp.pad(a_CC, [(0, 0)] * (a_CC.ndim - 2) + [(0, P - C), (0, P - C)])
    batch = a_CC.shape[:-2]
    d_nbb = jnp.ones((*batch, P, 1, 1), a_CC.dtype)  # inverses of the 1×1 diagonal blocks
    b = 1
    while b < P:
        n = P // b
        blocks = jnp.swapaxes(a_CC.reshape(*batch, n, b, n, b), -3, -2)  # [..., n, n, b, b]
        l21 = blocks[..., jnp.arange(1, n, 2), jnp.arange(0, n, 2), :, :]
        d1, d2 = d_nbb[..., 0::2, :, :], d_nbb[..., 1::2, :, :]
        x21 = -(d2 @ l21 @ d1)
        top = jnp.concatenate([d1, jnp.zeros_like(d1)], axis=-1)
        bottom = jnp.concatenate([x21, d2], axis=-1)
        d_nbb = jnp.concatenate([top, bottom], axis=-2)
        b *= 2
    return d_nbb[..., 0, :C, :C]


def unit_lower_solve_vjp(inv_CC, m_CX, dm_CX):
    """The cotangents of R and A in M = (I + A)⁻¹ R (A strictly lower-triangular [..., C, C]),
    given the inverse `inv_CC` = (I + A)⁻¹ (from `invert_unit_lower`), M and its cotangent dM:

        dR = (I + A)⁻ᵀ dM,      dA = −strict_lower(dR Mᵀ)

    From δM = (I + A)⁻¹ (δR − δA M): ⟨dM, δM⟩ = ⟨(I + A)⁻ᵀ dM, δR⟩ − ⟨(I + A)⁻ᵀ dM Mᵀ, δA⟩, and A
    lives on the strict lower triangle only. The forward pass already holds the inverse, so the
    transposed solve is one batched matmul with it (a triangular solve is the same arithmetic and
    was several times slower on CPU for these many small systems, see `invert_unit_lower`).
    Returns `(dR [..., C, X], dA [..., C, C])`.
    """
    dr_CX = jnp.swapaxes(inv_CC, -1, -2) @ dm_CX
    return dr_CX, -jnp.tril(dr_CX @ jnp.swapaxes(m_CX, -1, -2), -1)
