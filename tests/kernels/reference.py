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
