"""Float64 NumPy reference of the mixers' math, written from the formulas (not from the code).

Attention is computed in its quadratic form: weights A[t, s] = κ(q_t, k_s) · Π_{r=s+1..t} γ_r for
s ≤ t, o_t = Σ_s A[t, s] v_s (divided by Σ_s A[t, s] + eps when normalized), with κ the kernel
the feature map stands for (exp(q·k/√d) for softmax, 1 + s + s²/2 for taylor2, …).
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from tests.kernels.reference import (
    comba_loop,
    delta_rule_loop,
    log_linear_attention_loop,
    log_linear_delta_rule_loop,
    mesa_net_loop,
    path_attention_loop,
    rg_lru_loop,
    selective_scan_loop,
)


def params64(module) -> dict:
    """All variables of `module` as nested dicts of float64 NumPy arrays."""
    pure = nnx.to_pure_dict(nnx.state(module))

    def convert(tree):
        if isinstance(tree, dict):
            return {k: convert(v) for k, v in tree.items()}
        return np.asarray(tree, np.float64)

    return convert(pure)


def silu(x):
    return x / (1.0 + np.exp(-x))


def softplus(x):
    return np.log1p(np.exp(x))


def rms_norm(x, scale, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rotate(x_BTHD, positions, base=10000.0):
    """RoPE as complex rotation: channel pairs (i, i + D/2) are z = a + ib, rotated by p·θ_i."""
    half = x_BTHD.shape[-1] // 2
    theta = base ** (-np.arange(half) / half)
    z = x_BTHD[..., :half] + 1j * x_BTHD[..., half:]
    z = z * np.exp(1j * np.asarray(positions)[None, :, None, None] * theta)
    return np.concatenate([z.real, z.imag], axis=-1)


def causal_conv(x_BTC, kernel_KC, bias_C):
    """y_t = silu(b + Σ_j w_j x_{t−K+1+j}), zero before the sequence."""
    k = kernel_KC.shape[0]
    t = x_BTC.shape[1]
    xp = np.concatenate([np.zeros((x_BTC.shape[0], k - 1, x_BTC.shape[2])), x_BTC], axis=1)
    y = bias_C + sum(kernel_KC[j] * xp[:, j : j + t] for j in range(k))
    return silu(y)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def projected_qkv(inputs, x):
    """x W_qkv, then the short conv (with its SiLU) where the projection has one."""
    qkv = x @ inputs["qkv_proj"]["kernel"]
    if "conv" in inputs:
        qkv = causal_conv(qkv, inputs["conv"]["kernel"], inputs["conv"].get("bias", 0.0))
    return qkv


def elu_plus_one(x):
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def mixer_reference(
    name: str, mixer, x_BTD: np.ndarray, eps: float = 1e-6, feature_scale: float = 1.0
) -> np.ndarray:
    """The output of `mixer` (an NNX mixer named `name`) on `x`, in float64 (`feature_scale`:
    the `linear` mixer's c in φ(c·q)·φ(c·k))."""
    if name == "rwkv7":
        return rwkv7_reference(mixer, x_BTD)
    if name == "lstm":
        return lstm_reference(mixer, x_BTD)
    if name == "mesanet":
        return mesanet_reference(mixer, x_BTD)
    if name == "path":
        return path_reference(mixer, x_BTD)
    if name == "mamba":
        return mamba_reference(mixer, x_BTD)
    if name == "rglru":
        return rglru_reference(mixer, x_BTD)
    if name in FAMILY_REFERENCES:
        return FAMILY_REFERENCES[name](mixer, x_BTD)
    p = params64(mixer)
    x = np.asarray(x_BTD, np.float64)
    b, t, _ = x.shape
    h, dk, dv = mixer.num_heads, mixer.qk_dim, mixer.head_dim
    qkv = projected_qkv(p["inputs"], x)
    n = getattr(mixer, "num_householder", 1)  # keys and values per token (DeltaProduct)
    hv = getattr(mixer, "num_value_heads", h)  # grouped value heads
    q = qkv[..., : h * dk].reshape(b, t, h, dk)
    k = qkv[..., h * dk : (1 + n) * h * dk].reshape(b, t, h * n, dk)
    v = qkv[..., (1 + n) * h * dk :].reshape(b, t, hv, n, dv)
    if mixer.rope:
        q, k = rotate(q, np.arange(t)), rotate(k, np.arange(t))
    if name == "log_linear_mamba2":
        return output_reference(mixer, x, _log_linear_reference(p, x, q, k, v[:, :, :, 0]))
    if name in DELTA_FAMILY:
        k = k.reshape(b, t, h, n, dk)
        return output_reference(mixer, x, _delta_reference(name, mixer, p, x, q, k, v))
    v = v[:, :, :, 0]
    s_BHTS = np.einsum("bthd,bshd->bhts", q, k)
    causal = np.tril(np.ones((t, t), bool))
    log_decay_BTH = np.zeros((b, t, h))
    normalize = True
    if name in ("softmax", "swa", "fox"):  # swa: the last `window` keys only
        lag = np.arange(t)[:, None] - np.arange(t)[None, :]
        seen = causal & (lag < mixer.window) if name == "swa" else causal
        logits = np.where(seen, s_BHTS / np.sqrt(dk), -np.inf)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        eps = 0.0
        if name == "fox":  # the forget gate multiplies weight s of row t by Π_{s<l≤t} f_l
            gate = p["forget_gate"]
            log_decay_BTH = -np.logaddexp(0.0, -(x @ gate["kernel"] + gate["bias"]))
    elif name == "linear":  # elu_plus_one (the default)
        c = feature_scale
        weights = np.einsum("bthm,bshm->bhts", elu_plus_one(c * q), elu_plus_one(c * k))
    elif name == "taylor":  # taylor2 features: φ(q)·φ(k) = 1 + s + s²/2, s = q·k/√d
        s = s_BHTS / np.sqrt(dk)
        weights = 1.0 + s + s * s / 2.0
    elif name == "favor":  # φ(x) = exp(W x' − |x'|²/2)/√m, x' = x d^{-1/4}
        w = p["feature_map"]["projection"]

        def favor(z):
            z = z * dk**-0.25
            return np.exp(z @ w.T - 0.5 * np.sum(z * z, -1, keepdims=True)) / np.sqrt(w.shape[0])

        weights = np.einsum("bthm,bshm->bhts", favor(q), favor(k))
    elif name == "hedgehog":
        w = p["feature_map"]["weight"]  # [H, D, F]

        def hedgehog(z):
            zw = np.einsum("bthd,hdf->bthf", z, w)
            e_pos, e_neg = (
                np.exp(zw - zw.max(-1, keepdims=True)),
                np.exp(-zw + zw.min(-1, keepdims=True)),
            )
            return np.concatenate(
                [e_pos / e_pos.sum(-1, keepdims=True), e_neg / e_neg.sum(-1, keepdims=True)], -1
            )

        weights = np.einsum("bthm,bshm->bhts", hedgehog(q), hedgehog(k))
    elif name in ("retnet", "gated"):  # identity features, k scaled by dk^-1/2, no denominator
        weights = s_BHTS / np.sqrt(dk)
        normalize = False
        if name == "retnet":
            log_decay_BTH[:] = np.log(1.0 - 2.0 ** (-5.0 - np.arange(h)))
        else:
            z = x @ p["decay"]["proj"]["kernel"] + p["decay"]["dt_bias"]
            log_decay_BTH = -softplus(z) * np.exp(p["decay"]["a_log"])
    elif name in ("gla", "hgrn2"):  # a decay per key dimension: Σ_k q_tk k_sk Π_r γ_rk / √dk
        if name == "gla":
            gate = p["decay"]
            z = x @ gate["down"]["kernel"] @ gate["up"]["kernel"] + gate["up"]["bias"]
            log_gamma = -np.logaddexp(0.0, -z).reshape(b, t, h, dk) / 16.0  # logsigmoid / τ
        else:  # hgrn2: γ = σ(f) from the k slot, k = 1 − γ, q = silu(q)
            log_gamma = -np.logaddexp(0.0, -k)
            q, k = silu(q), 1.0 - np.exp(log_gamma)
        c_BTHK = np.cumsum(log_gamma, axis=1)
        gap_BTSHK = c_BTHK[:, :, None] - c_BTHK[:, None, :]
        decay = np.exp(np.where(causal[None, :, :, None, None], gap_BTSHK, -np.inf))
        weights = np.einsum("bthk,bshk,btshk->bhts", q, k, decay) / np.sqrt(dk)
        normalize = False
    else:
        raise ValueError(name)
    # Π_{r=s+1..t} γ_r = exp(c_t − c_s) with c the cumulative log decay
    c_BHT = np.cumsum(log_decay_BTH, axis=1).transpose(0, 2, 1)
    gap = c_BHT[..., :, None] - c_BHT[..., None, :]
    weights = np.where(causal, weights * np.exp(np.where(causal, gap, 0.0)), 0.0)
    o = np.einsum("bhts,bshd->bthd", weights, v)
    if normalize:
        o = o / (weights.sum(-1).transpose(0, 2, 1)[..., None] + eps)
    return output_reference(mixer, x, o)


def _log_linear_reference(p, x, q, k, v):
    """The `gated` mixer's decay and k·dk^-½, λ = softplus(s ⊙ (x W_λ + b_λ)) per head and
    level, and the Fenwick loop of the kernels' reference."""
    b, t, h, dk = q.shape
    z = x @ p["decay"]["proj"]["kernel"] + p["decay"]["dt_bias"]
    log_decay = -softplus(z) * np.exp(p["decay"]["a_log"])
    levels = p["levels"]
    z = (x @ levels["proj"]["kernel"] + levels["proj"]["bias"]).reshape(b, t, h, -1)
    lam = softplus(levels["scale"] * z)
    return log_linear_attention_loop(q, k / np.sqrt(dk), v, log_decay, lam)[0]


DELTA_FAMILY = ("deltanet", "gated_deltanet", "kda", "gated_deltaproduct")
DELTA_FAMILY += ("log_linear_gated_deltanet", "gdn2", "comba")


def _delta_reference(name, mixer, p, x, q, k, v):
    """silu (here unless the conv did it), L2-normalised q·dk^-½ and k, β = sigmoid(x W_β)
    (×2 with allow_neg_eigval), the decay (Mamba-2 per head for gated_deltanet and
    gated_deltaproduct, per key channel for kda); the delta-rule loop (the kernels' reference
    for one key per token and no grouping, else `delta_loop` below)."""
    b, t, h, n, dk = k.shape
    hv = v.shape[2]
    if "conv" not in p["inputs"]:
        q, k, v = silu(q), silu(k), silu(v)
    l2 = lambda z: z / np.sqrt(np.sum(z * z, -1, keepdims=True) + 1e-6)  # noqa: E731
    sigmoid = lambda z: 1.0 / (1.0 + np.exp(-z))  # noqa: E731
    if name == "comba":  # p = l2(σ(d) k); q − D σ(d) k before q's norm (FLA's layer)
        pk = sigmoid(p["inner_decay"])[:, None] * k[..., 0, :]
        if mixer.correction is not None:
            q = q - p["correction"][:, None] * pk
        pk = l2(pk)
    q, k = l2(q) / np.sqrt(dk), l2(k)
    if name == "gdn2":  # the erase gate per key channel (β's place), the write gate
        beta = sigmoid(x @ p["erase_proj"]["kernel"]).reshape(b, t, hv, dk)
        write = sigmoid(x @ p["write_proj"]["kernel"]).reshape(b, t, hv, -1)
    else:
        beta = sigmoid(x @ p["beta_proj"]["kernel"]).reshape(b, t, hv, n)
    if mixer.allow_neg_eigval:
        beta = 2.0 * beta
    log_decay = np.zeros((b, t, hv, 1))
    if name in ("gated_deltanet", "gated_deltaproduct", "log_linear_gated_deltanet", "comba"):
        z = x @ p["decay"]["proj"]["kernel"] + p["decay"]["dt_bias"]
        log_decay = (-softplus(z) * np.exp(p["decay"]["a_log"]))[..., None]
    elif name in ("kda", "gdn2"):
        d = p["decay"]
        z = (x @ d["down"]["kernel"] @ d["up"]["kernel"] + d["dt_bias"]).reshape(b, t, hv, dk)
        log_decay = -softplus(z) * np.exp(d["a_log"])[:, None]
    if name == "log_linear_gated_deltanet":  # λ = softplus(s ⊙ (x W_λ + b_λ)), the level loop
        levels = p["levels"]
        z = (x @ levels["proj"]["kernel"] + levels["proj"]["bias"]).reshape(b, t, h, -1)
        lam = softplus(levels["scale"] * z)
        args = (q, k[..., 0, :], v[..., 0, :], beta[..., 0], log_decay[..., 0], lam)
        return log_linear_delta_rule_loop(*args)[0]
    if name == "comba":  # S̃ = γ S, S ← S̃ + β k (v − S̃ᵀ p)ᵀ, q, k, p repeated to HV heads
        rep = hv // h
        qr, kr, pr = (np.repeat(z, rep, axis=2) for z in (q, k[..., 0, :], pk))
        return comba_loop(qr, kr, v[..., 0, :], pr, beta[..., 0], log_decay[..., 0], scale=1.0)[0]
    if name == "gdn2":
        rep = hv // h
        qr, kr = np.repeat(q, rep, axis=2), np.repeat(k[..., 0, :], rep, axis=2)
        return gdn2_loop(qr, kr, v[..., 0, :], log_decay, beta, write)[0]
    if n == 1 and hv == h and name != "kda":
        return delta_rule_loop(q, k[..., 0, :], v[..., 0, :], beta[..., 0], log_decay[..., 0])[0]
    return delta_loop(q, k, v, beta, log_decay)


def delta_loop(q, k, v, beta, log_decay):
    """Token by token in float64: S ← Diag(exp(a_t)) S; then for each of the n keys,
    S ← S − β k (kᵀS) + β k vᵀ; o_t = Sᵀ q_t. q `[B,T,H,K]`, k `[B,T,H,n,K]`, v `[B,T,HV,n,Dv]`,
    β `[B,T,HV,n]`, a `[B,T,HV,K or 1]`; value head j reads q/k head j // (HV/H)."""
    b, t, h, n, dk = k.shape
    hv, dv = v.shape[2], v.shape[-1]
    q, k = np.repeat(q, hv // h, axis=2), np.repeat(k, hv // h, axis=2)
    S = np.zeros((b, hv, dk, dv))
    o = np.zeros((b, t, hv, dv))
    for i in range(t):
        S = np.exp(log_decay[:, i])[..., None] * S
        for j in range(n):
            kj, bj = k[:, i, :, j], beta[:, i, :, j][..., None, None]
            S = S - bj * kj[..., :, None] * np.einsum("bhk,bhkd->bhd", kj, S)[..., None, :]
            S = S + bj * kj[..., :, None] * v[:, i, :, j][..., None, :]
        o[:, i] = np.einsum("bhk,bhkd->bhd", q[:, i], S)
    return o


def gdn2_loop(q, k, v, log_decay, erase, write, S=None):
    """GDN-2 token by token (FLA's `naive_recurrent_gdn2` with q as given), float64: S ←
    Diag(exp(g_t)) S; e = Sᵀ(b_t ⊙ k_t); S ← S + k_t (w_t ⊙ v_t − e)ᵀ; o_t = Sᵀ q_t. All
    `[B, T, H, ·]`. Returns (o, S)."""
    b, t, h, dk = k.shape
    S = np.zeros((b, h, dk, v.shape[-1])) if S is None else np.array(S, np.float64)
    o = np.zeros(v.shape)
    for i in range(t):
        S = np.exp(log_decay[:, i])[..., None] * S
        e = np.einsum("bhk,bhkd->bhd", erase[:, i] * k[:, i], S)
        S = S + k[:, i, :, :, None] * (write[:, i] * v[:, i] - e)[..., None, :]
        o[:, i] = np.einsum("bhk,bhkd->bhd", q[:, i], S)
    return o, S


def output_reference(mixer, x_BTD, o_BTHD) -> np.ndarray:
    """The mixer's output layers (per-head norm, or one scale shared by the heads, with the
    norm's eps; gate, with or without its bias; projection) on `o`, in float64."""
    p = params64(mixer)["output"]
    x, o = np.asarray(x_BTD, np.float64), np.asarray(o_BTHD, np.float64)
    b, t, h, dv = o.shape
    if "norm" in p:  # (over groups of heads: hgrn2's one group of all channels)
        g, scale = mixer.output.norm_groups, p["norm"]["scale"]
        if g != h:
            o, scale = o.reshape(b, t, g, h * dv // g), scale.reshape(g, -1)
        o = rms_norm(o, scale, eps=mixer.output.norm.eps)
    o = o.reshape(b, t, h * dv)
    if "gate_up" in p:  # the low-rank sigmoid gate of the gated RMSNorm (kda)
        up = p["gate_up"]
        z = x @ p["gate_proj"]["kernel"] @ up["kernel"] + up.get("bias", 0.0)
        o = o / (1.0 + np.exp(-z))
    elif "gate_proj" in p:  # swish, or lightning's sigmoid
        z = x @ p["gate_proj"]["kernel"]
        o = o * (silu(z) if mixer.output.gate_activation == "silu" else 1.0 / (1.0 + np.exp(-z)))
    return o @ p["out_proj"]["kernel"]


def path_reference(mixer, x_BTD) -> np.ndarray:
    """PaTH attention's layer from its formulas, in float64: q, k, v from the projection (rotary
    at 0, 1, …), w = l2norm(silu(conv(x W_w↓ W_w↑))) per head, β = 2·sigmoid(x W_β + b), the
    optional log sigmoid forget gate, `path_attention_loop` at scale 1/√Dk, the output layers."""
    p = params64(mixer)
    x = np.asarray(x_BTD, np.float64)
    b, t, _ = x.shape
    h, dk, dv = mixer.num_heads, mixer.qk_dim, mixer.head_dim
    inputs = p["inputs"]
    qkv = x @ inputs["qkv"]["qkv_proj"]["kernel"]
    q, k = (
        qkv[..., : h * dk].reshape(b, t, h, dk),
        qkv[..., h * dk : 2 * h * dk].reshape(b, t, h, dk),
    )
    v = qkv[..., 2 * h * dk :].reshape(b, t, h, dv)
    if mixer.rope:
        q, k = rotate(q, np.arange(t)), rotate(k, np.arange(t))
    w = x @ inputs["w_down"]["kernel"] @ inputs["w_up"]["kernel"]
    if "conv" in inputs:
        w = causal_conv(w, inputs["conv"]["kernel"], inputs["conv"]["bias"])
    w = w.reshape(b, t, h, dk)
    w = w / np.sqrt(np.sum(w * w, axis=-1, keepdims=True) + 1e-6)
    beta = 2.0 / (1.0 + np.exp(-(x @ p["beta_proj"]["kernel"] + p["beta_proj"]["bias"])))
    log_f = None
    if "forget_gate" in p:
        gate = p["forget_gate"]
        log_f = -np.logaddexp(0.0, -(x @ gate["kernel"] + gate["bias"]))
    o = path_attention_loop(q, k, v, w, beta, log_f, scale=dk**-0.5)
    return output_reference(mixer, x, o)


def rwkv7_reference(mixer, x_BTD) -> np.ndarray:
    """RWKV-7's time mixing as its paper and BlinkDL's x070 write it, in float64: the state in
    their orientation S [Dv, K], S_t = S_{t−1} Diag(w_t) + (S_{t−1} a_t) b_tᵀ + v_t k_tᵀ with
    w = exp(−exp(ω)), ω = −softplus(−(w₀ + tanh(x_w W₁) W₂)) − ½, a = −κ̂, b = κ̂·a; y_t = S_t r_t;
    GroupNorm per head (eps 64e-5), the bonus, the gate sigmoid(x_g G₁) G₂, the output matrix."""
    p = params64(mixer)
    x = np.asarray(x_BTD, np.float64)
    b, t, _ = x.shape
    h, dk, dv = mixer.num_heads, mixer.qk_dim, mixer.head_dim
    sigmoid = lambda z: 1.0 / (1.0 + np.exp(-z))  # noqa: E731
    previous = np.concatenate([np.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
    x_r, x_w, x_k, x_v, x_a, x_g = (x + (previous - x) * mu for mu in p["inputs"]["mu"])
    r = (x_r @ p["receptance"]["kernel"]).reshape(b, t, h, dk)
    k = (x_k @ p["key"]["kernel"]).reshape(b, t, h, dk)
    v = (x_v @ p["value"]["kernel"]).reshape(b, t, h, dv)
    lora = p["decay"]["lora"]
    z = np.tanh(x_w @ lora["down"]["kernel"]) @ lora["up"]["kernel"] + lora["up"]["bias"]
    w = np.exp(-np.exp(-softplus(-z) - 0.5)).reshape(b, t, h, dk)
    rate = p["rate"]
    a = sigmoid(x_a @ rate["down"]["kernel"] @ rate["up"]["kernel"] + rate["up"]["bias"])
    a = a.reshape(b, t, h, dk)
    kk = k * p["k_k"]
    kk = kk / np.sqrt(np.sum(kk * kk, -1, keepdims=True) + 1e-6)  # the delta mixers' l2norm
    k = k * (1.0 + (a - 1.0) * p["k_a"])
    S = np.zeros((b, h, dv, dk))
    o = np.zeros((b, t, h, dv))
    for i in range(t):
        sa = np.einsum("bhvk,bhk->bhv", S, -kk[:, i])
        S = (
            S * w[:, i, :, None, :]
            + sa[..., :, None] * (kk[:, i] * a[:, i])[..., None, :]
            + v[:, i, :, :, None] * k[:, i, :, None, :]
        )
        o[:, i] = np.einsum("bhvk,bhk->bhv", S, r[:, i])
    out = p["output"]
    if "norm" in out:
        centred = o - o.mean(-1, keepdims=True)
        o = centred / np.sqrt(np.mean(centred**2, -1, keepdims=True) + 64e-5)
        o = o * out["norm"]["scale"] + out["norm"]["bias"]
    o = o + np.sum(r * k * p["r_k"], -1, keepdims=True) * v
    o = o.reshape(b, t, h * dv)
    if "gate_proj" in out:
        o = o * (sigmoid(x_g @ out["gate_proj"]["kernel"]) @ out["gate_up"]["kernel"])
    return o @ out["out_proj"]["kernel"]


def lstm_loop(mixer, x_BTD, h0=None, c0=None):
    """The LSTM token by token in float64, one cell per head in PyTorch's gate order (i, f,
    g, o): z = x W + b + h_{t−1} R_head, c = σ(f) c + σ(i) tanh(g), h = σ(o) tanh(c).
    `h0`, `c0` `[B, H, Dh]`: the state before the first token (zeros if None). Returns
    `(h [B, T, H, Dh] per token, final h, final c)`."""
    p = params64(mixer)
    x = np.asarray(x_BTD, np.float64)
    b, t, _ = x.shape
    h, d = mixer.num_heads, mixer.head_dim
    sigmoid = lambda z: 1.0 / (1.0 + np.exp(-z))  # noqa: E731
    proj = p["inputs"]["proj"]
    z_in = (x @ proj["kernel"] + proj["bias"]).reshape(b, t, h, 4, d)
    r = p["recurrent"]  # [H, Dh, 4·Dh]
    hid = np.zeros((b, h, d)) if h0 is None else np.array(h0, np.float64)
    cell = np.zeros((b, h, d)) if c0 is None else np.array(c0, np.float64)
    out = np.zeros((b, t, h, d))
    for i in range(t):
        for j in range(h):
            z = z_in[:, i, j] + (hid[:, j] @ r[j]).reshape(b, 4, d)
            gate_i, gate_f, gate_o = sigmoid(z[:, 0]), sigmoid(z[:, 1]), sigmoid(z[:, 3])
            cell[:, j] = gate_f * cell[:, j] + gate_i * np.tanh(z[:, 2])
            hid[:, j] = gate_o * np.tanh(cell[:, j])
        out[:, i] = hid
    return out, hid, cell


def lstm_reference(mixer, x_BTD, h0=None, c0=None) -> np.ndarray:
    """The lstm mixer's output in float64: `lstm_loop`, then the output layers."""
    return output_reference(mixer, x_BTD, lstm_loop(mixer, x_BTD, h0, c0)[0])


def mesanet_reference(mixer, x_BTD) -> np.ndarray:
    """MesaNet as FLA's layer writes it, in float64: q, k = silu(conv(x W_q)), silu(conv(x W_k))
    (silu alone without conv), v = x W_v; q, k L2-normalised; log γ = logsigmoid(x w_a + b_a),
    β = sigmoid(x w_b + b_b), λ = softplus(p) + 0.25; `mesa_net_loop` (an exact solve); the
    output layers."""
    p = params64(mixer)
    x = np.asarray(x_BTD, np.float64)
    b, t, _ = x.shape
    h, dk, dv = mixer.num_heads, mixer.qk_dim, mixer.head_dim
    qk_in = p["inputs"]["qk"]
    qk = x @ qk_in["qkv_proj"]["kernel"]
    qk = (
        causal_conv(qk, qk_in["conv"]["kernel"], qk_in["conv"]["bias"])
        if "conv" in qk_in
        else silu(qk)
    )
    q, k = qk[..., : h * dk].reshape(b, t, h, dk), qk[..., h * dk :].reshape(b, t, h, dk)
    if mixer.rope:
        q, k = rotate(q, np.arange(t)), rotate(k, np.arange(t))
    v = (x @ p["inputs"]["v_proj"]["kernel"]).reshape(b, t, h, dv)
    l2 = lambda z: z / np.sqrt(np.sum(z * z, -1, keepdims=True) + 1e-6)  # noqa: E731
    log_decay = -np.logaddexp(0.0, -(x @ p["decay_proj"]["kernel"] + p["decay_proj"]["bias"]))
    beta = 1.0 / (1.0 + np.exp(-(x @ p["beta_proj"]["kernel"] + p["beta_proj"]["bias"])))
    lam = softplus(p["lambda_param"]) + 0.25
    o = mesa_net_loop(l2(q), l2(k), v, log_decay, beta, lam)[0]
    return output_reference(mixer, x, o)


def mamba_reference(mixer, x_BTD) -> np.ndarray:
    """Mamba-1's block: x, z = x W_in; x = silu(conv(x)); δ, B, C = x W_x (each divided by
    its RMS with `bcdt_norm_eps`); Δ = softplus(δ W_dt + b_dt); the selective scan with
    A = −exp(A_log) and the skip D; (y ⊙ silu(z)) W_out."""
    p = params64(mixer)
    x = np.asarray(x_BTD, np.float64)
    e, r, n = mixer.channels, mixer.dt_rank, mixer.state_size
    xz = x @ p["inputs"]["in_proj"]["kernel"]
    conv = p["inputs"]["conv1d"]
    u = causal_conv(xz[..., :e], conv["kernel"], conv.get("bias", 0.0))
    low, b, c = np.split(u @ p["x_proj"]["kernel"], [r, r + n], axis=-1)
    if mixer.bcdt_norm_eps is not None:  # Falcon-Mamba's weightless RMSNorms
        low, b, c = (
            t / np.sqrt(np.mean(t * t, axis=-1, keepdims=True) + mixer.bcdt_norm_eps)
            for t in (low, b, c)
        )
    delta = softplus(low @ p["dt_proj"]["kernel"] + p["dt_proj"]["bias"])
    y, _ = selective_scan_loop(u, delta, -np.exp(p["A_log"]), b, c, p["D"])
    return (y * silu(xz[..., e:])) @ p["out_proj"]["kernel"]


def rglru_reference(mixer, x_BTD) -> np.ndarray:
    """Griffin's recurrent block: gelu(x W_y + b_y) ⊙ RG-LRU(conv(x W_x + b_x)), then W_out;
    the RG-LRU's gates block-diagonal over the heads, log a = −8 r softplus(Λ), the first
    token a reset (written unscaled)."""
    p = params64(mixer)
    x = np.asarray(x_BTD, np.float64)
    b, t, _ = x.shape
    inputs = p["inputs"]
    y = gelu_tanh(x @ inputs["linear_y"]["kernel"] + inputs["linear_y"]["bias"])
    u = x @ inputs["linear_x"]["kernel"] + inputs["linear_x"]["bias"]
    k = inputs["conv_1d"]["kernel"].shape[0]
    up = np.concatenate([np.zeros((b, k - 1, u.shape[2])), u], axis=1)
    u = inputs["conv_1d"]["bias"] + sum(
        inputs["conv_1d"]["kernel"][j] * up[:, j : j + t] for j in range(k)
    )
    u_BTHC = u.reshape(b, t, mixer.num_heads, -1)

    def gate(name):
        z = np.einsum("bthc,hcd->bthd", u_BTHC, p[f"{name}_weight"]) + p[f"{name}_bias"]
        return sigmoid(z).reshape(u.shape)

    log_a = -8.0 * gate("recurrent_gate") * softplus(p["recurrent_param"])
    log_a[:, 0] = -np.inf  # position 0: a reset, a = 0 and the input unscaled
    h, _ = rg_lru_loop(gate("input_gate") * u, log_a)
    return (h * y) @ p["out_proj"]["kernel"] + p["out_proj"]["bias"]


def rwkv6_loop(r, k, v, w, u, S=None):
    """RWKV-6's recurrence token by token (FLA's `naive_recurrent_rwkv6` at scale 1), float64:
    o_t = S_{t−1}ᵀ r_t + (Σ_K r_t ⊙ u ⊙ k_t) v_t, then S_t = Diag(w_t) S_{t−1} + k_t v_tᵀ;
    w is the decay itself (not its log). Returns (o [B, T, H, Dv], S [B, H, K, Dv])."""
    b, t, h, dk = k.shape
    S = np.zeros((b, h, dk, v.shape[-1])) if S is None else np.array(S, np.float64)
    o = np.zeros(v.shape)
    for i in range(t):
        kv = k[:, i, :, :, None] * v[:, i, :, None, :]
        o[:, i] = np.einsum("bhk,bhkd->bhd", r[:, i], S + u[None, :, :, None] * kv)
        S = S * w[:, i, :, :, None] + kv
    return o, S


def rwkv6_reference(mixer, x_BTD) -> np.ndarray:
    """RWKV-6's time mixing from its formulas (x060 with a static token-shift interpolation),
    float64: r, k, v from the shifted inputs, w = exp(−exp(w₀ + tanh(x_w W₁) W₂)), `rwkv6_loop`,
    GroupNorm per head (eps 64e-5), the gate silu(x_g W_g), the output matrix."""
    p = params64(mixer)
    x = np.asarray(x_BTD, np.float64)
    b, t, _ = x.shape
    h, dk, dv = mixer.num_heads, mixer.qk_dim, mixer.head_dim
    previous = np.concatenate([np.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
    x_r, x_w, x_k, x_v, x_g = (x + (previous - x) * mu for mu in p["inputs"]["mu"])
    r = (x_r @ p["receptance"]["kernel"]).reshape(b, t, h, dk)
    k = (x_k @ p["key"]["kernel"]).reshape(b, t, h, dk)
    v = (x_v @ p["value"]["kernel"]).reshape(b, t, h, dv)
    lora = p["decay"]
    z = np.tanh(x_w @ lora["down"]["kernel"]) @ lora["up"]["kernel"] + lora["up"]["bias"]
    w = np.exp(-np.exp(z)).reshape(b, t, h, dk)
    o, _ = rwkv6_loop(r, k, v, w, p["bonus"])
    out = p["output"]
    if "norm" in out:
        centred = o - o.mean(-1, keepdims=True)
        o = centred / np.sqrt(np.mean(centred**2, -1, keepdims=True) + 64e-5)
        o = o * out["norm"]["scale"] + out["norm"]["bias"]
    o = o.reshape(b, t, h * dv)
    if "gate_proj" in out:
        o = o * silu(x_g @ out["gate_proj"]["kernel"])
    return o @ out["out_proj"]["kernel"]


def lightning_loop(q, k, v, slopes, S=None):
    """MiniMax's lightning recurrence token by token (its decoding loop), float64:
    S_t = e^(−s_h) S_{t−1} + k_t v_tᵀ, o_t = S_tᵀ q_t. Returns (o, S)."""
    b, t, h, dk = k.shape
    S = np.zeros((b, h, dk, v.shape[-1])) if S is None else np.array(S, np.float64)
    o = np.zeros(v.shape)
    for i in range(t):
        S = np.exp(-slopes)[:, None, None] * S + k[:, i, :, :, None] * v[:, i, :, None, :]
        o[:, i] = np.einsum("bhk,bhkd->bhd", q[:, i], S)
    return o, S


def lightning_reference(mixer, x_BTD) -> np.ndarray:
    """MiniMax's lightning attention layer from its formulas, float64: q, k, v = silu(x W_qkv)
    (columns all q, all k, all v), `lightning_loop` with the layer's slopes, then the output
    layers (RMSNorm over all H·Dv channels, the sigmoid gate, the output matrix)."""
    p = params64(mixer)
    x = np.asarray(x_BTD, np.float64)
    b, t, _ = x.shape
    h, dk, dv = mixer.num_heads, mixer.qk_dim, mixer.head_dim
    qkv = silu(x @ p["inputs"]["qkv"]["qkv_proj"]["kernel"])
    q, k = (
        qkv[..., : h * dk].reshape(b, t, h, dk),
        qkv[..., h * dk : 2 * h * dk].reshape(b, t, h, dk),
    )
    v = qkv[..., 2 * h * dk :].reshape(b, t, h, dv)
    o, _ = lightning_loop(q, k, v, p["decay"]["slope"])
    return output_reference(mixer, x, o)


def mlstm_loop(q, k, v, i_pre, f_pre, C=None, n=None, m=None, eps=1e-6):
    """xLSTM's stabilised mLSTM cell token by token (the equations of its recurrent step),
    float64: m_t = max(log σ(f_t) + m_{t−1}, i_t), f' = e^{log σ(f_t) + m_{t−1} − m_t},
    i' = e^{i_t − m_t}, C_t = f' C_{t−1} + i' k vᵀ, n_t = f' n_{t−1} + i' k, q̂ = q/√Dk,
    h_t = q̂ᵀC_t / (max(|q̂ᵀn_t|, e^{−m_t}) + eps). Returns (h, (C, n, m))."""
    b, t, h, dk = k.shape
    C = np.zeros((b, h, dk, v.shape[-1])) if C is None else np.array(C, np.float64)
    n = np.zeros((b, h, dk)) if n is None else np.array(n, np.float64)
    m = np.zeros((b, h)) if m is None else np.array(m, np.float64)
    out = np.zeros(v.shape)
    for s in range(t):
        log_f = -np.logaddexp(0.0, -f_pre[:, s])
        m_new = np.maximum(log_f + m, i_pre[:, s])
        f_act, i_act = np.exp(log_f + m - m_new), np.exp(i_pre[:, s] - m_new)
        C = f_act[..., None, None] * C + i_act[..., None, None] * (
            k[:, s, :, :, None] * v[:, s, :, None, :]
        )
        n = f_act[..., None] * n + i_act[..., None] * k[:, s]
        m = m_new
        q_hat = q[:, s] / np.sqrt(dk)
        num = np.einsum("bhk,bhkd->bhd", q_hat, C)
        den = np.maximum(np.abs(np.einsum("bhk,bhk->bh", q_hat, n)), np.exp(-m)) + eps
        out[:, s] = num / den[..., None]
    return out, (C, n, m)


def mlstm_reference(mixer, x_BTD) -> np.ndarray:
    """xLSTM's mLSTM layer from its formulas, float64: q, k, v from the projection (its conv if
    any), the gates c·tanh((x W + b)/c) with c = 15, `mlstm_loop`, the per-head LayerNorm
    (eps 1e-6), the sigmoid output gate, the output matrix."""
    p = params64(mixer)
    x = np.asarray(x_BTD, np.float64)
    b, t, _ = x.shape
    h, dk, dv = mixer.num_heads, mixer.qk_dim, mixer.head_dim
    qkv = projected_qkv(p["inputs"], x)
    q, k = (
        qkv[..., : h * dk].reshape(b, t, h, dk),
        qkv[..., h * dk : 2 * h * dk].reshape(b, t, h, dk),
    )
    v = qkv[..., 2 * h * dk :].reshape(b, t, h, dv)
    i_pre, f_pre = (
        15.0 * np.tanh((x @ p[g]["kernel"] + p[g]["bias"]) / 15.0) for g in ("igate", "fgate")
    )
    o, _ = mlstm_loop(q, k, v, i_pre, f_pre)
    out = p["output"]
    centred = o - o.mean(-1, keepdims=True)
    o = centred / np.sqrt(np.mean(centred**2, -1, keepdims=True) + 1e-6)
    o = (o * out["norm"]["scale"] + out["norm"]["bias"]).reshape(b, t, h * dv)
    if "gate_proj" in out:
        o = o / (1.0 + np.exp(-(x @ out["gate_proj"]["kernel"])))
    return o @ out["out_proj"]["kernel"]


# The mixers of issue 69's families whose reference is a function of their own.
FAMILY_REFERENCES = {
    "rwkv6": rwkv6_reference,
    "lightning": lightning_reference,
    "mlstm": mlstm_reference,
}
