"""Reference implementations that the benchmark measures the library's kernels against.

These are written for the comparison only (not part of the kernels' API):

- `performer_causal`: causal linear attention the way the Performer reference code computes it,
  prefix sums over time by `lax.scan`, with a custom VJP that re-runs the scan in reverse
  (so its gradient keeps no per-token state).
- `naive_chunked_causal`: the textbook chunked form with plain autodiff: per-chunk states by an
  exclusive `cumsum` over chunks, intra-chunk masked matmuls.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _prefix_num_den(q_TBHM, k_TBHM, v_TBHD):
    def step(carry, inputs):
        kv_BHMD, z_BHM = carry
        q_BHM, k_BHM, v_BHD = inputs
        kv_BHMD = kv_BHMD + jnp.einsum("bhm,bhd->bhmd", k_BHM, v_BHD)
        z_BHM = z_BHM + k_BHM
        num = jnp.einsum("bhm,bhmd->bhd", q_BHM, kv_BHMD)
        den = jnp.einsum("bhm,bhm->bh", q_BHM, z_BHM)
        return (kv_BHMD, z_BHM), (num, den)

    _, B, H, M = q_TBHM.shape
    init = (jnp.zeros((B, H, M, v_TBHD.shape[-1])), jnp.zeros((B, H, M)))
    _, (num, den) = jax.lax.scan(step, init, (q_TBHM, k_TBHM, v_TBHD))
    return num, den


@jax.custom_vjp
def _performer_core(q_TBHM, k_TBHM, v_TBHD):
    return _prefix_num_den(q_TBHM, k_TBHM, v_TBHD)


def _performer_fwd(q_TBHM, k_TBHM, v_TBHD):
    return _prefix_num_den(q_TBHM, k_TBHM, v_TBHD), (q_TBHM, k_TBHM, v_TBHD)


def _performer_bwd(residuals, cotangents):
    q_TBHM, k_TBHM, v_TBHD = residuals
    dnum_TBHD, dden_TBH = cotangents
    # Full-sequence sums, then subtract token by token in reverse (as the reference code does).
    kv_BHMD = jnp.einsum("tbhm,tbhd->bhmd", k_TBHM, v_TBHD)
    z_BHM = jnp.sum(k_TBHM, 0)

    def step(carry, inputs):
        kv_BHMD, z_BHM, gkv_BHMD, gz_BHM = carry
        q_BHM, k_BHM, v_BHD, dnum_BHD, dden_BH = inputs
        gkv_BHMD = gkv_BHMD + jnp.einsum("bhm,bhd->bhmd", q_BHM, dnum_BHD)
        gz_BHM = gz_BHM + q_BHM * dden_BH[..., None]
        dq = jnp.einsum("bhmd,bhd->bhm", kv_BHMD, dnum_BHD) + z_BHM * dden_BH[..., None]
        dk = jnp.einsum("bhmd,bhd->bhm", gkv_BHMD, v_BHD) + gz_BHM
        dv = jnp.einsum("bhmd,bhm->bhd", gkv_BHMD, k_BHM)
        kv_BHMD = kv_BHMD - jnp.einsum("bhm,bhd->bhmd", k_BHM, v_BHD)
        z_BHM = z_BHM - k_BHM
        return (kv_BHMD, z_BHM, gkv_BHMD, gz_BHM), (dq, dk, dv)

    init = (kv_BHMD, z_BHM, jnp.zeros_like(kv_BHMD), jnp.zeros_like(z_BHM))
    inputs = (q_TBHM, k_TBHM, v_TBHD, dnum_TBHD, dden_TBH)
    _, (dq, dk, dv) = jax.lax.scan(step, init, inputs, reverse=True)
    return dq, dk, dv


_performer_core.defvjp(_performer_fwd, _performer_bwd)


def performer_causal(q_BTHM, k_BTHM, v_BTHD, eps=1e-6):
    """Normalised causal linear attention, Performer-style prefix sums with a custom VJP."""
    to_time = functools.partial(jnp.moveaxis, source=1, destination=0)
    num, den = _performer_core(to_time(q_BTHM), to_time(k_BTHM), to_time(v_BTHD))
    return jnp.moveaxis(num / (den[..., None] + eps), 0, 1)


def naive_chunked_causal(q_BTHM, k_BTHM, v_BTHD, chunk_size=64, eps=1e-6):
    """Normalised causal linear attention, chunked, plain autodiff; T a multiple of chunk_size."""
    B, T, H, M = q_BTHM.shape
    C = chunk_size
    v_BTHD = jnp.concatenate([v_BTHD, jnp.ones((B, T, H, 1), v_BTHD.dtype)], -1)
    q, k, v = (x.reshape(B, T // C, C, H, -1) for x in (q_BTHM, k_BTHM, v_BTHD))
    scores = jnp.einsum("bnchm,bnshm->bnhcs", q, k) * jnp.tril(jnp.ones((C, C)))
    o = jnp.einsum("bnhcs,bnshd->bnchd", scores, v)
    u = jnp.einsum("bnchm,bnchd->bnhmd", k, v)
    states = jnp.cumsum(u, axis=1) - u
    o = (o + jnp.einsum("bnchm,bnhmd->bnchd", q, states)).reshape(B, T, H, -1)
    return o[..., :-1] / (o[..., -1:] + eps)
