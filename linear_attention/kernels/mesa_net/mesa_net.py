"""MesaNet (von Oswald et al. 2025, "MesaNet: Sequence Modeling by Locally Optimal Test-Time
Training"): a layer whose output is the minimiser of a regularised, decayed least-squares fit of
the values from the keys, evaluated at the query.

Per head, with a log decay a_t ≤ 0 (−inf: a reset), a write weight β_t ≥ 0 and a regulariser
λ > 0 per key channel (Λ = diag(λ)),

    H_kk,t = γ_t H_kk,t−1 + β_t k_t k_tᵀ           γ_t = exp(a_t)
    H_kv,t = γ_t H_kv,t−1 + β_t k_t v_tᵀ
    o_t    = H_kv,tᵀ (H_kk,t + Λ)⁻¹ q_t

(flash-linear-attention's convention: decay first, then the β-weighted write, both statistics
with the same γ and β; H_kk,t + Λ is symmetric positive definite, so the solve is well posed).
The solve is conjugate gradient with a fixed count `cg_steps` from x₀ = 0 (`solve.py`); method
"exact" solves with `jnp.linalg.solve`. Where the paper's W_t minimises
Σ_{s≤t} β_s ζ_{t,s} |v_s − W k_s|² + Tr(Wᵀ Λ W) (ζ the decay between s and t), o_t = W_t q_t
is this o_t.

Convergence. CG's error after i iterations falls like ((√κ − 1)/(√κ + 1))^i, κ the condition
number of H_kk,t + Λ, which grows as λ shrinks beside H_kk,t's largest eigenvalue (up to
Σ β over a document's tokens for unit keys without decay, about β/(1 − γ) with decay γ). At the
layer's λ ≥ 0.25 the default 30 iterations reach a relative residual below 1e-6 (measured: 512
tokens of random unit keys, β = 1, λ = 0.25, no decay or γ = 0.99, K = 16, 32 and 64); a smaller
λ, keys that fill a few directions over long documents, or a wide K call for more (`cg_steps` ≥
K is exact in exact arithmetic). Called eagerly, `mesa_net` warns when a token's relative residual
‖(H_kk,t + Λ) x_t − q_t‖ / ‖q_t‖ exceeds `residual.CG_TOLERANCE` (1e-3); `mesa_net_residual`
returns every token's, under `jit` too (`residual.py`).

Methods: "chunk" (`chunked.py`: chunk states by an associative scan over chunk summaries, all
tokens' CG iterations as batched masked matmuls, an implicit custom-VJP gradient keeping one
state per chunk; the training path), "scan" (`recurrent.py`: a `lax.scan` over tokens with
the same CG per token; autodiff through it) and "exact" (the same scan with an exact solve: the
reference). `mesa_net_step` is one token of the recurrence, for decoding.

Sequence parallelism (`axis_name`). Both statistics are affine in the state entering a span,
S_out = exp(Σ a) S_in + U, but the outputs are not (the solve is nonlinear in S_in), so the
affine combine's "run from zero, add the entering state's read-out" does not carry over.
Instead each shard computes only its summary U (both statistics from a zero state, kb and
[k | v] chunk summaries: no solve), the summaries compose over shards
(`primitives.combine.prefix`: an all-gather and a scan over shards), and each shard then runs
the local kernel from its true entering state. Gradients are JAX's own through the collectives
and the local kernel's VJP with respect to its initial state. Work per shard: one extra pass
of chunk summaries, O(n·K·(K + Dv)) gathered.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention.kernels.checks import (
    check_float,
    check_layouts,
    check_log_decay,
    check_positive_int,
    check_static,
    concrete,
    reverse_mode_only,
)
from linear_attention.kernels.mesa_net.chunked import chunk_states, mesa_chunked
from linear_attention.kernels.mesa_net.recurrent import read, recurrent, update
from linear_attention.kernels.mesa_net.residual import cg_residual, warn_unconverged
from linear_attention.kernels.primitives.combine import prefix, vary_like
from linear_attention.kernels.primitives.family import Family, Method
from linear_attention.kernels.primitives.nan_guard import guard_inputs, poison, poison_state
from linear_attention.kernels.segments import fold_resets, reset_reach, segment_resets


class MesaNetState(NamedTuple):
    """MesaNet's recurrent state, float32: `kk` = H_kk `[B, H, K, K]` and `kv` = H_kv
    `[B, H, K, Dv]`. A pytree."""

    kk: jax.Array
    kv: jax.Array

    @classmethod
    def zeros(cls, batch_size: int, num_heads: int, key_dim: int, value_dim: int):
        """The state before the first token."""
        return cls(
            kk=jnp.zeros((batch_size, num_heads, key_dim, key_dim), jnp.float32),
            kv=jnp.zeros((batch_size, num_heads, key_dim, value_dim), jnp.float32),
        )


def mesa_net(
    q,
    k,
    v,
    log_decay,
    beta,
    lambda_,
    *,
    segment_ids=None,
    initial_state: MesaNetState | None = None,
    return_state: bool = False,
    method: str = "chunk",
    chunk_size: int = 64,
    cg_steps: int = 30,
    axis_name: str | None = None,
):
    """MesaNet's causal mixing (module docstring).

    Args:
      q, k: `[B, T, H, K]` (MesaNet's layer L2-normalises both); v: `[B, T, H, Dv]`.
      log_decay: log γ ≤ 0, `[B, T, H]` or `[H]` (fixed); −inf is a reset; None: no decay.
      beta: the write weight β ≥ 0, `[B, T, H]`.
      lambda_: the regulariser λ > 0 per head and key channel, `[H, K]`.
      segment_ids: `[B, T]` integers or a `Segments`: both statistics are zeroed before every
        document start (the initial state flows into the first document only).
      initial_state: a `MesaNetState` (None: zeros).
      return_state: also return the `MesaNetState` after the last token.
      method: "chunk" (the training path), "scan" (the same CG, token by token) or
        "exact" (token by token with an exact solve; ignores `cg_steps`).
      chunk_size: tokens per chunk of "chunk"; T need not be a multiple.
      cg_steps: conjugate-gradient iterations per solve (static). Called eagerly (concrete
        inputs), a solve whose relative residual exceeds `residual.CG_TOLERANCE` warns
        (`RuntimeWarning`); under `jit`, `mesa_net_residual` returns every token's. Raise it
        when λ is small beside H_kk (slow decay, long documents): module docstring.
      axis_name: inside `jax.shard_map` with time split over this mesh axis, the unsplit
        result (outputs, gradients, the global final state on every shard).
    Returns:
      `o: [B, T, H, Dv]` in `result_type(q, k, v)`, and with `return_state` the final
      `MesaNetState` (float32). Statistics and solves are float32 whatever the input dtype.
    """
    method, chunk_size = MESA_NET.check(method, chunk_size)
    cg_steps = check_positive_int("cg_steps", cg_steps)
    check_static("return_state", return_state)
    B, T, H, Kd, Dv = _check_inputs(q, k, v, beta, lambda_)
    lam_HK = check_lambda(lambda_, H, Kd)
    check_beta(beta)
    a_BTH = check_log_decay(log_decay, (B, T, H), "[B, T, H]")
    a_BTH = fold_resets(segment_resets(segment_ids, B, T, axis_name), a_BTH, H)
    kk0, kv0 = _initial_state(initial_state, B, H, Kd, Dv)
    dtype = jnp.result_type(q, k, v)
    q32, k32, v32, beta32 = (jnp.asarray(x, jnp.float32) for x in (q, k, v, beta))
    # a bad key, value, β or decay reaches its head's later tokens up to a reset, a bad initial
    # state those before the first (`primitives.nan_guard`): computed clean, selected to NaN
    guard, (k32, v32, beta32), a_BTH, (kk0, kv0) = guard_inputs(
        (B, T, H), (k32, v32, beta32), a_BTH, (kk0, kv0), split=axis_name is not None
    )
    kb32 = beta32[..., None] * k32
    leaves = jax.tree.leaves((q, k, beta, lambda_, log_decay, kk0, segment_ids))
    eager = axis_name is None and not any(isinstance(x, jax.core.Tracer) for x in leaves)
    if method != "exact" and eager:  # (under jit: `mesa_net_residual`, module docstring)
        warn_unconverged(cg_residual(q32, kb32, k32, a_BTH, lam_HK, kk0, cg_steps), cg_steps, Kd)

    kernel = MESA_NET.kernel(method, chunk_size=chunk_size, cg_steps=cg_steps)

    def local(kk_in, kv_in, a, lam):
        with reverse_mode_only('method="chunk"', 'method="scan" or "exact"'):
            return kernel(q32, kb32, k32, v32, a, lam, kk_in, kv_in)

    if axis_name is None:
        o_BTHD, kk, kv = local(kk0, kv0, a_BTH, lam_HK)
        kk, kv = poison_state(guard, kk), poison_state(guard, kv)
    else:
        o_BTHD, kk, kv = _split(
            local, (kb32, k32, v32, a_BTH, lam_HK), (kk0, kv0), chunk_size, axis_name, guard
        )
    o_BTHD = poison(guard, o_BTHD).astype(dtype)
    return (o_BTHD, MesaNetState(kk, kv)) if return_state else o_BTHD


def mesa_net_residual(
    q,
    k,
    log_decay,
    beta,
    lambda_,
    *,
    segment_ids=None,
    initial_state: MesaNetState | None = None,
    cg_steps: int = 30,
):
    """The relative residual ‖(H_kk,t + Λ) x_t − q_t‖ / ‖q_t‖ `[B, T, H]` float32 of every
    token's solve after `cg_steps` CG iterations (`residual.py`): how far `mesa_net`'s "chunk"
    and "scan" outputs (and `mesa_net_step`'s) are from the exact solve's. The arguments
    are `mesa_net`'s (no values: they take no part); works under `jit`."""
    cg_steps = check_positive_int("cg_steps", cg_steps)
    B, T, H, Kd, _ = _check_inputs(q, k, q, beta, lambda_)  # (q stands for the values)
    lam_HK = check_lambda(lambda_, H, Kd)
    check_beta(beta)
    a_BTH = check_log_decay(log_decay, (B, T, H), "[B, T, H]")
    a_BTH = fold_resets(segment_resets(segment_ids, B, T), a_BTH, H)
    dv = jnp.shape(initial_state.kv)[-1] if isinstance(initial_state, MesaNetState) else 1
    kk0, _ = _initial_state(initial_state, B, H, Kd, dv)
    q32, k32 = jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32)
    kb32 = jnp.asarray(beta, jnp.float32)[..., None] * k32
    return cg_residual(q32, kb32, k32, a_BTH, lam_HK, kk0, cg_steps)


def _check_inputs(q, k, v, beta, lambda_) -> tuple[int, int, int, int, int]:
    """Raise unless q, k, v, beta (and lambda_) are float arrays, q, k, v and beta of
    `mesa_net`'s layouts with at least one time step; return `(B, T, H, K, Dv)`."""
    check_float(("q", "k", "v", "beta", "lambda_"), (q, k, v, beta, lambda_))
    sizes = check_layouts(
        q=(q, "[B, T, H, K]"),
        k=(k, "[B, T, H, K]"),
        v=(v, "[B, T, H, Dv]"),
        beta=(beta, "[B, T, H]"),
    )
    if sizes["T"] == 0:
        raise ValueError(f"q, k, v must have at least one time step, got shape {q.shape}")
    return sizes["B"], sizes["T"], sizes["H"], sizes["K"], sizes["Dv"]


def _split(local, inputs, state0, chunk_size, axis_name, guard):
    """The time split (module docstring): summaries, `prefix` over shards, the local kernel
    from the entering state; NaN where a non-finite entering state reaches (up to a reset).
    `inputs` are clean; `guard` marks the summary of a shard whose last token a bad one of
    its own reaches, so that `prefix` carries the NaN on as the unsplit call does."""
    kb, k, v, a_BTH, lam_HK = inputs
    kk0, kv0 = state0
    Kd = k.shape[-1]
    a_BTH, lam_HK = vary_like(a_BTH, k), vary_like(lam_HK, k)
    s0 = jnp.concatenate([kk0, kv0], axis=-1)
    zero = vary_like(jnp.zeros_like(s0), k)
    C = min(chunk_size, k.shape[1])
    _, u_BHKF = chunk_states(kb, jnp.concatenate([k, v], axis=-1), a_BTH, zero, C)
    u_BHKF = poison_state(guard, u_BHKF)
    if a_BTH is None:
        A_BH11 = vary_like(jnp.ones(u_BHKF.shape[:2] + (1, 1), jnp.float32), k)
        reset_BH = jnp.zeros(u_BHKF.shape[:2], bool)
    else:
        A_BH11 = jnp.exp(jnp.sum(a_BTH, axis=1))[..., None, None]  # 0 after a reset
        reset_BH = jnp.any(jnp.isneginf(a_BTH), axis=1)
    s_in, bad_in_BH, s_out = prefix(A_BH11, u_BHKF, s0, reset_BH, axis_name, lambda A, S: A * S)
    o_BTHD, _, _ = local(s_in[..., :Kd], s_in[..., Kd:], a_BTH, lam_HK)
    reached_BTH = reset_reach(a_BTH)
    poisoned_BTH = bad_in_BH[:, None] if reached_BTH is None else bad_in_BH[:, None] & ~reached_BTH
    o_BTHD = jnp.where(poisoned_BTH[..., None], jnp.nan, o_BTHD)
    return o_BTHD, s_out[..., :Kd], s_out[..., Kd:]


def mesa_net_step(state: MesaNetState, q, k, v, log_decay, beta, lambda_, *, cg_steps=30):
    """One token of MesaNet (decoding): `q, k: [B, H, K]`, `v: [B, H, Dv]`, `log_decay`
    `[B, H]` or `[H]` (≤ 0, −inf a reset; None: no decay), `beta: [B, H]`, `lambda_: [H, K]`.
    `cg_steps`: CG iterations (static; None: an exact solve). Returns `(o [B, H, Dv] in
    result_type(q, k, v), new MesaNetState)`; O(K² + K·Dv) per token whatever the context."""
    if cg_steps is not None:
        cg_steps = check_positive_int("cg_steps", cg_steps)
    check_float(("q", "k", "v", "beta", "lambda_"), (q, k, v, beta, lambda_))
    sizes = check_layouts(
        q=(q, "[B, H, K]"), k=(k, "[B, H, K]"), v=(v, "[B, H, Dv]"), beta=(beta, "[B, H]")
    )
    B, H, Kd, Dv = sizes["B"], sizes["H"], sizes["K"], sizes["Dv"]
    check_mesa_state(state, B, H, Kd, Dv, name="state")
    lam_HK = check_lambda(lambda_, H, Kd)
    check_beta(beta)
    a_BH = check_log_decay(log_decay, (B, H), "[B, H]")
    q32, k32, v32 = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    kb32 = jnp.asarray(beta, jnp.float32)[..., None] * k32
    kk, kv = update(
        jnp.asarray(state.kk, jnp.float32), jnp.asarray(state.kv, jnp.float32), k32, kb32, v32, a_BH
    )
    o_BHD = read(kk, kv, q32, lam_HK, cg_steps)
    return o_BHD.astype(jnp.result_type(q, k, v)), MesaNetState(kk, kv)


def check_lambda(lambda_, H: int, Kd: int):
    """λ as float32 `[H, K]`: shape `[H, K]` (size-1 axes broadcast), values > 0 when concrete."""
    shape = tuple(jnp.shape(lambda_))
    try:
        ok = len(shape) == 2 and jnp.broadcast_shapes(shape, (H, Kd)) == (H, Kd)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"lambda_ must have shape [H, K] = {(H, Kd)}, got {shape}")
    values = concrete(lambda_)
    if values is not None and not np.all(values.astype(np.float32) > 0):  # also catches NaN
        raise ValueError(
            f"lambda_ must be > 0 (H_kk + diag(λ) must be positive definite); got min "
            f"{float(np.min(values))}"
        )
    return jnp.broadcast_to(jnp.asarray(lambda_, jnp.float32), (H, Kd))


def check_beta(beta) -> None:
    """β ≥ 0 when concrete (a negative write could make H_kk + Λ indefinite, and CG diverge)."""
    values = concrete(beta)
    if values is not None and not np.all(values.astype(np.float32) >= 0):
        raise ValueError(f"beta must be >= 0, got min {float(np.min(values))}")


def check_mesa_state(state, B: int, H: int, Kd: int, Dv: int, name: str = "initial_state"):
    """Raise unless `state` is a `MesaNetState` with kk `[B, H, K, K]` and kv `[B, H, K, Dv]`."""
    if not isinstance(state, MesaNetState):
        raise ValueError(f"{name} must be a MesaNetState, got {type(state).__name__}")
    want_kk, want_kv = (B, H, Kd, Kd), (B, H, Kd, Dv)
    got_kk, got_kv = tuple(jnp.shape(state.kk)), tuple(jnp.shape(state.kv))
    if got_kk != want_kk or got_kv != want_kv:
        raise ValueError(
            f"{name} has kk {got_kk} and kv {got_kv}; expected kk {want_kk} [B, H, K, K] and "
            f"kv {want_kv} [B, H, K, Dv]"
        )


def _initial_state(initial_state, B, H, Kd, Dv):
    if initial_state is None:
        zeros = MesaNetState.zeros(B, H, Kd, Dv)
        return zeros.kk, zeros.kv
    check_mesa_state(initial_state, B, H, Kd, Dv)
    return jnp.asarray(initial_state.kk, jnp.float32), jnp.asarray(initial_state.kv, jnp.float32)


def _chunk(q, kb, k, v, a, lam, kk, kv, *, chunk_size, cg_steps):
    return mesa_chunked(q, kb, k, v, a, lam, kk, kv, chunk_size, cg_steps)


def _scan(q, kb, k, v, a, lam, kk, kv, *, cg_steps):
    return recurrent(q, kb, k, v, a, lam, kk, kv, cg_steps)


def _exact(q, kb, k, v, a, lam, kk, kv):
    return recurrent(q, kb, k, v, a, lam, kk, kv, None)


def chunk_flops(*, seq_len, heads, dk, dv, chunk_size, cg_steps, **_):
    """ "chunk" per token: H·(2·dk² + n·(2·dk² + 4·C·dk) + 2·(C·(dk + dv) + 2·dk·dv)) (the
    H_kk chunk summary; each CG iteration's A x: the entering state, the [C, C] scores and
    their sum over kb; the read-out, linear attention with queries x), n = `cg_steps`,
    C = min(chunk_size, T). The CG's vector updates (O(dk) each) are left out."""
    c = min(chunk_size, seq_len)
    per_head = 2 * dk * dk + cg_steps * (2 * dk * dk + 4 * c * dk)
    return heads * (per_head + 2 * (c * (dk + dv) + 2 * dk * dv))


def scan_flops(*, heads, dk, dv, cg_steps, **_):
    """ "scan" per token: H·(2·dk·(dk + dv) + n·2·dk² + 2·dk·dv) (both updates, the CG, the
    read-out)."""
    return heads * (2 * dk * (dk + dv) + cg_steps * 2 * dk * dk + 2 * dk * dv)


def exact_flops(*, heads, dk, dv, **_):
    """ "exact" per token: the scan's count with 2·dk³/3 (the solve) in place of the CG's."""
    return heads * (2 * dk * (dk + dv) + 2 * dk**3 / 3 + 2 * dk * dv)


MESA_NET = Family(
    name="mesa_net",
    methods={
        "chunk": Method(_chunk, chunk_flops, static=("chunk_size", "cg_steps")),
        "scan": Method(_scan, scan_flops, static=("cg_steps",)),
        "exact": Method(_exact, exact_flops),
    },
    step=mesa_net_step,
    state=MesaNetState,
    splits_time=True,
    old_words=("recurrent",),
)
