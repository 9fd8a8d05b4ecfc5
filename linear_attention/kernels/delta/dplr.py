"""The diagonal-plus-low-rank delta rule (DPLR: RWKV-7, FLA's generalized delta rule).

Per head, with a log decay w_t ≤ 0 (per key channel or per head) and vectors a_t, b_t,

    S_t = Diag(exp(w_t)) S_{t−1} + b_t (a_tᵀ S_{t−1}) + k_t v_tᵀ          S: [K, Dv], float32
    o_t = S_tᵀ q_t

(FLA's `dplr_recurrence` without its internal q scaling). The low-rank term reads the state
before the token's decay. RWKV-7 takes a = −κ̂ and b = κ̂ ⊙ (in-context rate); with a = −k̂,
b = β k̂, k := β k̂ and w = 0 it is the delta rule. A reset (segment start) zeroes the state the
token reads: the log decay is −inf there and a_t is zeroed (the low-rank term would otherwise
read the old document's state).

Chunkwise. Inside a chunk let g_t be the cumulative log decay vector (inclusive of t), g⁻_t =
g_{t−1} (exclusive), S the state entering the chunk, and w_t := S_{t−1}ᵀ a_t the low-rank read.
Unrolling S_{t−1} = e^{g⁻_t} ⊙ S + Σ_{s<t} e^{g⁻_t − g_s} ⊙ (b_s w_sᵀ + k_s v_sᵀ) (per row m):

    (I − L_ab) W = (A ⊙ e^{g⁻}) S + L_ak V,   L_xy[t, s] = Σ_m x_tm y_sm e^{g⁻_tm − g_sm}  (s < t)
    O  = (Q ⊙ e^g) S + M_qb W + M_qk V,       M_xy[t, s] = Σ_m x_tm y_sm e^{g_tm − g_sm}    (s ≤ t)
    S' = e^{g_C} ⊙ S + (B ⊙ e^{g_C − g})ᵀ W + (K ⊙ e^{g_C − g})ᵀ V

a generalised UT transform: (I − L_ab)⁻¹ by `primitives.invert_unit_lower`, the four decayed
score matrices by sub-blocks (`primitives.decays.SubBlocks`, the query side reading g⁻ for L), every
exponent ≤ 0, so −30 per token stays exact and finite. A `lax.scan` walks steps of G chunks
(`primitives.chunk_scan.affine_chunk_scan`): a step computes what does not depend on S (decays,
scores, inverse) for its G chunks at once, then the affine maps of S in order. A per-head (or
absent) decay is broadcast over the key channels.

Gradient. Hand-written (`_backward` derives it line by line): the forward pass keeps the state
entering each chunk (never one per token) and six [C, C]/[C, K] residuals per chunk; the
backward pass walks the steps last to first carrying the state's cotangent
(`affine_chunk_scan`), and maps the cotangents of each chunk's affine terms to q, k, v, a, b and
the cumulative log decay by matmuls, the four scores' by `SubBlocks.vjp` (same sub-blocks, every
exponent ≤ 0). Autodiff of the rematerialised step, the earlier form, spent most of its time
differentiating the sub-block scores (docs/results/delta_family_cpu_passes.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_attention.kernels.checks import check_log_decay, check_static
from linear_attention.kernels.delta.checks import (
    check_delta_state,
    check_inputs,
    initial_state_f32,
)
from linear_attention.kernels.delta.pallas import dplr_walk, dplr_walk_back
from linear_attention.kernels.primitives.chunk_scan import affine_chunk_scan, chunks_per_step
from linear_attention.kernels.primitives.decays import ChunkDecays, SubBlocks, sub_block_size
from linear_attention.kernels.primitives.driver import guarded_call
from linear_attention.kernels.primitives.family import Family, Method
from linear_attention.kernels.primitives.layout import from_chunks, pad_time, to_chunks
from linear_attention.kernels.primitives.pallas import CHUNK_MULTIPLE, round_up
from linear_attention.kernels.primitives.pallas_chunk_scan import pallas_affine_chunk_scan
from linear_attention.kernels.primitives.triangular import invert_unit_lower, unit_lower_solve_vjp
from linear_attention.kernels.segments import cumulative_log_decay, decay_state, segment_resets
from linear_attention.kernels.state import LinearAttentionState


def dplr_delta_rule(
    q,
    k,
    v,
    a,
    b,
    *,
    log_decay=None,
    method: str = "chunk",
    chunk_size: int = 64,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    segment_ids=None,
    axis_name: str | None = None,
):
    """The DPLR delta rule over a sequence, per head:

        S_t = Diag(exp(w_t)) S_{t−1} + b_t (a_tᵀ S_{t−1}) + k_t v_tᵀ,    o_t = S_tᵀ q_t

    from S_0 = `initial_state` (zeros if None).

    Args:
      q, k, a, b: `[B, T, H, K]`, used as given (no scaling).
      v: `[B, T, H, Dv]`.
      log_decay: w ≤ 0, None, `[H]`, `[B, T, H]` or `[B, T, H, K]`; −inf zeroes the diagonal part.
      method: "chunk" (generalised UT transform, the training path), "scan" (the reference) or
        "pallas" (the chunk form in Pallas TPU kernels: the forward pass one kernel, the
        generalised UT transform inside it; the backward pass one kernel, the transform made
        again and its pullback inside it; on a TPU, or inside `kernels.pallas_interpret()`;
        `chunk_size` a multiple of 16).
      chunk_size: tokens per chunk for "chunk"; T need not be a multiple of it.
      initial_state: `LinearAttentionState(kv=[B, H, K, Dv], k_sum=None)`.
      return_state: also return the state after the last token.
      segment_ids: `[B, T]` integers or a `Segments`: the state is zeroed before every change
        of id.
      axis_name: time split over this `shard_map` axis (`affine_sequence_parallel`).
    Returns:
      `o: [B, T, H, Dv]` in `result_type(q, k, v)`, and with `return_state` the final state.
    """
    method, chunk_size = DPLR.check(method, chunk_size)
    check_static("return_state", return_state)
    B, T, H, Kd, Dv = _check_inputs(q, k, v, a, b, time=True)
    s0_BHKD = initial_state_f32(initial_state, B, H, Kd, Dv)
    w = check_log_decay(log_decay, (B, T, H), "[B, T, H]", feature_dim=Kd)
    w_BTHK = _per_key(w, (B, T, H, Kd))
    a_in = a.astype(jnp.float32) if DPLR.float32(method) else a  # (zeroed at resets)
    resets_BT = segment_resets(segment_ids, B, T, axis_name)
    reached_BTH = None  # only a segment start zeroes the state (w = −inf keeps the low rank)
    if resets_BT is not None:
        w_BTHK, a_in = _fold_resets(resets_BT, w_BTHK, a_in)
        reached_BTH = jnp.broadcast_to(jnp.cumsum(resets_BT, axis=1)[..., None] > 0, (B, T, H))
    # only a segment start zeroes the whole state, so the guard's resets are those, not w = −inf
    return guarded_call(
        DPLR,
        method,
        q,
        (k, v, a_in, b),
        w_BTHK,
        s0_BHKD,
        options=dict(chunk_size=chunk_size),
        dtype=jnp.result_type(q, k, v),
        return_state=return_state,
        axis_name=axis_name,
        resets=jnp.zeros((B, T), bool) if resets_BT is None else resets_BT,
        reached_BTH=reached_BTH,
    )


def dplr_delta_rule_step(state: LinearAttentionState, q, k, v, a, b, *, log_decay=None):
    """One token of the DPLR delta rule (RWKV-7 decoding), O(1) in the context length.

    Args:
      state: `LinearAttentionState(kv=[B, H, K, Dv], k_sum=None)`.
      q, k, a, b: `[B, H, K]`; v: `[B, H, Dv]`.
      log_decay: ≤ 0, None, `[H]`, `[B, H]` or `[B, H, K]`.
    Returns:
      `(o: [B, H, Dv] in result_type(q, k, v), new state)`.
    """
    B, H, Kd, Dv = _check_inputs(q, k, v, a, b, time=False)
    check_delta_state(state, B, H, Kd, Dv, "state")
    w = check_log_decay(log_decay, (B, H), "[B, H]", feature_dim=Kd)
    dtype = jnp.result_type(q, k, v)
    xs = (x.astype(jnp.float32) for x in (q, k, v, a, b))
    s_BHKD, o_BHD = _token(state.kv.astype(jnp.float32), (*xs, _per_key(w, (B, H, Kd))))
    return o_BHD.astype(dtype), LinearAttentionState(kv=s_BHKD, k_sum=None)


def _token(s_BHKD, inputs):
    """S ← Diag(e^w) S + b (aᵀ S) + k vᵀ (a reads the state before the decay);  o = Sᵀ q."""
    q, k, v, a, b, w = inputs
    read_BHD = jnp.einsum("bhk,bhkd->bhd", a, s_BHKD)
    s_BHKD = (
        decay_state(w[..., None], s_BHKD)  # a −inf channel selects 0, whatever S holds
        + b[..., :, None] * read_BHD[..., None, :]
        + k[..., :, None] * v[..., None, :]
    )
    return s_BHKD, jnp.einsum("bhk,bhkd->bhd", q, s_BHKD)


def dplr_scan(q_BTHK, k_BTHK, v_BTHD, a_BTHK, b_BTHK, w_BTHK, s0_BHKD):
    """DPLR by `lax.scan` over tokens (float32): the reference; returns `(o_BTHD, s_BHKD)`."""
    xs = [jnp.moveaxis(x, 1, 0) for x in (q_BTHK, k_BTHK, v_BTHD, a_BTHK, b_BTHK, w_BTHK)]
    s_BHKD, o_TBHD = jax.lax.scan(_token, s0_BHKD, xs)
    return jnp.moveaxis(o_TBHD, 0, 1), s_BHKD


def dplr_chunked(
    q_BTHK, k_BTHK, v_BTHD, a_BTHK, b_BTHK, w_BTHK, s0_BHKD, *, chunk_size: int, pallas=False
):
    """DPLR chunkwise (generalised UT transform, see the module docstring), float32 arrays
    (with `pallas`, q, k, v, a, b in their input dtype: the kernels take them to float32);
    padding tokens have zero k, v, a, b and log decay: they leave the state alone. With
    `pallas`, the forward pass is one Pallas kernel (`pallas.dplr_walk`), and so is the
    backward pass (`pallas.dplr_walk_back`: `_forward`'s terms made again from the state
    entering each chunk, and `_backward`'s lines, inside it)."""
    T = q_BTHK.shape[1]
    if pallas:
        C, G = min(chunk_size, round_up(T, CHUNK_MULTIPLE)), 1
    else:
        C = min(chunk_size, T)
        G = chunks_per_step(C, -(-T // C))  # padded to whole steps: padding leaves S alone
    inputs = (q_BTHK, k_BTHK, v_BTHD, a_BTHK, b_BTHK, w_BTHK)
    xs = [to_chunks(pad_time(x, G * C), C) for x in inputs]
    # The cumulative sums stay outside the hand-written VJP: autodiff carries dg to w.
    g, n = cumulative_log_decay(xs.pop(), axis=-2, restart=True)
    if pallas:
        o_NBHCD, s_BHKD = pallas_affine_chunk_scan(s0_BHKD, [*xs, g, n], dplr_walk, dplr_walk_back)
    else:
        c = sub_block_size(C)
        forward = functools.partial(_forward, c=c)
        backward = functools.partial(_backward, c=c)
        o_NBHCD, s_BHKD = affine_chunk_scan(s0_BHKD, [*xs, g, n], forward, G, backward)
    return from_chunks(o_NBHCD, T), s_BHKD


def _forward(q, k, v, a, b, g, n, *, c):
    """The state-independent part of a step's chunks, batched ([G, B, H, C, ...]), as the affine
    map of `affine_chunk_scan`: W = W₀ + X with W₀ = (I − L_ab)⁻¹ L_ak V and X = (I − L_ab)⁻¹
    (A ⊙ e^{g⁻}) S, so O = (Q ⊙ e^g) S + M_qb (X + W₀) + M_qk V and
    S' = e^{g_C} S + (B ⊙ e^{g_C − g})ᵀ (X + W₀) + (K ⊙ e^{g_C − g})ᵀ V (W₀: the walk's X₀).
    Residuals for the backward pass: (I − L_ab)⁻¹, W₀, (I − L_ab)⁻¹ (A ⊙ e^{g⁻}), M_qb, M_qk and
    L_ak, a few [C, C] and [C, K] per chunk."""
    d = ChunkDecays.from_cumulative(g, n, exclusive=True)
    inclusive = SubBlocks(d.b, d.n, c)
    exclusive = SubBlocks(d.b, d.n, c, b_query=d.b_prev, n_query=d.n_prev, strict=True)
    inv_CC = invert_unit_lower(-exclusive.scores(a, b))  # (I − L_ab)⁻¹
    l_ak = exclusive.scores(a, k)
    w0_CD = inv_CC @ (l_ak @ v)
    m_qb = inclusive.scores(q, b)
    m_qk = inclusive.scores(q, k)
    b_end, k_end = b * d.end, k * d.end
    x_CK = inv_CC @ (a * d.start_prev)
    # W₀ is the walk's X₀: M_qb W₀ and B_eᵀ W₀ come from its products with X S + W₀
    terms = (x_CK, w0_CD, q * d.start, m_qb, m_qk @ v, b_end, k_end.mT @ v, d.total)
    return terms, (inv_CC, w0_CD, x_CK, m_qb, m_qk, l_ak)


def _backward(xs, res, *, c):
    """The hand-written VJP of `_forward` (the affine terms' cotangents to the inputs).

    With Aₛ = A ⊙ e^{g⁻}, Qₛ = Q ⊙ e^g, B_e = B ⊙ e^{g_C − g}, K_e = K ⊙ e^{g_C − g}, γ = e^{g_C}
    and [W₀ X] = (I − L_ab)⁻¹ [L_ak V, Aₛ], the terms are (X, Qₛ, M_qb, M_qb W₀ + M_qk V, B_e,
    B_eᵀ W₀ + K_eᵀ V, γ). Given their cotangents (dX, dQₛ, dM', dO₀, dB', dU₀, dγ):

        dM_qb = dM' + dO₀ W₀ᵀ,   dM_qk = dO₀ Vᵀ,   dW₀ = M_qbᵀ dO₀ + B_e dU₀
        dB_e = dB' + W₀ dU₀ᵀ,    dK_e = V dU₀ᵀ,    dV = M_qkᵀ dO₀ + K_e dU₀ + L_akᵀ dR₀
        (W₀ is the X₀ of `affine_chunk_scan`, whose walk adds dO₀ W₀ᵀ, W₀ dU₀ᵀ and gives dW₀)
        [dR₀ dAₛ] = (I − L_ab)⁻ᵀ [dW₀ dX],   dL_ab = strict_lower(dR₀ W₀ᵀ + dAₛ Xᵀ)
        dL_ak = dR₀ Vᵀ
        dA = dAₛ ⊙ e^{g⁻},  dQ = dQₛ ⊙ e^g,  dB = dB_e ⊙ e^{g_C − g},  dK = dK_e ⊙ e^{g_C − g}
        dg⁻_t = dAₛ ⊙ Aₛ,   dg_t = dQₛ ⊙ Qₛ − dB_e ⊙ B_e − dK_e ⊙ K_e
                (+ Σ_t (dB_e ⊙ B_e + dK_e ⊙ K_e) + dγ ⊙ γ at t = C)

    plus the four score matrices' cotangents by `SubBlocks.vjp` (L_ab and L_ak read g⁻ on the
    query side, M_qb and M_qk read g), every factor with an exponent ≤ 0; g⁻_t = g_{t−1}, so
    dg⁻_t is added to dg_{t−1} (the first token's g⁻ is the constant 0). Masked exps have
    themselves as derivative (0 across a reset), so the same lines hold with resets.
    """
    q, k, v, a, b, g, n = xs
    inv_CC, w0_CD, x_CK, m_qb, m_qk, l_ak = res
    d = ChunkDecays.from_cumulative(g, n, exclusive=True)
    inclusive = SubBlocks(d.b, d.n, c)
    exclusive = SubBlocks(d.b, d.n, c, b_query=d.b_prev, n_query=d.n_prev, strict=True)
    q_start, a_start = q * d.start, a * d.start_prev
    b_end, k_end = b * d.end, k * d.end

    def pullback(dx, dw0, dq_start, dm_qb, do0, db_end, du0, dgamma):
        # W₀ is the X₀ of `affine_chunk_scan`: dW₀, and W₀'s share of dM_qb and dB_e, come from
        # its walk
        dm_qk = do0 @ v.mT
        dk_end = v @ du0.mT
        dr_CX, da_CC = unit_lower_solve_vjp(
            inv_CC, jnp.concatenate([w0_CD, x_CK], -1), jnp.concatenate([dw0, dx], -1)
        )
        Dv = v.shape[-1]
        dr0, da_start = dr_CX[..., :Dv], dr_CX[..., Dv:]
        dl_ab = -da_CC  # the system is (I − L_ab): A = −L_ab
        dl_ak = dr0 @ v.mT
        dv = m_qk.mT @ do0 + k_end @ du0 + l_ak.mT @ dr0
        da = da_start * d.start_prev
        dq = dq_start * d.start
        db = db_end * d.end
        dk = dk_end * d.end
        dg_prev = da_start * a_start
        dg = dq_start * q_start - db_end * b_end - dk_end * k_end
        dg_end = jnp.sum(db_end * b_end + dk_end * k_end, -2) + dgamma * d.total
        for scores, (x, y), ds in (
            (exclusive, ("a", "b"), dl_ab),
            (exclusive, ("a", "k"), dl_ak),
            (inclusive, ("q", "b"), dm_qb),
            (inclusive, ("q", "k"), dm_qk),
        ):
            named = {"q": q, "k": k, "a": a, "b": b}
            dx_, dy_, dbq, dbk = scores.vjp(ds, named[x], named[y])
            grads = {"q": dq, "k": dk, "a": da, "b": db}
            grads[x] = grads[x] + dx_
            grads[y] = grads[y] + dy_
            dq, dk, da, db = grads["q"], grads["k"], grads["a"], grads["b"]
            if scores is exclusive:
                dg_prev = dg_prev + dbq
            else:
                dg = dg + dbq
            dg = dg + dbk
        dg = dg.at[..., :-1, :].add(dg_prev[..., 1:, :])
        dg = dg.at[..., -1, :].add(dg_end)
        return dq, dk, dv, da, db, dg, None

    return (x_CK, w0_CD, q_start, m_qb, b_end, d.total), pullback


def _per_key(w, shape):
    """The log decay as `shape` = `[..., H, K]`: zeros for None, a per-head one broadcast."""
    if w is None:
        return jnp.zeros(shape, jnp.float32)
    return jnp.broadcast_to(w if w.ndim == len(shape) else w[..., None], shape)


def _fold_resets(starts_BT, w_BTHK, a_BTHK):
    """A reset before token t: log decay −inf and a_t = 0 (the token reads a zero state)."""
    starts = starts_BT[:, :, None, None]
    return jnp.where(starts, -jnp.inf, w_BTHK), jnp.where(starts, 0.0, a_BTHK)


def _check_inputs(q, k, v, a, b, *, time: bool):
    lead = "B, T, H" if time else "B, H"
    check_inputs(
        time=time,
        q=(q, f"[{lead}, K]"),
        k=(k, f"[{lead}, K]"),
        v=(v, f"[{lead}, Dv]"),
        a=(a, f"[{lead}, K]"),
        b=(b, f"[{lead}, K]"),
    )
    return (*q.shape, v.shape[-1])


def chunk_flops(*, seq_len, heads, dk, dv, chunk_size, **_):
    """The chunk (generalised UT) form per token: 2·H·(5·C·dk + 5·C·dv + C²/3 + 5·dk·dv) (the
    four decayed score matrices L_ab, L_ak, M_qb, M_qk and the inverse applied to A; the
    triangular solve; W₀ = (I − L_ab)⁻¹ L_ak V, three intra-chunk sums into O; the reads of S
    through A and Q and the state update through B and K), C = min(chunk_size, T)."""
    c = min(chunk_size, seq_len)
    return 2.0 * heads * (5 * c * dk + 5 * c * dv + c * c / 3 + 5 * dk * dv)


def scan_flops(*, heads, dk, dv, **_):
    """The scan per token: 8·H·dk·dv (aᵀS, b·(aᵀS), k vᵀ, qᵀS)."""
    return 8.0 * heads * dk * dv


DPLR = Family(
    name="dplr_delta_rule",
    methods={
        "chunk": Method(dplr_chunked, chunk_flops, static=("chunk_size",)),
        "scan": Method(dplr_scan, scan_flops),
        "pallas": Method(
            functools.partial(dplr_chunked, pallas=True),
            chunk_flops,
            static=("chunk_size",),
            backends=("tpu",),
        ),
    },
    step=dplr_delta_rule_step,
    state=LinearAttentionState,
    splits_time=True,
)
