"""Linear attention entry points: non-causal, and causal (one dispatcher over four algorithms).

Causal linear attention with an optional log decay a_t ≤ 0 is the recurrence

    kv_t    = diag(exp(a_t)) kv_{t-1} + k_t v_tᵀ
    k_sum_t = exp(a_t) ⊙ k_sum_{t-1} + k_t
    o_t     = q_tᵀ kv_t / (q_tᵀ k_sum_t + eps)      (or q_tᵀ kv_t without normalisation)

with a_t one number per head, or one per key dimension (GLA: it scales the rows of kv). A log
decay of −inf is a reset (the state is zeroed); packed rows (`segment_ids`) are resets at every
document start. Non-finite keys, values or log decays poison only their own token and what
follows it in the same document, as in the recurrence: every method computes with those tokens
zeroed and marks the affected outputs NaN (`primitives.nan_guard`), since a masked matmul or a
reset would spread a NaN backwards or into the next document (0·NaN = NaN).
A NaN output depends on nothing, so the gradient of a loss on the finite outputs is finite at
every other token ("chunk"'s hand-written backward gives those outputs a zero cotangent too),
and under `axis_name` a NaN stops at the same resets as unsplit (`sequence_parallel.py`).

`q` and `k` are already featurised (φ(q), φ(k), width M). Every method computes the same numbers;
they differ in cost: "quadratic" O(T²) memory, "scan" sequential, "associative_scan" a parallel
prefix with a state per token, "chunk" dense matmuls within chunks and a prefix over chunks,
"chunk_parallel" the same with every chunk at once (a parallel prefix over chunk summaries).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from linear_attention.kernels.checks import (
    check_eps,
    check_float,
    check_layouts,
    check_log_decay,
    check_static,
    reverse_mode_only,
)
from linear_attention.kernels.linear.associative import causal_associative
from linear_attention.kernels.linear.chunk_parallel import causal_chunk_parallel
from linear_attention.kernels.linear.chunked import causal_chunked
from linear_attention.kernels.linear.pallas import causal_pallas
from linear_attention.kernels.linear.quadratic import causal_quadratic
from linear_attention.kernels.linear.recurrent import causal_scan, recurrent_step
from linear_attention.kernels.linear.sequence_parallel import linear_sequence_parallel
from linear_attention.kernels.primitives.family import Family, Method
from linear_attention.kernels.primitives.nan_guard import clean_log_decay, nan_guard
from linear_attention.kernels.segments import fold_resets, segment_resets
from linear_attention.kernels.state import LinearAttentionState, check_state

# "chunk" has a hand-written VJP (reverse mode only); the others are plain JAX, so `jax.jvp` and
# `jax.jacfwd` go through them.
FORWARD_MODE_ALTERNATIVES = 'method="chunk_parallel", "scan", "associative_scan" or "quadratic"'


def linear_attention(q, k, v, *, normalize: bool = True, eps: float = 1e-6):
    """Non-causal linear attention φQ(φKᵀV) / (φQ(φKᵀ1) + eps), in O(T·M·Dv).

    Args:
      q: featurised queries `[B, Tq, H, M]`.
      k: featurised keys `[B, Tk, H, M]`.
      v: values `[B, Tk, H, Dv]`.
      normalize: divide by φQ(φKᵀ1) + eps; False gives the bare numerator.
      eps: added to the normaliser.
    Returns:
      `[B, Tq, H, Dv]` in `result_type(q, k, v)`, computed in float32 and cast once: a float16
      output is ±inf exactly where the true value exceeds float16's range (|o| > 65504).
    """
    check_float(("q", "k", "v"), (q, k, v))
    check_static("normalize", normalize)
    check_eps(eps)
    check_layouts(q=(q, "[B, Tq, H, M]"), k=(k, "[B, Tk, H, M]"), v=(v, "[B, Tk, H, Dv]"))
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
    segment_ids=None,
    axis_name: str | None = None,
):
    """Causal linear attention, optionally decayed, from an optional initial state.

    Args:
      q: featurised queries `[B, T, H, M]`.
      k: featurised keys `[B, T, H, M]`.
      v: values `[B, T, H, Dv]`.
      log_decay: log of the per-token state decay, ≤ 0 (−inf: a reset). Its rank says what it
        is, so no shape is read two ways: `[H]` a fixed per-head decay (RetNet), `[B, T, H]` a
        data-dependent one per head (Mamba-2, simple GLA), `[B, T, H, M]` one per key dimension
        (GLA, RWKV-6). Size-1 axes broadcast (`[1, T, H]`, `[B, T, 1]`, ...); other ranks (a
        `[T, H]` or `[B, T]` array) raise. None: no decay. NaN or positive values raise when
        the values are concrete; under `jit`/`vmap` only the shape and dtype are checked.
      normalize: divide by q_tᵀ k_sum_t + eps.
      eps: added to the normaliser; must be > 0.
      method: "chunk" (default, the training path), "scan", "associative_scan", "quadratic",
        "chunk_parallel" (every chunk at once, shaped for accelerators) or "pallas" (the Pallas
        kernels: `pallas.py` on a TPU backend, `pallas_gpu.py` (Mosaic GPU, Hopper, bfloat16 or
        float16 inputs when compiled) on a GPU backend; interpreted on any backend inside
        `kernels.pallas_interpret()` or `pallas_interpret("gpu")`; elsewhere it raises;
        `chunk_size` a multiple of 16). The
        default is "chunk" on every backend: on the CPU it is the faster of the two at long
        sequences (BENCHMARKS.md, "`chunk_parallel` against `chunk`"); on GPU/TPU it is a
        choice, not yet a measurement (`experiments/accelerator_check.py` measures both there).
      chunk_size: tokens per chunk for "chunk" and "chunk_parallel"; T need not be a multiple.
      initial_state: state before the first token; None means zeros. Its `k_sum` may be None
        without `normalize` (then the returned state's is None too).
      return_state: also return the state after the last token.
      segment_ids: `[B, T]` integers or a `Segments`, None for one document per row. The state
        is zeroed before every token whose id differs from the previous token's (the initial
        state flows into the first document only): a token attends only to earlier tokens of
        its document.
      axis_name: inside `jax.shard_map` with time split over this mesh axis, compute the
        unsplit result (outputs, gradients, and the global final state on every shard) by
        sequence parallelism (`sequence_parallel.py`). None: no split.
    Returns:
      `o: [B, T, H, Dv]` in `result_type(q, k, v)`, and with `return_state` the final
      `LinearAttentionState` (float32).

    `normalize`, `eps`, `method`, `chunk_size` and `return_state` are static (Python values; a
    traced one raises `ValueError`). Every method computes in float32 and casts the output to
    the input dtype once at the end, so a float16 output is ±inf exactly where the true value
    lies beyond float16's range (|o| > 65504, likely without `normalize`) and finite elsewhere,
    however large the float32 sums before it; no warning (the values are unknown under `jit`).
    Autodiff: reverse mode (`jax.grad`, `jax.vjp`) through every method; forward mode
    (`jax.jvp`, `jax.jacfwd`) through all but "chunk" and "pallas", whose gradients are custom
    VJPs: they raise `ValueError` naming the others, which give the same numbers.
    """
    method, chunk_size = LINEAR.check(method, chunk_size)
    check_static("normalize", normalize)
    check_static("return_state", return_state)
    check_eps(eps)
    B, T, H, M, Dv = _check_qkv(q, k, v)
    if initial_state is not None:
        check_state(initial_state, B, H, M, Dv, need_k_sum=normalize)
    a_BTH = check_log_decay(log_decay, (B, T, H), "[B, T, H]", feature_dim=M)
    a_BTH = fold_resets(segment_resets(segment_ids, B, T, axis_name), a_BTH, H)
    dtype = jnp.result_type(q, k, v)
    q32, k32, v32 = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    with_sum = normalize or (
        return_state and (initial_state is None or initial_state.k_sum is not None)
    )
    kv0_BHMD, z0_BHM = _initial_state(initial_state, (B, H, M, Dv), with_sum)
    if axis_name is not None:  # time split: the unsplit kernel per shard, then a combine
        local = functools.partial(
            causal_linear_attention, normalize=False, method=method, chunk_size=chunk_size
        )
        o_BTHD, kv_BHMD, z_BHM = linear_sequence_parallel(
            local, (q32, k32, v32, a_BTH), (kv0_BHMD, z0_BHM), axis_name, normalize, eps
        )
        state = LinearAttentionState(kv_BHMD, z_BHM)
    elif B == 0 or H == 0:  # nothing to compute (and no chunk of zero rows to split)
        o_BTHD = jnp.zeros((B, T, H, Dv), jnp.float32)
        state = LinearAttentionState(kv=kv0_BHMD, k_sum=z0_BHM)
    else:
        o_BTHD, state = _local(
            (q, k, v),
            (q32, k32, v32, a_BTH),
            (kv0_BHMD, z0_BHM),
            method,
            chunk_size,
            normalize,
            eps,
        )
    o_BTHD = o_BTHD.astype(dtype)
    return (o_BTHD, state) if return_state else o_BTHD


def _initial_state(initial_state, shape, with_sum):
    """The entering `(kv [B, H, M, Dv], k_sum [B, H, M] or None)`, float32 (zeros for None)."""
    if initial_state is None:
        kv0_BHMD = jnp.zeros(shape, jnp.float32)
        return kv0_BHMD, jnp.zeros(shape[:-1], jnp.float32) if with_sum else None
    kv0_BHMD = jnp.asarray(initial_state.kv, jnp.float32)
    return kv0_BHMD, jnp.asarray(initial_state.k_sum, jnp.float32) if with_sum else None


def _local(qkv, qkva, state0, method, chunk_size, normalize, eps):
    """The unsplit kernel on float32 arrays (`qkv`: the inputs as given, for "pallas", which
    reads them in their own dtype), non-finite keys and values guarded (module docstring):
    `(o_BTHD, LinearAttentionState)`, NaN where a bad token reaches."""
    q32, k32, v32, a_BTH = qkva
    guard = nan_guard(q32.shape[:3], (k32, v32), a_BTH)
    qkva = (q32, k32, v32, clean_log_decay(a_BTH))
    kernel = LINEAR.kernel(method, chunk_size=chunk_size)
    o_BTHD, kv_BHMD, z_BHM = kernel(qkv, qkva, state0, guard, normalize, eps)
    last_BH11 = guard.poisoned_BTH[:, -1, :, None, None]
    kv_BHMD = jnp.where(last_BH11, jnp.nan, kv_BHMD)
    z_BHM = None if z_BHM is None else jnp.where(last_BH11[..., 0], jnp.nan, z_BHM)
    return o_BTHD, LinearAttentionState(kv=kv_BHMD, k_sum=z_BHM)


def _pallas_core(qkv, a_BTH, state0, ok_BTH, chunk_size, normalize, eps):
    """The Pallas kernel (`pallas.py`) on the inputs in their own dtype, bad tokens zeroed (in
    that dtype: bfloat16 is read as bfloat16); it always carries the normaliser."""
    q, k, v = qkv
    kv0_BHMD, z0_BHM = state0
    ok_BTH1 = ok_BTH[..., None]
    k_in, v_in = jnp.where(ok_BTH1, k, 0), jnp.where(ok_BTH1, v, 0)
    with reverse_mode_only('method="pallas"', FORWARD_MODE_ALTERNATIVES):
        o_BTHD, kv_BHMD, z_BHM = causal_pallas(
            jnp.asarray(q),
            k_in,
            v_in,
            a_BTH,
            kv0_BHMD,
            z0_BHM,
            chunk_size=chunk_size,
            normalize=normalize,
            eps=eps,
        )
    return o_BTHD, kv_BHMD, z_BHM if z0_BHM is not None else None


def _chunk(qkv, qkva, state0, guard, normalize, eps, *, chunk_size):
    """ "chunk": zeroes bad tokens inside its steps, no extra pass over k and v."""
    del qkv
    with reverse_mode_only('method="chunk"', FORWARD_MODE_ALTERNATIVES):
        return causal_chunked(
            *qkva, *state0, chunk_size=chunk_size, normalize=normalize, eps=eps, guard=guard
        )


def _pallas(qkv, qkva, state0, guard, normalize, eps, *, chunk_size):
    """ "pallas" (`_pallas_core`), the outputs a bad token reaches NaN."""
    ok_BTH, poisoned_BTH = guard
    o_BTHD, kv_BHMD, z_BHM = _pallas_core(qkv, qkva[3], state0, ok_BTH, chunk_size, normalize, eps)
    return jnp.where(poisoned_BTH[..., None], jnp.nan, o_BTHD), kv_BHMD, z_BHM


def _value_column(core):
    """A method that takes the normaliser as one more value column (`_value_column_core`),
    the outputs a bad token reaches NaN; `core` is given the method's static options."""

    def method(qkv, qkva, state0, guard, normalize, eps, **static):
        del qkv
        ok_BTH, poisoned_BTH = guard
        kernel = functools.partial(core, **static)
        o_BTHD, kv_BHMD, z_BHM = _value_column_core(kernel, qkva, state0, ok_BTH, normalize, eps)
        return jnp.where(poisoned_BTH[..., None], jnp.nan, o_BTHD), kv_BHMD, z_BHM

    return method


def _value_column_core(core, qkva, state0, ok_BTH, normalize, eps):
    """`core(q, k, v, a, s0) -> (out, s)` with the normaliser as the output for a value that is
    always 1 (one more value column), bad tokens zeroed: `(o_BTHD, kv_BHMD, z_BHM or None)`."""
    q32, k32, v32, a_BTH = qkva
    kv0_BHMD, z0_BHM = state0
    B, T, H, Dv = v32.shape
    ok_BTH1 = ok_BTH[..., None]
    k32, v32 = jnp.where(ok_BTH1, k32, 0.0), jnp.where(ok_BTH1, v32, 0.0)
    if z0_BHM is not None:
        v32 = jnp.concatenate([v32, jnp.ones((B, T, H, 1), jnp.float32)], axis=-1)
        kv0_BHMD = jnp.concatenate([kv0_BHMD, z0_BHM[..., None]], axis=-1)
    out_BTHD, s_BHMD = core(q32, k32, v32, a_BTH, kv0_BHMD)
    o_BTHD, kv_BHMD = out_BTHD[..., :Dv], s_BHMD[..., :Dv]
    z_BHM = s_BHMD[..., Dv] if z0_BHM is not None else None
    if normalize:
        o_BTHD = o_BTHD / (out_BTHD[..., Dv:] + eps)
    return o_BTHD, kv_BHMD, z_BHM


def _check_qkv(q, k, v):
    check_float(("q", "k", "v"), (q, k, v))
    check_layouts(q=(q, "[B, T, H, M]"), k=(k, "[B, T, H, M]"), v=(v, "[B, T, H, Dv]"))
    if q.shape[1] == 0:
        raise ValueError(f"q, k, v must have at least one time step, got shape {q.shape}")
    for name, x in (("q, k", q), ("v", v)):
        if x.shape[-1] == 0:
            raise ValueError(
                f"{name} must have at least one channel (head dim >= 1), got shape {x.shape}"
            )
    return (*q.shape, v.shape[-1])


def chunk_flops(*, seq_len, heads, dk, dv, chunk_size, **_):
    """The chunk forms per token ("chunk", "chunk_parallel", "pallas"): 2·H·(C·(dk + dv) +
    2·dk·dv) (intra-chunk scores and sum; reading and updating the dk×dv state),
    C = min(chunk_size, T), dk the feature width."""
    c = min(chunk_size, seq_len)
    return 2.0 * heads * (c * (dk + dv) + 2 * dk * dv)


def scan_flops(*, heads, dk, dv, **_):
    """The token forms per token ("scan", "associative_scan"): 4·H·dk·dv (read and update)."""
    return 4.0 * heads * dk * dv


def quadratic_flops(*, seq_len, heads, dk, dv, **_):
    """ "quadratic" per token: 2·H·T·(dk + dv) (the [T, T] scores and their sum)."""
    return 2.0 * heads * seq_len * (dk + dv)


# The Pallas TPU kernel (`pallas.py`): Mosaic on a TPU backend, interpreted inside
# `pallas_interpret()`, an error elsewhere; the other methods run on every backend.
LINEAR = Family(
    name="causal_linear_attention",
    methods={
        "chunk": Method(_chunk, chunk_flops, static=("chunk_size",)),
        "scan": Method(_value_column(causal_scan), scan_flops),
        "associative_scan": Method(_value_column(causal_associative), scan_flops),
        "quadratic": Method(_value_column(causal_quadratic), quadratic_flops),
        "chunk_parallel": Method(
            _value_column(causal_chunk_parallel), chunk_flops, static=("chunk_size",)
        ),
        "pallas": Method(_pallas, chunk_flops, static=("chunk_size",), backends=("tpu", "gpu")),
    },
    step=recurrent_step,
    state=LinearAttentionState,
    splits_time=True,
)
# The methods that run on every backend, and those that need a Pallas backend.
METHODS = tuple(m for m in LINEAR.supported if not LINEAR.methods[m].backends)
PALLAS_METHODS = tuple(m for m in LINEAR.supported if LINEAR.methods[m].backends)
