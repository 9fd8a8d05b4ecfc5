"""Linear attention entry points: non-causal, and causal (one dispatcher over four algorithms).

Causal linear attention with an optional log decay a_t ≤ 0 is the recurrence

    kv_t    = exp(a_t) kv_{t-1} + k_t v_tᵀ
    k_sum_t = exp(a_t) k_sum_{t-1} + k_t
    o_t     = q_tᵀ kv_t / (q_tᵀ k_sum_t + eps)      (or q_tᵀ kv_t without normalisation)

`q` and `k` are already featurised (φ(q), φ(k), width M). Every method computes the same numbers;
they differ in cost: "quadratic" O(T²) memory, "scan" sequential, "associative_scan" a parallel
prefix with a state per token, "chunk" dense matmuls within chunks and a prefix over chunks,
"chunk_parallel" the same with every chunk at once (a parallel prefix over chunk summaries).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from linear_attention.kernels._checks import (
    check_choice,
    check_log_decay,
    check_positive_int,
    check_rank,
    check_same,
)
from linear_attention.kernels.associative import causal_associative
from linear_attention.kernels.chunk_parallel import causal_chunk_parallel
from linear_attention.kernels.chunked import causal_chunked
from linear_attention.kernels.quadratic import causal_quadratic
from linear_attention.kernels.recurrent import causal_scan
from linear_attention.kernels.state import LinearAttentionState, check_state

METHODS = ("chunk", "scan", "associative_scan", "quadratic", "chunk_parallel")


def linear_attention(q, k, v, *, normalize: bool = True, eps: float = 1e-6):
    """Non-causal linear attention φQ(φKᵀV) / (φQ(φKᵀ1) + eps), in O(T·M·Dv).

    Args:
      q: featurised queries `[B, Tq, H, M]`.
      k: featurised keys `[B, Tk, H, M]`.
      v: values `[B, Tk, H, Dv]`.
      normalize: divide by φQ(φKᵀ1) + eps; False gives the bare numerator.
      eps: added to the normaliser.
    Returns:
      `[B, Tq, H, Dv]` in `result_type(q, k, v)`.
    """
    check_rank("q", q, 4, "[B, Tq, H, M]")
    check_rank("k", k, 4, "[B, Tk, H, M]")
    check_rank("v", v, 4, "[B, Tk, H, Dv]")
    check_same(("q", "k", "v"), (q, k, v), (0, 0, 0), "batch size B")
    check_same(("q", "k", "v"), (q, k, v), (2, 2, 2), "heads H")
    check_same(("k", "v"), (k, v), (1, 1), "time Tk")
    check_same(("q", "k"), (q, k), (3, 3), "feature width M")
    dtype = jnp.result_type(q, k, v)
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    kv_BHMD = jnp.einsum("bshm,bshd->bhmd", k32, v32)
    o_BTHD = jnp.einsum("bthm,bhmd->bthd", q32, kv_BHMD)
    if normalize:
        den_BTH = jnp.einsum("bthm,bhm->bth", q32, jnp.sum(k32, axis=1))
        o_BTHD = o_BTHD / (den_BTH[..., None] + eps)
    return o_BTHD.astype(dtype)


def causal_linear_attention(
    q,
    k,
    v,
    *,
    log_decay=None,
    normalize: bool = True,
    eps: float = 1e-6,
    method: str = "chunk",
    chunk_size: int = 64,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
):
    """Causal linear attention, optionally decayed, from an optional initial state.

    Args:
      q: featurised queries `[B, T, H, M]`.
      k: featurised keys `[B, T, H, M]`.
      v: values `[B, T, H, Dv]`.
      log_decay: log of the per-token state decay, ≤ 0, broadcastable to `[B, T, H]`:
        `[H]` is a fixed per-head decay (RetNet), `[B, T, H]` a data-dependent one (Mamba-2,
        gated linear attention). None: no decay.
      normalize: divide by q_tᵀ k_sum_t + eps.
      eps: added to the normaliser.
      method: "chunk" (default, the training path), "scan", "associative_scan", "quadratic" or
        "chunk_parallel" (every chunk at once, shaped for accelerators). The default is "chunk"
        on every backend: on the CPU it is 1.6–2.8× faster than "chunk_parallel" at T ≥ 4096
        (BENCHMARKS.md); on GPU/TPU it is a choice, not yet a measurement
        (`experiments/accelerator_check.py` measures both there).
      chunk_size: tokens per chunk for "chunk" and "chunk_parallel"; T need not be a multiple.
      initial_state: state before the first token; None means zeros.
      return_state: also return the state after the last token.
    Returns:
      `o: [B, T, H, Dv]` in `result_type(q, k, v)`, and with `return_state` the final
      `LinearAttentionState` (float32).
    """
    check_choice("method", method, METHODS)
    check_positive_int("chunk_size", chunk_size)
    B, T, H, M, Dv = _check_qkv(q, k, v)
    if initial_state is not None:
        check_state(initial_state, B, H, M, Dv)
    a_BTH = check_log_decay(log_decay, (B, T, H), "[B, T, H]")

    dtype = jnp.result_type(q, k, v)
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    with_sum = normalize or return_state
    if initial_state is None:
        kv0_BHMD = jnp.zeros((B, H, M, Dv), jnp.float32)
        z0_BHM = jnp.zeros((B, H, M), jnp.float32) if with_sum else None
    else:
        kv0_BHMD = initial_state.kv.astype(jnp.float32)
        z0_BHM = initial_state.k_sum.astype(jnp.float32) if with_sum else None

    if method == "chunk":
        o_BTHD, kv_BHMD, z_BHM = causal_chunked(
            q32,
            k32,
            v32,
            a_BTH,
            kv0_BHMD,
            z0_BHM,
            chunk_size=chunk_size,
            normalize=normalize,
            eps=eps,
        )
    else:
        core = {
            "scan": causal_scan,
            "associative_scan": causal_associative,
            "chunk_parallel": functools.partial(causal_chunk_parallel, chunk_size=chunk_size),
        }.get(method, causal_quadratic)
        # The normaliser is the output for a value that is always 1: one more value column.
        if with_sum:
            v32 = jnp.concatenate([v32, jnp.ones((B, T, H, 1), jnp.float32)], axis=-1)
            kv0_BHMD = jnp.concatenate([kv0_BHMD, z0_BHM[..., None]], axis=-1)
        out_BTHD, s_BHMD = core(q32, k32, v32, a_BTH, kv0_BHMD)
        o_BTHD, kv_BHMD = out_BTHD[..., :Dv], s_BHMD[..., :Dv]
        z_BHM = s_BHMD[..., Dv] if with_sum else None
        if normalize:
            o_BTHD = o_BTHD / (out_BTHD[..., Dv:] + eps)
    o_BTHD = o_BTHD.astype(dtype)
    if not return_state:
        return o_BTHD
    return o_BTHD, LinearAttentionState(kv=kv_BHMD, k_sum=z_BHM)


def _check_qkv(q, k, v):
    check_rank("q", q, 4, "[B, T, H, M]")
    check_rank("k", k, 4, "[B, T, H, M]")
    check_rank("v", v, 4, "[B, T, H, Dv]")
    check_same(("q", "k", "v"), (q, k, v), (0, 0, 0), "batch size B")
    check_same(("q", "k", "v"), (q, k, v), (1, 1, 1), "time T")
    check_same(("q", "k", "v"), (q, k, v), (2, 2, 2), "heads H")
    check_same(("q", "k"), (q, k), (3, 3), "feature width M")
    if q.shape[1] == 0:
        raise ValueError(f"q, k, v must have at least one time step, got shape {q.shape}")
    return (*q.shape, v.shape[-1])
