"""Issue 69's families over existing kernels: each mixer's mapping onto its kernel against a
float64 NumPy loop of the family's own recurrence (tiny shapes, every method, from a state)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from linear_attention import kernels as K
from linear_attention.layers.gdn2 import gdn2_attention, gdn2_step
from linear_attention.layers.lightning import lightning_slopes
from linear_attention.layers.linear import hgrn2_terms
from linear_attention.layers.mlstm import MLSTMState, mlstm_attention, mlstm_step, soft_cap
from linear_attention.layers.rwkv6 import rwkv6_attention
from linear_attention.layers.segments import segments_of
from tests.layers.numpy_reference import gdn2_loop, lightning_loop, mlstm_loop, rwkv6_loop, silu

B, T, H, DK, DV = 2, 7, 2, 3, 4


def _draws(seed: int, *shapes):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


@pytest.mark.parametrize("method", ["chunk", "scan"])  # (the kernel's own tests cover the rest)
def test_rwkv6_attention_is_the_rwkv6_recurrence(method):
    """From a random state, chunks of 3 across 7 tokens: outputs and the final state; and on
    packed rows each document alone from zeros."""
    r, k, v, z, u, s0 = _draws(0, *[(B, T, H, DK)] * 2, (B, T, H, DV), (B, T, H, DK), (H, DK),
                               (B, H, DK, DV))  # fmt: skip
    log_w = -np.exp(z)
    run = jax.jit(rwkv6_attention, static_argnames=("method", "chunk_size"))
    state = K.LinearAttentionState(kv=s0, k_sum=None)
    o, s = run(r, k, v, log_w, u, method=method, chunk_size=3, initial_state=state)
    o64, s64 = rwkv6_loop(*(x.astype(np.float64) for x in (r, k, v, np.exp(log_w), u)), S=s0)
    np.testing.assert_allclose(o, o64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.kv, s64, rtol=1e-5, atol=1e-5)
    ids = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 2, 2]])
    packed = run(r, k, v, log_w, u, method=method, chunk_size=3, segments=segments_of(ids, B, T))
    for row in range(B):
        for doc in np.unique(ids[row]):
            at = ids[row] == doc
            one = [x[row : row + 1, at].astype(np.float64) for x in (r, k, v, np.exp(log_w))]
            alone = rwkv6_loop(*one, u.astype(np.float64))[0]
            np.testing.assert_allclose(packed[row, at], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the Pallas kernel interpreted: ~3.5 s
def test_rwkv6_attention_pallas_is_the_rwkv6_recurrence():
    """method="pallas" (the TPU kernel, interpreted): 16 tokens from a random state."""
    t = 16
    r, k, v, z, u, s0 = _draws(1, *[(1, t, H, DK)] * 2, (1, t, H, DV), (1, t, H, DK), (H, DK),
                               (1, H, DK, DV))  # fmt: skip
    log_w = -np.exp(z)
    state = K.LinearAttentionState(kv=s0, k_sum=None)
    with K.pallas_interpret():
        o, s = rwkv6_attention(r, k, v, log_w, u, method="pallas", chunk_size=16,
                               initial_state=state)  # fmt: skip
    o64, s64 = rwkv6_loop(*(x.astype(np.float64) for x in (r, k, v, np.exp(log_w), u)), S=s0)
    np.testing.assert_allclose(o, o64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.kv, s64, rtol=1e-5, atol=1e-5)


def hgrn2_loop(q, f, i, S):
    """HGRN2's recurrence in float64: γ_t = σ(f_t), S_t = Diag(γ_t) S_{t−1} + (1 − γ_t) i_tᵀ,
    o_t = S_tᵀ silu(q_t) / √K."""
    S = np.array(S, np.float64)
    o = np.zeros(i.shape)
    for t in range(q.shape[1]):
        g = 1.0 / (1.0 + np.exp(-f[:, t]))
        S = g[..., None] * S + (1.0 - g)[..., None] * i[:, t, :, None, :]
        o[:, t] = np.einsum("bhk,bhkd->bhd", silu(q[:, t]), S) / np.sqrt(q.shape[-1])
    return o, S


@pytest.mark.parametrize("method", ["chunk", "scan"])  # (the kernel's own tests cover the rest)
def test_hgrn2_terms_on_the_linear_kernel_are_the_hgrn2_recurrence(method):
    q, f, i, s0 = _draws(2, (B, T, H, DK), (B, T, H, DK), (B, T, H, DV), (B, H, DK, DV))
    phi_q, phi_k, log_g = hgrn2_terms(q, 2.0 * f, DK)
    o, s = K.causal_linear_attention(
        phi_q, phi_k, i, log_decay=log_g, normalize=False, method=method, chunk_size=3,
        initial_state=K.LinearAttentionState(kv=s0, k_sum=None), return_state=True,
    )  # fmt: skip
    o64, s64 = hgrn2_loop(*(x.astype(np.float64) for x in (q, 2.0 * f, i)), s0)
    np.testing.assert_allclose(o, o64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.kv, s64, rtol=1e-5, atol=1e-5)


def test_lightning_slopes_are_minimaxs():
    """2^(−8(h+1)/H)·(1 − depth + 1e-5), by hand for H = 4 at the first and a middle layer."""
    np.testing.assert_allclose(lightning_slopes(4, 0.0), [0.25, 1 / 16, 1 / 64, 1 / 256], rtol=2e-5)
    np.testing.assert_allclose(lightning_slopes(2, 0.5), [0.0625 * 0.50001, 0.00390625 * 0.50001])


@pytest.mark.parametrize("method", ["chunk", "scan"])  # (the kernel's own tests cover the rest)
def test_lightning_on_the_linear_kernel_is_minimaxs_recurrence(method):
    """The mixer's kernel call (a [H] log decay −s, no denominator) from a state against
    MiniMax's decoding loop in float64, at slopes of the first layer (the fastest decays)."""
    q, k, v, s0 = _draws(3, (B, T, H, DK), (B, T, H, DK), (B, T, H, DV), (B, H, DK, DV))
    slopes = lightning_slopes(H, 0.0)
    o, s = K.causal_linear_attention(
        q, k, v, log_decay=-slopes.astype(np.float32), normalize=False, method=method,
        chunk_size=3, initial_state=K.LinearAttentionState(kv=s0, k_sum=None), return_state=True,
    )  # fmt: skip
    o64, s64 = lightning_loop(*(x.astype(np.float64) for x in (q, k, v)), slopes, S=s0)
    np.testing.assert_allclose(o, o64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.kv, s64, rtol=1e-5, atol=1e-5)


@pytest.mark.hf
def test_lightning_is_transformers_minimax_lightning_attention():
    """transformers' `MiniMaxLightningAttention` (layer 1 of 3, blocks of 4 over 11 tokens) with
    the mixer's weights (its fused q/k/v columns interleaved per head) gives the mixer's output
    at that layer's slopes."""
    torch = pytest.importorskip("torch")
    minimax = pytest.importorskip("transformers.models.minimax.modeling_minimax")
    from flax import nnx

    from linear_attention.layers import get_mixer

    d, h, t = 16, 2, 11
    config = minimax.MiniMaxConfig(
        hidden_size=d, num_attention_heads=h, head_dim=d // h, num_hidden_layers=3,
        block_size=4, intermediate_size=32, num_local_experts=2, num_key_value_heads=h,
        vocab_size=32,
    )  # fmt: skip
    theirs = minimax.MiniMaxLightningAttention(config, layer_idx=1).double()
    mixer = get_mixer("lightning")(d, h, rngs=nnx.Rngs(0))
    mixer.decay.slope[...] = theirs.slope_rate.reshape(h).float().numpy()
    out = mixer.output
    w = {n: np.asarray(a[...], np.float64) for n, a in (
        ("qkv", mixer.inputs.qkv.qkv_proj.kernel), ("gate", out.gate_proj.kernel),
        ("out", out.out_proj.kernel), ("norm", out.norm.scale),
    )}  # fmt: skip
    per_head = w["qkv"].T.reshape(3, h, d // h, d).transpose(1, 0, 2, 3).reshape(3 * d, d)
    with torch.no_grad():
        theirs.qkv_proj.weight.copy_(torch.from_numpy(per_head))
        theirs.output_gate.weight.copy_(torch.from_numpy(w["gate"].T))
        theirs.out_proj.weight.copy_(torch.from_numpy(w["out"].T))
        theirs.norm.weight.copy_(torch.from_numpy(w["norm"].reshape(-1)))
        x = np.random.default_rng(4).standard_normal((B, t, d))
        y, _ = theirs(torch.from_numpy(x), None, None)
    np.testing.assert_allclose(mixer(x.astype(np.float32)), y.numpy(), rtol=1e-5, atol=1e-5)


def _mlstm_inputs(seed: int, t: int = T):
    """q, k, v and soft-capped gates spread wide (ĩ over about ±15: the stabiliser at work),
    and a stabilised state (C̃, ñ, m) as xLSTM keeps it."""
    q, k, v, i, f, c0, n0 = _draws(seed, (B, t, H, DK), (B, t, H, DK), (B, t, H, DV), (B, t, H),
                                   (B, t, H), (B, H, DK, DV), (B, H, DK))  # fmt: skip
    i, f = (np.asarray(soft_cap(8.0 * i)), np.asarray(soft_cap(3.0 * f)))
    return (q, k, v, i, f), (c0, n0, np.array([[2.0, -1.0], [0.5, 6.0]], np.float32))


@pytest.mark.parametrize("method", ["chunk", "scan"])  # (the kernel's own tests cover the rest)
def test_mlstm_attention_is_xlstms_stabilised_cell(method):
    """From xLSTM's stabilised state (C̃, ñ, m) = (C, n)·e^{−m}: outputs and the final state;
    on packed rows each document alone from zeros."""
    (q, k, v, i, f), (c0, n0, m0) = _mlstm_inputs(5)
    scale = np.exp(m0)[..., None]
    kv = np.concatenate([c0, n0[..., None]], axis=-1) * scale[..., None]
    state = MLSTMState(K.LinearAttentionState(kv=kv, k_sum=None), m0)
    run = jax.jit(mlstm_attention, static_argnames=("method", "chunk_size"))
    o, s = run(q, k, v, i, f, method=method, chunk_size=3, initial_state=state)
    f64 = [x.astype(np.float64) for x in (q, k, v, i, f)]
    o64, (c64, n64, m64) = mlstm_loop(*f64, C=c0, n=n0, m=m0)
    np.testing.assert_allclose(o, o64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.m, m64, rtol=1e-6, atol=1e-6)
    back = np.exp(-np.asarray(s.m, np.float64))[..., None, None]
    np.testing.assert_allclose(s.kv.kv[..., :-1] * back, c64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.kv.kv[..., -1] * back[..., 0], n64, rtol=1e-5, atol=1e-5)
    step_o, _ = mlstm_step(state, *(x[:, 0] for x in (q, k, v, i, f)))
    np.testing.assert_allclose(step_o, mlstm_loop(*(x[:, :1] for x in f64), c0, n0, m0)[0][:, 0],
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    ids = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 2, 2]])
    packed = run(q, k, v, i, f, method=method, chunk_size=3, segments=segments_of(ids, B, T))
    for row in range(B):
        for doc in np.unique(ids[row]):
            at = ids[row] == doc
            alone = mlstm_loop(*(x[row : row + 1, at] for x in f64))[0]
            np.testing.assert_allclose(packed[row, at], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.hf
def test_mlstm_is_transformers_xlstm_layer():
    """transformers' `xLSTMLayer` (weight_mode "single", no biases, float32 kernels, chunks of 4
    over 11 tokens) with the mixer's weights and gate biases drawn at random gives the mixer's
    output."""
    torch = pytest.importorskip("torch")
    xlstm = pytest.importorskip("transformers.models.xlstm.modeling_xlstm")
    from flax import nnx

    from linear_attention.layers import get_mixer

    d, h, t = 16, 2, 11
    config = xlstm.xLSTMConfig(
        hidden_size=d, num_heads=h, chunk_size=4, autocast_kernel_dtype="float32", vocab_size=32
    )
    theirs = xlstm.xLSTMLayer(config)
    mixer = get_mixer("mlstm")(d, h, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(6)
    for gate in (mixer.igate, mixer.fgate):  # (zero weights at init: draw some)
        gate.kernel[...] = rng.standard_normal(gate.kernel.shape).astype(np.float32)
        gate.bias[...] = rng.standard_normal(h).astype(np.float32)
    qkv = np.asarray(mixer.inputs.qkv_proj.kernel[...])
    dk = mixer.qk_dim * h
    out = mixer.output
    pairs = (
        (theirs.q, qkv[:, :dk]), (theirs.k, qkv[:, dk : 2 * dk]), (theirs.v, qkv[:, 2 * dk :]),
        (theirs.ogate_preact, out.gate_proj.kernel), (theirs.out_proj, out.out_proj.kernel),
        (theirs.igate_preact, mixer.igate.kernel), (theirs.fgate_preact, mixer.fgate.kernel),
    )  # fmt: skip
    copy = lambda a: torch.from_numpy(np.array(a[...]))  # noqa: E731
    with torch.no_grad():
        for linear, kernel in pairs:
            linear.weight.copy_(copy(kernel).T)
        theirs.igate_preact.bias.copy_(copy(mixer.igate.bias))
        theirs.fgate_preact.bias.copy_(copy(mixer.fgate.bias))
        theirs.multihead_norm.weight.copy_(copy(out.norm.scale).ravel())
        x = rng.standard_normal((B, t, d)).astype(np.float32)
        y, _ = theirs(torch.from_numpy(x))
    np.testing.assert_allclose(mixer(x), y.numpy(), rtol=1e-4, atol=1e-5)


def _gdn2_inputs(seed: int, t: int = T):
    """Unit q, k (as the layer gives them), decays, erase gates in (0, 2), write gates, a state."""
    keys, values = (B, t, H, DK), (B, t, H, DV)
    q, k, v, z, e, w, s0 = _draws(seed, keys, keys, values, keys, keys, values, (B, H, DK, DV))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    log_g = -np.logaddexp(0.0, z).astype(np.float32)
    erase, write = (2.0 / (1.0 + np.exp(-e))).astype(np.float32), 1.0 / (1.0 + np.exp(-w))
    return (q, k, v, log_g, erase, write.astype(np.float32)), s0


@pytest.mark.parametrize("method", K.DPLR.supported[:2])  # (chunk, scan; pallas: -m slow)
def test_gdn2_attention_is_the_gdn2_recurrence(method):
    """From a random state, chunks of 3: outputs, final state and one step; on packed rows
    each document alone from zeros."""
    args, s0 = _gdn2_inputs(7)
    f64 = [x.astype(np.float64) for x in args]
    state = K.LinearAttentionState(kv=s0, k_sum=None)
    run = jax.jit(gdn2_attention, static_argnames=("method", "chunk_size"))
    o, s = run(*args, method=method, chunk_size=3, initial_state=state)
    o64, s64 = gdn2_loop(*f64, S=s0)
    np.testing.assert_allclose(o, o64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.kv, s64, rtol=1e-5, atol=1e-5)
    step_o, _ = gdn2_step(state, *(x[:, 0] for x in args))
    first = gdn2_loop(*(x[:, :1] for x in f64), S=s0)[0][:, 0]
    np.testing.assert_allclose(step_o, first, rtol=1e-5, atol=1e-5)
    ids = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 2, 2]])
    packed = run(*args, method=method, chunk_size=3, segments=segments_of(ids, B, T))
    for row in range(B):
        for doc in np.unique(ids[row]):
            at = ids[row] == doc
            alone = gdn2_loop(*(x[row : row + 1, at] for x in f64))[0]
            np.testing.assert_allclose(packed[row, at], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the Pallas kernels interpreted
def test_gdn2_attention_pallas_is_the_gdn2_recurrence():
    args, s0 = _gdn2_inputs(8, t=16)
    with K.pallas_interpret():
        o, s = gdn2_attention(*args, method="pallas", chunk_size=16,
                              initial_state=K.LinearAttentionState(kv=s0, k_sum=None))  # fmt: skip
    o64, s64 = gdn2_loop(*(x.astype(np.float64) for x in args), S=s0)
    np.testing.assert_allclose(o, o64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.kv, s64, rtol=1e-5, atol=1e-5)
