"""The delta rule (DeltaNet) and its gated form (Gated DeltaNet): scan and chunkwise WY form.

Per head, with a log decay a_t ≤ 0 (none for DeltaNet) and a write strength β_t in [0, 2],

    S_t = exp(a_t) (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ         S: [K, Dv], float32
    o_t = S_tᵀ q_t

The state moves its value for key k_t towards v_t (a least-squares step) instead of adding to it.
Writing u_t = β_t (v_t − exp(a_t) S_{t−1}ᵀ k_t) turns it into a linear-attention update,
S_t = exp(a_t) S_{t−1} + k_t u_tᵀ, whose "values" u_t depend on the state.

Chunkwise (the training path). Split time into chunks of C tokens; inside a chunk let b_t be the
cumulative log decay, Γ_ts = exp(b_t − b_s) for s ≤ t, and S the state entering the chunk.
Unrolling u_t inside the chunk gives a unit lower-triangular system (the UT transform):

    (I + A) U' = diag(β) V − diag(β e^b) K S,     A = strict_lower(diag(β) K Kᵀ ⊙ Γ)
    U' = U − W S,   with  U = (I + A)⁻¹ diag(β) V,   W = (I + A)⁻¹ diag(β e^b) K
    O  = (Q ⊙ e^b) S + tril(Q Kᵀ ⊙ Γ) U'
    S' = e^{b_C} S + (K ⊙ e^{b_C − b})ᵀ U'

U, W and the C×C scores depend only on the chunk's own tokens: they are computed for all chunks
at once (batched matmuls and one batched triangular inverse); only the three lines in S are
sequential, a `lax.scan` across chunks. Work is O(T·C·(K + Dv) + T·K·Dv).

Resets. A log decay of −inf (a decay of exactly 0: the `segment_ids` boundaries) is taken out
of the cumulative sum and counted (`segments.cumulative_log_decay`), so that b_t − b_s never
reads −inf − (−inf): a factor exp(b_t − b_s) is kept only where no reset lies in (s, t].

Gradient. For a per-head decay (and DeltaNet), autodiff, with the scan's chunk step
rematerialised (`jax.checkpoint`): the backward pass stores the state entering each chunk (one
[K, Dv] state per chunk, never one per token) and recomputes U', O and S' of a chunk from it; the
chunk-parallel part (the UT transform, scores, decays) is plain autodiff of batched matmuls,
O(T·C) residuals, so the gradient's temporaries stay several times below autodiff through the
token scan (BENCHMARKS.md, "The delta rule: chunk against autodiff through the scan"; the remat
step against plain autodiff of the chunk form: docs/results/delta_rule_bench_cpu.md). For a
decay per key channel (KDA) the gradient is hand-written
(`chunk_terms.per_key_backward`, through `primitives.chunk_scan.affine_chunk_scan`): autodiff of the
sub-block scores was the larger part of its time.

The triangular inverse (I + A)⁻¹ is computed by doubling the block size
(`primitives.invert_unit_lower`):
`lax.linalg.triangular_solve` makes the forward several times slower on CPU for these many
small systems (docs/results/delta_rule_bench_cpu.md), and the product form
(I − N)⁻¹ = Π(I + N^(2^j)) is unstable for β near 2 (its powers of A blow up).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_attention.kernels.checks import check_log_decay, check_static
from linear_attention.kernels.delta.checks import (
    check_beta,
    check_delta_state,
    check_inputs,
    initial_state_f32,
)
from linear_attention.kernels.delta.chunk_terms import (
    per_key_backward,
    per_key_forward,
    scalar_terms,
)
from linear_attention.kernels.delta.pallas import ut_walk, ut_walk_back
from linear_attention.kernels.primitives.chunk_scan import affine_chunk_scan, chunks_per_step
from linear_attention.kernels.primitives.decays import (
    sub_block_size,
)
from linear_attention.kernels.primitives.driver import guarded_call
from linear_attention.kernels.primitives.family import Family, Method
from linear_attention.kernels.primitives.layout import from_chunks, pad_time, to_chunks
from linear_attention.kernels.primitives.pallas import CHUNK_MULTIPLE, pallas_target, round_up
from linear_attention.kernels.primitives.pallas_chunk_scan import pallas_affine_chunk_scan
from linear_attention.kernels.segments import (
    cumulative_log_decay,
    decay_state,
    fold_resets,
    segment_resets,
)
from linear_attention.kernels.state import LinearAttentionState


def delta_rule(
    q,
    k,
    v,
    beta,
    *,
    log_decay=None,
    method: str = "chunk",
    chunk_size: int = 64,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    segment_ids=None,
    axis_name: str | None = None,
):
    """The delta rule (DeltaNet; with `log_decay`, Gated DeltaNet; per key channel, KDA), per
    value head:

        S_t = (I − β_t k_t k_tᵀ) Diag(exp(a_t)) S_{t−1} + β_t k_t v_tᵀ,    o_t = S_tᵀ q_t

    from S_0 = `initial_state` (zeros if None); S is `[K, Dv]`, float32. The decay comes first,
    then the delta step (FLA's `naive_recurrent_kda`); for a per-head decay this is
    exp(a_t)(I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ.

    Args:
      q, k: `[B, T, H, K]`, used as given (no scaling; keys are usually L2-normalised).
      v: `[B, T, HV, Dv]`; HV a multiple of H (grouped value heads, as in Qwen3-Next and Kimi
        Linear): value head j reads q/k head j // (HV // H).
      beta: β `[B, T, HV]` in [0, 2] (β > 1 gives the transition a negative eigenvalue).
      log_decay: a ≤ 0, `[HV]`, `[B, T, HV]` or `[B, T, HV, K]` (a decay per key channel: KDA);
        −inf resets S. None: a = 0.
      method: "chunk" (the training path, WY form), "scan" (token by token, the reference) or
        "pallas" (the per-key chunk form in Pallas TPU kernels: the forward pass one kernel, the
        UT transform inside it; the backward pass one kernel, the UT transform made again and
        its pullback inside it; on a TPU, or inside `kernels.pallas_interpret()`; `chunk_size`
        a multiple of 16; on a Hopper GPU, or inside `kernels.pallas_interpret("gpu")`, the
        UT transform from XLA and the chunk walk in Mosaic GPU kernels, `delta.pallas_gpu`:
        bfloat16 or float16 inputs, `chunk_size` a multiple of 64).
      chunk_size: tokens per chunk for "chunk"; T need not be a multiple of it.
      initial_state: `LinearAttentionState(kv=[B, HV, K, Dv], k_sum=None)`.
      return_state: also return the state after the last token.
      segment_ids: `[B, T]` integers or a `Segments` (packed rows): S is reset before every
        change of id.
      axis_name: time split over this `shard_map` axis: the unsplit result by sequence
        parallelism (`sequence_parallel.py`).
    Returns:
      `o: [B, T, HV, Dv]` in `result_type(q, k, v)`, and with `return_state` the final
      `LinearAttentionState(kv, None)` (float32).

    A non-finite key, value, β or log decay at token s makes the outputs t ≥ s of its value head
    NaN up to the next reset, and nothing else, in every method (`primitives.nan_guard`); a
    non-finite initial state those before the first reset. The gradient of a loss on the finite
    outputs is finite.
    """
    method, chunk_size = DELTA_RULE.check(method, chunk_size)
    check_static("return_state", return_state)
    B, T, H, HV, Kd, Dv = check_delta_inputs(q, k, v, beta, time=True)
    s0_BHKD = initial_state_f32(initial_state, B, HV, Kd, Dv)
    a_BTHX = check_log_decay(log_decay, (B, T, HV), "[B, T, HV]", feature_dim=Kd)
    a_BTHX = fold_resets(segment_resets(segment_ids, B, T, axis_name), a_BTHX, HV)
    return guarded_call(
        DELTA_RULE,
        method,
        q,
        (k, v, jnp.asarray(beta, jnp.float32)),
        a_BTHX,
        s0_BHKD,
        options=dict(chunk_size=chunk_size),
        dtype=jnp.result_type(q, k, v),
        return_state=return_state,
        axis_name=axis_name,
        heads=HV,
    )


def delta_rule_step(state: LinearAttentionState, q, k, v, beta, *, log_decay=None):
    """One token of the delta rule, O(1) in the context length (for decoding).

    Args:
      state: `LinearAttentionState(kv=[B, HV, K, Dv], k_sum=None)`, the state after the last token.
      q, k: `[B, H, K]`; v: `[B, HV, Dv]`; beta: `[B, HV]` (HV a multiple of H).
      log_decay: ≤ 0, `[HV]`, `[B, HV]` or `[B, HV, K]` (per key channel); −inf resets.
        None: no decay.
    Returns:
      `(o: [B, HV, Dv] in result_type(q, k, v), new state)`.
    """
    B, H, HV, Kd, Dv = check_delta_inputs(q, k, v, beta, time=False)
    check_delta_state(state, B, HV, Kd, Dv, "state")
    a_BHX = check_log_decay(log_decay, (B, HV), "[B, HV]", feature_dim=Kd)
    dtype = jnp.result_type(q, k, v)
    q32, k32 = (expand_heads(x.astype(jnp.float32), HV, axis=1) for x in (q, k))
    v32 = v.astype(jnp.float32)
    o_BHD, s_BHKD = delta_token(state.kv.astype(jnp.float32), q32, k32, v32, beta, a_BHX)
    return o_BHD.astype(dtype), LinearAttentionState(kv=s_BHKD, k_sum=None)


def expand_heads(x, heads: int, axis: int = 2):
    """Repeat the H query/key heads of `x` to `heads` (a multiple of H): head j reads
    j // (heads // H).

    A repeat, not a gather: its transpose sums the value heads' cotangents back onto their head.
    """
    return jnp.repeat(x, heads // x.shape[axis], axis=axis)


def delta_token(s_BHKD, q_BHK, k_BHK, v_BHD, beta_BH, a_BHX):
    """S ← Diag(e^a) S;  S ← S + β k (v − Sᵀk)ᵀ  (= (I − β k kᵀ) Diag(e^a) S + β k vᵀ);  o = Sᵀq.

    `a_BHX`: `[B, H]` (per head), `[B, H, K]` (per key channel) or None."""
    beta_BH = jnp.asarray(beta_BH, jnp.float32)
    if a_BHX is not None:  # −inf: a reset, a zero state selected (a NaN one too)
        a = a_BHX[..., None] if a_BHX.ndim == 3 else a_BHX[..., None, None]
        s_BHKD = decay_state(a, s_BHKD)
    read_BHD = jnp.einsum("bhk,bhkd->bhd", k_BHK, s_BHKD)
    u_BHD = beta_BH[..., None] * (v_BHD - read_BHD)
    s_BHKD = s_BHKD + k_BHK[..., :, None] * u_BHD[..., None, :]
    return jnp.einsum("bhk,bhkd->bhd", q_BHK, s_BHKD), s_BHKD


def delta_scan(q_BTHK, k_BTHK, v_BTHD, beta_BTH, a_BTH, s0_BHKD):
    """The delta rule by `lax.scan` over tokens (float32); returns `(o_BTHD, s_BHKD)`.

    The reference and decoding path; its autodiff keeps a state per token.
    """

    def step(s_BHKD, inputs):
        q, k, v, beta, a = inputs
        o_BHD, s_BHKD = delta_token(s_BHKD, q, k, v, beta, a)
        return s_BHKD, o_BHD

    time_major = [
        None if x is None else jnp.moveaxis(x, 1, 0)
        for x in (q_BTHK, k_BTHK, v_BTHD, beta_BTH, a_BTH)
    ]
    s_BHKD, o_TBHD = jax.lax.scan(step, s0_BHKD, time_major)
    return jnp.moveaxis(o_TBHD, 0, 1), s_BHKD


def delta_chunked(q_BTHK, k_BTHK, v_BTHD, beta_BTH, a_BTH, s0_BHKD, *, chunk_size: int):
    """The delta rule, chunkwise (WY form), on float32 arrays; returns `(o_BTHD, s_BHKD)`.

    `a_BTH`: None, `[B, T, H]` or `[B, T, H, K]` (per key channel: `delta_chunked_per_key`)."""
    if a_BTH is not None and a_BTH.ndim == 4:
        return delta_chunked_per_key(
            q_BTHK, k_BTHK, v_BTHD, beta_BTH, a_BTH, s0_BHKD, chunk_size=chunk_size
        )
    T = q_BTHK.shape[1]
    C = min(chunk_size, T)

    # ---- 1. chunks [N, B, H, C, ...] (zero β and log decay: padded tokens leave S alone) ----
    q, k, v, beta, a = (
        to_chunks(pad_time(x, C), C) for x in (q_BTHK, k_BTHK, v_BTHD, beta_BTH, a_BTH)
    )

    # ---- 2, 3. decay factors and the UT transform, all chunks at once ----
    u_NBHCD, w_NBHCK, p_NBHCC, q_start, k_end, total = scalar_terms(q, k, v, beta, a, C)

    # ---- 4. across chunks: a lax.scan carrying S ----
    def step(s_BHKD, inputs):
        u, w, p, qs, ke, total = inputs
        u = u - w @ s_BHKD  # U' = U − W S: the state-corrected, β-scaled values
        o = qs @ s_BHKD + p @ u
        if total is not None:
            s_BHKD = total[..., None, None] * s_BHKD
        return s_BHKD + jnp.swapaxes(ke, -1, -2) @ u, o

    xs = (u_NBHCD, w_NBHCK, p_NBHCC, q_start, k_end, total)
    # Rematerialised: the backward pass keeps only the state entering each chunk.
    s_BHKD, o_NBHCD = jax.lax.scan(jax.checkpoint(step), s0_BHKD, xs)
    return from_chunks(o_NBHCD, T), s_BHKD


def delta_pallas(q_BTHK, k_BTHK, v_BTHD, beta_BTH, a_BTH, s0_BHKD, *, chunk_size: int):
    """`method="pallas"`: the chunk form of a decay per key channel (`delta_chunked_per_key`) in
    Pallas kernels: the forward pass by `delta.pallas.ut_walk` (UT transform inside), the backward
    by `delta.pallas.ut_walk_back` (the same terms again and the lines of
    `chunk_terms.per_key_backward` inside), joined by `pallas_affine_chunk_scan`. q, k, v in any
    float dtype (float32 in the kernels). A per-token decay `[B, T, H]` (or none: zeros) reaches
    the kernels as its cumulative sums and reset counts `[N, B, H, C]`, read on every key channel
    in VMEM; a decay per key channel as `[N, B, H, C, K]`. The cumulative sums stay outside the
    kernels' VJP: autodiff carries db to a. On a GPU backend, or under `pallas_interpret("gpu")` /
    `pallas_lowering("gpu")`, the Mosaic GPU walk runs instead (`delta.pallas_gpu`: the UT
    transform from XLA, the chunk walk in the kernels; `chunk_size` a multiple of 64)."""
    backend, interpret = pallas_target('delta_rule(method="pallas")')
    if backend == "gpu":
        # Imported here: the Mosaic GPU modules add ~0.2 s to every `import linear_attention`.
        from linear_attention.kernels.delta.pallas_gpu import delta_pallas_gpu

        return delta_pallas_gpu(
            q_BTHK, k_BTHK, v_BTHD, beta_BTH, a_BTH, s0_BHKD,
            chunk_size=chunk_size, interpret=interpret,
        )  # fmt: skip
    B, T, H, _ = q_BTHK.shape
    if a_BTH is None:
        a_BTH = jnp.zeros((B, T, H), jnp.float32)
    C = min(chunk_size, round_up(T, CHUNK_MULTIPLE))
    xs = [to_chunks(pad_time(x, C), C) for x in (q_BTHK, k_BTHK, v_BTHD, beta_BTH, a_BTH)]
    b, n = cumulative_log_decay(xs.pop(), axis=3, restart=True)  # [N, B, H, C(, K)]
    o_NBHCD, s_BHKD = pallas_affine_chunk_scan(s0_BHKD, [*xs, b, n], ut_walk, ut_walk_back)
    return from_chunks(o_NBHCD, T), s_BHKD


def delta_chunked_per_key(q_BTHK, k_BTHK, v_BTHD, beta_BTH, a_BTHK, s0_BHKD, *, chunk_size):
    """The delta rule with a decay per key channel (KDA), chunkwise, on float32 arrays.

    Inside a chunk, with b_t the cumulative log decay vector and S the entering state,
    D_t S_{t−1} = e^{b_t} ⊙ S + Σ_{s<t} e^{b_t − b_s} ⊙ k_s u_sᵀ (per row m), so
    u_t = β_t(v_t − (D_t S_{t−1})ᵀk_t) solves the unit lower-triangular system of the scalar
    case with the scores A_ts = β_t Σ_m k_tm k_sm e^{b_tm − b_sm} (s < t):

        (I + A) U' = diag(β) V − diag(β) (K ⊙ e^b) S
        O  = (Q ⊙ e^b) S + [Σ_m q_tm k_sm e^{b_tm − b_sm}]_{s≤t} U'
        S' = e^{b_C} ⊙ S + (K ⊙ e^{b_C − b})ᵀ U'

    The decayed scores are taken in sub-blocks (`primitives.decays.SubBlocks`, GLA's
    factorisation), every exponent ≤ 0: exact and finite with −30 per token. A `lax.scan` walks
    steps of G chunks (`primitives.chunk_scan.affine_chunk_scan`): a step computes the
    state-independent part (decays, scores, inverse) of its chunks at once, then their affine maps
    of S in order. The gradient is hand-written: the forward pass keeps the state entering each
    chunk and a few [C, C]/[C, K] residuals per chunk (the inverse, U, W, the scores), never a
    state per token; the backward pass walks the steps last to first
    (`chunk_terms.per_key_backward` derives each line). The cumulative log decays are summed
    outside it (autodiff carries their cotangent back to a, stopping at resets). Its Pallas form
    is `delta_pallas`.
    """
    T = q_BTHK.shape[1]
    C = min(chunk_size, T)
    G = chunks_per_step(C, -(-T // C))  # padded to whole steps: padding leaves S alone
    xs = [to_chunks(pad_time(x, G * C), C) for x in (q_BTHK, k_BTHK, v_BTHD, beta_BTH, a_BTHK)]
    # The cumulative sums stay outside the hand-written VJP: autodiff carries db to a.
    b, n = cumulative_log_decay(xs.pop(), axis=-2, restart=True)
    c = sub_block_size(C)
    forward = functools.partial(per_key_forward, c=c)
    backward = functools.partial(per_key_backward, c=c)
    o_NBHCD, s_BHKD = affine_chunk_scan(s0_BHKD, [*xs, b, n], forward, G, backward)
    return from_chunks(o_NBHCD, T), s_BHKD


def check_delta_inputs(q, k, v, beta, *, time: bool):
    """Ranks and sizes of q, k `[B, (T,) H, K]`, v `[B, (T,) HV, Dv]`, beta `[B, (T,) HV]`; HV
    must be a multiple of H. Returns `(B, (T,) H, HV, K, Dv)`."""
    lead = "B, T" if time else "B"
    head_axis = 2 if time else 1
    grouped = jnp.ndim(v) == len(lead.split(", ")) + 2 and jnp.ndim(q) == jnp.ndim(v)
    grouped = grouped and jnp.shape(v)[head_axis] != jnp.shape(q)[head_axis]
    hv = "HV" if grouped else "H"
    check_inputs(
        time=time,
        q=(q, f"[{lead}, H, K]"),
        k=(k, f"[{lead}, H, K]"),
        v=(v, f"[{lead}, {hv}, Dv]"),
        beta=(beta, f"[{lead}, {hv}]"),
    )
    H, HV = q.shape[head_axis], v.shape[head_axis]
    if HV % H:
        raise ValueError(
            f"v has {HV} value heads, not a multiple of the {H} query/key heads of q, k "
            f"(q: {tuple(q.shape)}, v: {tuple(v.shape)}): grouped value heads need HV = g·H"
        )
    check_beta(beta, 0.0, 2.0)
    return (*q.shape[:-2], H, HV, q.shape[-1], v.shape[-1])


def chunk_flops(*, seq_len, heads, dk, dv, chunk_size, **_):
    """The chunk (WY/UT) form per token: 2·H·(3·C·dk + 2·C·dv + C²/3 + 3·dk·dv) (βKKᵀ, QKᵀ,
    W = T·βK; U = T·βV and the intra sum; the triangular solve, C³/3 multiply-adds per chunk;
    W·S, Q·S and the state update), C = min(chunk_size, T). H counts the value heads, which
    carry the states; a decay per key channel (KDA) is elementwise."""
    c = min(chunk_size, seq_len)
    return 2.0 * heads * (3 * c * dk + 2 * c * dv + c * c / 3 + 3 * dk * dv)


def scan_flops(*, heads, dk, dv, **_):
    """The scan per token: 6·H·dk·dv (kᵀS, the rank-one update, qᵀS)."""
    return 6.0 * heads * dk * dv


DELTA_RULE = Family(
    name="delta_rule",
    methods={
        "chunk": Method(delta_chunked, chunk_flops, static=("chunk_size",)),
        "scan": Method(delta_scan, scan_flops),
        "pallas": Method(
            delta_pallas, chunk_flops, static=("chunk_size",), backends=("tpu", "gpu")
        ),
    },
    step=delta_rule_step,
    state=LinearAttentionState,
    splits_time=True,
)
