"""Float64 NumPy references for the linear-attention kernels (the recurrences, token by token),
and the relative error the kernel tests compare against them with."""

import numpy as np


def rel_err(x, ref) -> float:
    """max |x − ref| / max |ref| in float64 (the denominator floored at 1e-12)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-12))


def causal_linear_attention_loop(
    q, k, v, log_decay=None, kv0=None, k_sum0=None, normalize=True, eps=1e-6, segment_ids=None
):
    """kv_t = diag(exp(a_t)) kv_{t-1} + k_t v_tᵀ; k_sum alike; o_t = q_tᵀkv_t / (q_tᵀk_sum_t + eps).

    `log_decay`: None, `[H]`, `[B, T, H]` or `[B, T, H, M]` (per key dimension); −inf resets.
    `segment_ids [B, T]`: the state is zeroed before every token whose id differs from the
    previous one's. Returns (o [B,T,H,Dv], kv [B,H,M,Dv], k_sum [B,H,M]) in float64.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, M = q.shape
    Dv = v.shape[-1]
    if log_decay is None:
        a = np.zeros((B, T, H, 1))
    elif np.ndim(log_decay) == 4:
        a = np.broadcast_to(np.asarray(log_decay, np.float64), (B, T, H, M))
    else:
        a = np.broadcast_to(np.asarray(log_decay, np.float64), (B, T, H))[..., None]
    kv = np.zeros((B, H, M, Dv)) if kv0 is None else np.array(kv0, np.float64)
    k_sum = np.zeros((B, H, M)) if k_sum0 is None else np.array(k_sum0, np.float64)
    o = np.zeros((B, T, H, Dv))
    for t in range(T):
        decay = np.exp(a[:, t])  # [B, H, 1 or M]
        if segment_ids is not None and t > 0:
            new_doc = np.asarray(segment_ids)[:, t] != np.asarray(segment_ids)[:, t - 1]
            decay = np.where(new_doc[:, None, None], 0.0, decay)
        kv = decay[..., None] * kv + k[:, t, :, :, None] * v[:, t, :, None, :]
        k_sum = decay * k_sum + k[:, t]
        num = np.einsum("bhm,bhmd->bhd", q[:, t], kv)
        if normalize:
            num = num / (np.einsum("bhm,bhm->bh", q[:, t], k_sum)[..., None] + eps)
        o[:, t] = num
    return o, kv, k_sum


def linear_attention_noncausal(q, k, v, normalize=True, eps=1e-6):
    """o_t = Σ_s (q_t·k_s) v_s / (Σ_s q_t·k_s + eps), over all s, in float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    w = np.einsum("bthm,bshm->bhts", q, k)
    o = np.einsum("bhts,bshd->bthd", w, v)
    if normalize:
        o = o / (np.einsum("bhts->bth", w)[..., None] + eps)
    return o


def delta_rule_loop(q, k, v, beta, log_decay=None, s0=None):
    """S_t = exp(a_t)(I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ; o_t = S_tᵀ q_t, in float64.

    `log_decay` broadcastable to [B,T,H] (−inf resets). Returns (o [B,T,H,Dv], S [B,H,K,Dv]).
    """
    q, k, v, beta = (np.asarray(x, np.float64) for x in (q, k, v, beta))
    B, T, H, K = q.shape
    a = (
        np.zeros((B, T, H))
        if log_decay is None
        else np.broadcast_to(np.asarray(log_decay, np.float64), (B, T, H))
    )
    S = np.zeros((B, H, K, v.shape[-1])) if s0 is None else np.array(s0, np.float64)
    o = np.zeros((B, T, H, v.shape[-1]))
    eye = np.eye(K)
    for t in range(T):
        kt, bt = k[:, t], beta[:, t][..., None, None]
        kk = kt[..., :, None] * kt[..., None, :]
        transition = np.exp(a[:, t])[..., None, None] * (eye - bt * kk)
        S = transition @ S + bt * kt[..., :, None] * v[:, t, :, None, :]
        o[:, t] = np.einsum("bhk,bhkd->bhd", q[:, t], S)
    return o, S


def _new_doc(segment_ids, t):
    """[B] bool: token t starts a new document (never at t = 0)."""
    if segment_ids is None or t == 0:
        return None
    ids = np.asarray(segment_ids)
    return ids[:, t] != ids[:, t - 1]


def _zero_rows(S, new_doc):
    return S if new_doc is None else np.where(new_doc[:, None, None, None], 0.0, S)


def kda_loop(q, k, v, beta, log_decay=None, s0=None, segment_ids=None):
    """Grouped value heads, a decay per head or per key channel (KDA), in float64:

    S_t = (I − β_t k_t k_tᵀ) Diag(exp(a_t)) S_{t−1} + β_t k_t v_tᵀ;  o_t = S_tᵀ q_t, value head j
    reading q/k head j // (HV // H). `log_decay`: None, [HV], [B,T,HV] or [B,T,HV,K].
    Returns (o [B,T,HV,Dv], S [B,HV,K,Dv]).
    """
    q, k, v, beta = (np.asarray(x, np.float64) for x in (q, k, v, beta))
    B, T, H, K = q.shape
    HV, Dv = v.shape[2], v.shape[3]
    q, k = np.repeat(q, HV // H, axis=2), np.repeat(k, HV // H, axis=2)
    if log_decay is None:
        a = np.zeros((B, T, HV, 1))
    elif np.ndim(log_decay) == 4:
        a = np.broadcast_to(np.asarray(log_decay, np.float64), (B, T, HV, K))
    else:
        a = np.broadcast_to(np.asarray(log_decay, np.float64), (B, T, HV))[..., None]
    S = np.zeros((B, HV, K, Dv)) if s0 is None else np.array(s0, np.float64)
    o = np.zeros((B, T, HV, Dv))
    for t in range(T):
        S = _zero_rows(np.exp(a[:, t])[..., None] * S, _new_doc(segment_ids, t))
        kt, bt = k[:, t], beta[:, t][..., None]
        read = np.einsum("bhk,bhkd->bhd", kt, S)
        S = S + kt[..., :, None] * (bt * (v[:, t] - read))[..., None, :]
        o[:, t] = np.einsum("bhk,bhkd->bhd", q[:, t], S)
    return o, S


def dplr_loop(q, k, v, a, b, log_decay=None, s0=None, segment_ids=None):
    """S_t = Diag(exp(w_t)) S_{t−1} + b_t (a_tᵀ S_{t−1}) + k_t v_tᵀ;  o_t = S_tᵀ q_t, in float64.

    `log_decay` w: None, [H], [B,T,H] or [B,T,H,K]. A new document zeroes S_{t−1} (both terms).
    """
    q, k, v, a, b = (np.asarray(x, np.float64) for x in (q, k, v, a, b))
    B, T, H, K = q.shape
    Dv = v.shape[-1]
    if log_decay is None:
        w = np.zeros((B, T, H, 1))
    elif np.ndim(log_decay) == 4:
        w = np.broadcast_to(np.asarray(log_decay, np.float64), (B, T, H, K))
    else:
        w = np.broadcast_to(np.asarray(log_decay, np.float64), (B, T, H))[..., None]
    S = np.zeros((B, H, K, Dv)) if s0 is None else np.array(s0, np.float64)
    o = np.zeros((B, T, H, Dv))
    for t in range(T):
        S = _zero_rows(S, _new_doc(segment_ids, t))
        read = np.einsum("bhk,bhkd->bhd", a[:, t], S)
        S = (
            np.exp(w[:, t])[..., None] * S
            + b[:, t, :, :, None] * read[:, :, None, :]
            + k[:, t, :, :, None] * v[:, t, :, None, :]
        )
        o[:, t] = np.einsum("bhk,bhkd->bhd", q[:, t], S)
    return o, S


def delta_product_loop(q, k, v, beta, log_decay=None, s0=None, segment_ids=None):
    """Per token: S ← exp(a_t) S, then for j = 1..n: S ← (I − β_tj k_tj k_tjᵀ) S + β_tj k_tj v_tjᵀ;
    o_t = S_tᵀ q_t, in float64. k [B,T,H,n,K], v [B,T,H,n,Dv], beta [B,T,H,n]; `log_decay` None,
    [H] or [B,T,H]."""
    q, k, v, beta = (np.asarray(x, np.float64) for x in (q, k, v, beta))
    B, T, H, n, K = k.shape
    Dv = v.shape[-1]
    a = (
        np.zeros((B, T, H))
        if log_decay is None
        else np.broadcast_to(np.asarray(log_decay, np.float64), (B, T, H))
    )
    S = np.zeros((B, H, K, Dv)) if s0 is None else np.array(s0, np.float64)
    o = np.zeros((B, T, H, Dv))
    for t in range(T):
        S = _zero_rows(np.exp(a[:, t])[..., None, None] * S, _new_doc(segment_ids, t))
        for j in range(n):
            kt, bt = k[:, t, :, j], beta[:, t, :, j][..., None]
            read = np.einsum("bhk,bhkd->bhd", kt, S)
            S = S + kt[..., :, None] * (bt * (v[:, t, :, j] - read))[..., None, :]
        o[:, t] = np.einsum("bhk,bhkd->bhd", q[:, t], S)
    return o, S


def forgetting_attention_loop(q, k, v, log_forget=None, scale=None, segment_ids=None):
    """Forgetting attention (FoX) token by token in float64: query t attends to keys s ≤ t of its
    document with logit scale·q_t·k_s + Σ_{s<l≤t} log f_l (−inf past a reset)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, D = q.shape
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    a = np.zeros((B, T, H)) if log_forget is None else np.asarray(log_forget, np.float64)
    a = np.broadcast_to(a, (B, T, H))
    o = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            for t in range(T):
                logits, bias = [], 0.0
                for s in range(t, -1, -1):  # walk back from t, adding the gates passed
                    if s < t:
                        bias += a[b, s + 1, h]
                        if segment_ids is not None and _new_doc(segment_ids, s + 1)[b]:
                            bias = -np.inf
                    logits.append(scale * q[b, t, h] @ k[b, s, h] + bias)
                logits = np.asarray(logits[::-1])
                p = np.exp(logits - np.max(logits))
                o[b, t, h] = (p / p.sum()) @ v[b, : t + 1, h]
    return o


def mesa_net_loop(q, k, v, log_decay, beta, lam, kk0=None, kv0=None, segment_ids=None):
    """MesaNet token by token in float64 with an exact solve:
    H_kk,t = γ_t H_kk,t−1 + β_t k_t k_tᵀ, H_kv,t = γ_t H_kv,t−1 + β_t k_t v_tᵀ (γ = exp(a), −inf
    a reset; zeroed before every document start of `segment_ids`),
    o_t = H_kv,tᵀ (H_kk,t + diag(λ))⁻¹ q_t. `log_decay` None, `[H]` or `[B, T, H]`; `lam [H, K]`.
    Returns (o [B,T,H,Dv], kk [B,H,K,K], kv [B,H,K,Dv]) in float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, K = q.shape
    Dv = v.shape[-1]
    a = np.zeros((B, T, H)) if log_decay is None else np.asarray(log_decay, np.float64)
    a = np.broadcast_to(a, (B, T, H))
    beta = np.asarray(beta, np.float64)
    lam_diag = np.asarray(lam, np.float64)[:, :, None] * np.eye(K)  # [H, K, K]
    kk = np.zeros((B, H, K, K)) if kk0 is None else np.array(kk0, np.float64)
    kv = np.zeros((B, H, K, Dv)) if kv0 is None else np.array(kv0, np.float64)
    o = np.zeros((B, T, H, Dv))
    for t in range(T):
        gamma = np.exp(a[:, t])[..., None, None]
        if segment_ids is not None and t > 0:
            gamma = np.where(_new_doc(segment_ids, t)[:, None, None, None], 0.0, gamma)
        kb = beta[:, t, :, None] * k[:, t]
        kk = gamma * kk + kb[..., :, None] * k[:, t, :, None, :]
        kv = gamma * kv + kb[..., :, None] * v[:, t, :, None, :]
        x = np.linalg.solve(kk + lam_diag, q[:, t, :, :, None])[..., 0]
        o[:, t] = np.einsum("bhkd,bhk->bhd", kv, x)
    return o, kk, kv


def log_linear_attention_loop(
    q, k, v, log_decay, level_weights, segment_ids=None, s0=None, position=None
):
    """Log-linear attention token by token in float64, its Fenwick tree as a binary counter.

    The keys of a sequence before its token t are held in blocks whose sizes are the set bits
    of t (largest first); a block of 2^(ℓ−1) keys is level ℓ and is read with weight λ_t^ℓ, the
    token itself with λ_t^0. After the token its own block of one joins the tail, and while the
    last two blocks have the same size they merge (the counter's carry). Every block decays by
    exp(a_t) per token; a −inf log decay or a new document (`segment_ids`) drops every block (a
    new sequence). `s0 [B, H, L, K, V]` and `position [B, H]`: the state of the sequence so far
    (slot s: the block of 2^s keys). Returns (o [B, T, H, V], final levels [B, H, L, K, V],
    final position [B, H]) in float64 / int.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    lam = np.asarray(level_weights, np.float64)
    B, T, H, K = q.shape
    V, L = v.shape[-1], lam.shape[-1]
    a = np.broadcast_to(np.asarray(log_decay, np.float64), (B, T, H))
    position = np.zeros((B, H), int) if position is None else np.asarray(position)
    o = np.zeros((B, T, H, V))
    final = np.zeros((B, H, L, K, V))
    count = np.zeros((B, H), int)
    for b in range(B):
        for h in range(H):
            blocks = [  # [size, state], largest first
                [1 << s, np.zeros((K, V)) if s0 is None else np.asarray(s0, np.float64)[b, h, s]]
                for s in reversed(range(L))
                if position[b, h] >> s & 1
            ]
            for t in range(T):
                new_doc = _new_doc(segment_ids, t)
                if np.isneginf(a[b, t, h]) or (new_doc is not None and new_doc[b]):
                    blocks = []
                for block in blocks:
                    block[1] = np.exp(a[b, t, h]) * block[1]
                out = lam[b, t, h, 0] * (q[b, t, h] @ k[b, t, h]) * v[b, t, h]
                for size, state in blocks:
                    out = out + lam[b, t, h, size.bit_length()] * (q[b, t, h] @ state)
                o[b, t, h] = out
                blocks.append([1, np.outer(k[b, t, h], v[b, t, h])])
                while len(blocks) > 1 and blocks[-1][0] == blocks[-2][0]:
                    size, state = blocks.pop()
                    blocks[-1] = [2 * size, blocks[-1][1] + state]
            for size, state in blocks:
                final[b, h, size.bit_length() - 1] = state
            count[b, h] = sum(size for size, _ in blocks)
    return o, final, count


def path_attention_loop(q, k, v, w, beta, log_forget=None, scale=None, segment_ids=None):
    """PaTH attention token by token in float64: query t attends to keys s ≤ t of its document
    with logit scale·q_tᵀ H_t ⋯ H_{s+1} k_s + Σ_{s<l≤t} log f_l, H_l = I − β_l w_l w_lᵀ (−inf
    past a reset). Walking back from t, the query is moved through H_{s+1} before meeting k_s."""
    q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, w))
    beta = np.asarray(beta, np.float64)
    B, T, H, D = q.shape
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    a = np.zeros((B, T, H)) if log_forget is None else np.asarray(log_forget, np.float64)
    a = np.broadcast_to(a, (B, T, H))
    o = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            for t in range(T):
                x, logits, bias = q[b, t, h].copy(), [], 0.0
                for s in range(t, -1, -1):
                    if s < t:
                        u = w[b, s + 1, h]
                        x = x - beta[b, s + 1, h] * (u @ x) * u
                        bias += a[b, s + 1, h]
                        if segment_ids is not None and _new_doc(segment_ids, s + 1)[b]:
                            bias = -np.inf
                    logits.append(scale * x @ k[b, s, h] + bias)
                logits = np.asarray(logits[::-1])
                p = np.exp(logits - np.max(logits))
                o[b, t, h] = (p / p.sum()) @ v[b, : t + 1, h]
    return o


def log_linear_delta_rule_loop(q, k, v, beta, log_decay, level_weights, s0=None, position=None):
    """Log-linear Gated DeltaNet token by token in float64: the blocks of
    `log_linear_attention_loop` (a binary counter; dropped at a reset), each a delta-rule state
    that every token transforms by exp(a_t)(I − β_t k_t k_tᵀ) before it is read; the token's
    own block is β_t k_t v_tᵀ. Returns (o, final levels, final position)."""
    q, k, v, beta = (np.asarray(x, np.float64) for x in (q, k, v, beta))
    lam = np.asarray(level_weights, np.float64)
    B, T, H, K = q.shape
    V, L = v.shape[-1], lam.shape[-1]
    a = np.broadcast_to(np.asarray(log_decay, np.float64), (B, T, H))
    position = np.zeros((B, H), int) if position is None else np.asarray(position)
    o, final, count = np.zeros((B, T, H, V)), np.zeros((B, H, L, K, V)), np.zeros((B, H), int)
    for b in range(B):
        for h in range(H):
            blocks = [
                [1 << s, np.zeros((K, V)) if s0 is None else np.asarray(s0, np.float64)[b, h, s]]
                for s in reversed(range(L))
                if position[b, h] >> s & 1
            ]
            for t in range(T):
                if np.isneginf(a[b, t, h]):
                    blocks = []
                kt, bt = k[b, t, h], beta[b, t, h]
                transition = np.exp(a[b, t, h]) * (np.eye(K) - bt * np.outer(kt, kt))
                for block in blocks:
                    block[1] = transition @ block[1]
                out = lam[b, t, h, 0] * bt * (q[b, t, h] @ kt) * v[b, t, h]
                for size, state in blocks:
                    out = out + lam[b, t, h, size.bit_length()] * (q[b, t, h] @ state)
                o[b, t, h] = out
                blocks.append([1, bt * np.outer(kt, v[b, t, h])])
                while len(blocks) > 1 and blocks[-1][0] == blocks[-2][0]:
                    size, state = blocks.pop()
                    blocks[-1] = [2 * size, blocks[-1][1] + state]
            for size, state in blocks:
                final[b, h, size.bit_length() - 1] = state
            count[b, h] = sum(size for size, _ in blocks)
    return o, final, count


def _starts(segment_ids, B, T):
    """`[B, T]` bool: a document starts at t > 0 (its id differs from the previous token's)."""
    if segment_ids is None:
        return np.zeros((B, T), bool)
    ids = np.asarray(segment_ids)
    return np.pad(ids[:, 1:] != ids[:, :-1], ((0, 0), (1, 0)))


def rg_lru_loop(x, log_a, h0=None, segment_ids=None):
    """Griffin's RG-LRU: h_t = a_t h_{t−1} + √(1 − a_t²) x_t (x_t unscaled and h_{t−1} = 0 at a
    document start), y_t = h_t. `x`, `log_a` `[B, T, D]`, `h0` `[B, D]`. Returns (y, h)."""
    x, log_a = (np.asarray(v, np.float64) for v in (x, log_a))
    B, T, D = x.shape
    starts = _starts(segment_ids, B, T)
    h = np.zeros((B, D)) if h0 is None else np.array(h0, np.float64)
    y = np.zeros((B, T, D))
    for b in range(B):
        for t in range(T):
            a = np.exp(log_a[b, t])
            if starts[b, t]:
                h[b] = x[b, t]
            else:
                h[b] = a * h[b] + np.sqrt(1.0 - a * a) * x[b, t]
            y[b, t] = h[b]
    return y, h


def selective_scan_loop(x, delta, A, Bm, C, D=None, h0=None, segment_ids=None):
    """Mamba-1: h_t = exp(Δ_t A) ⊙ h_{t−1} + Δ_t x_t B_tᵀ (h_{t−1} = 0 at a document start),
    y_t = h_t C_t + D x_t. `x`, `delta` `[B, T, D]`, `A` `[D, N]`, `Bm`, `C` `[B, T, N]`, `h0`
    `[B, D, N]`. Returns (y, h)."""
    x, delta, A, Bm, C = (np.asarray(v, np.float64) for v in (x, delta, A, Bm, C))
    Bn, T, Dd = x.shape
    starts = _starts(segment_ids, Bn, T)
    h = np.zeros((Bn, Dd, A.shape[1])) if h0 is None else np.array(h0, np.float64)
    y = np.zeros((Bn, T, Dd))
    for b in range(Bn):
        for t in range(T):
            for d in range(Dd):
                dt = delta[b, t, d]
                kept = 0.0 if starts[b, t] else np.exp(dt * A[d]) * h[b, d]  # 0, even for NaN
                h[b, d] = kept + dt * x[b, t, d] * Bm[b, t]
                y[b, t, d] = h[b, d] @ C[b, t]
    if D is not None:
        y = y + np.asarray(D, np.float64) * x
    return y, h


def comba_loop(q, k, v, p, beta, g=None, h0=None, segment_ids=None, scale=None):
    """Comba: S̃ = γ_t S_{t−1} (0 at a document start), S_t = S̃ + β_t k_t (v_t − S̃ᵀ p_t)ᵀ,
    o_t = S_tᵀ (scale q_t). q, k, p `[B, T, H, K]`, v `[B, T, H, V]`, β and g (log γ)
    `[B, T, H]`, h0 `[B, H, K, V]`; scale None: K^−½. Returns (o, S)."""
    q, k, v, p, beta = (np.asarray(x, np.float64) for x in (q, k, v, p, beta))
    B, T, H, Kd = q.shape
    g = np.zeros((B, T, H)) if g is None else np.asarray(g, np.float64)
    scale = Kd**-0.5 if scale is None else scale
    starts = _starts(segment_ids, B, T)
    S = np.zeros((B, H, Kd, v.shape[-1])) if h0 is None else np.array(h0, np.float64)
    o = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        for t in range(T):
            for h in range(H):
                if starts[b, t]:  # zeroed, even where S holds a NaN
                    kept = np.zeros_like(S[b, h])
                else:
                    kept = np.exp(g[b, t, h]) * S[b, h]
                u = beta[b, t, h] * (v[b, t, h] - kept.T @ p[b, t, h])
                S[b, h] = kept + np.outer(k[b, t, h], u)
                o[b, t, h] = S[b, h].T @ (scale * q[b, t, h])
    return o, S


def gated_oja_loop(q, k, v, beta, g=None, h0=None, segment_ids=None, scale=None):
    """The gated Oja rule: S̃ = S_{t−1} Diag(exp(g_t)) (0 at a document start), S_t = S̃ +
    β_t (k_t − S̃ v_t) v_tᵀ, o_t = S_tᵀ (scale q_t). q, k `[B, T, H, K]`, v `[B, T, H, V]`, β
    `[B, T, H]`, g (log γ) `[B, T, H, V]`, h0 `[B, H, K, V]`; scale None: K^−½. Returns (o, S)."""
    q, k, v, beta = (np.asarray(x, np.float64) for x in (q, k, v, beta))
    B, T, H, Kd = q.shape
    g = np.zeros(v.shape) if g is None else np.asarray(g, np.float64)
    scale = Kd**-0.5 if scale is None else scale
    starts = _starts(segment_ids, B, T)
    S = np.zeros((B, H, Kd, v.shape[-1])) if h0 is None else np.array(h0, np.float64)
    o = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        for t in range(T):
            for h in range(H):
                if starts[b, t]:
                    kept = np.zeros_like(S[b, h])
                else:  # a −inf column is zeroed, even where S holds a NaN
                    gamma = np.exp(g[b, t, h])
                    kept = np.where(gamma[None, :] > 0, S[b, h] * gamma[None, :], 0.0)
                u = beta[b, t, h] * (k[b, t, h] - kept @ v[b, t, h])
                S[b, h] = kept + np.outer(u, v[b, t, h])
                o[b, t, h] = S[b, h].T @ (scale * q[b, t, h])
    return o, S


def finite_difference_grads(f, inputs, eps=1e-6):
    """∂f/∂(every entry of every input) of a scalar float64 function `f(**inputs)`, by central
    differences: a dict of arrays shaped like `inputs`."""
    inputs = {k: np.array(v, np.float64) for k, v in inputs.items()}
    grads = {}
    for name, value in inputs.items():
        g = np.zeros_like(value)
        for i in np.ndindex(value.shape):
            old = value[i]
            value[i] = old + eps
            up = f(**inputs)
            value[i] = old - eps
            down = f(**inputs)
            value[i] = old
            g[i] = (up - down) / (2 * eps)
        grads[name] = g
    return grads
