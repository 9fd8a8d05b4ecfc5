"""Mamba-2's layer as the `gated` mixer's options (B/C shared by groups of heads, a state size N
other than the head width, the input scaled by dt, the D skip, the gated RMSNorm over groups
with the gate first), against a float64 NumPy loop of Mamba-2's recurrence written from its
definition (transformers' `Mamba2Mixer.torch_forward`), and decoding equal to the full pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention.layers import attention_inputs, get_mixer
from tests.layers.params import perturb_params

B, T, D = 2, 9, 32
SPLIT = 4
G, H, P, N, KERNEL = 2, 4, 8, 6, 4  # groups (B/C heads), value heads, head width, state, conv
EPS = 1e-5
MAMBA2 = dict(
    num_value_heads=H,
    head_dim=P,
    state_dim=N,
    conv=KERNEL,
    dt_input=True,
    d_skip=True,
    gate_before_norm=True,
    out_norm_groups=G,
    out_norm_eps=EPS,
    chunk_size=4,
)


def _softplus(z):
    return np.log1p(np.exp(-np.abs(z))) + np.maximum(z, 0)


def _silu(z):
    return z / (1 + np.exp(-z))


def _params64(mixer):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(mixer)))


def ssm64(mixer, x, skip=True):
    """Mamba-2's SSM in float64, token by token: conv over [C | B | x], then for value head h
    of group g = h // (H/G), S ← exp(dt·a) S + dt·B_g xᵀ, y = S ᵀC_g (+ D x with `skip`):
    `y [B, T, H, P]`."""
    p = _params64(mixer)
    x = np.asarray(x, np.float64)
    pre = x @ p["inputs"]["qkv_proj"]["kernel"]  # [B, T, G·N + G·N + H·P]
    w, bias = p["inputs"]["conv"]["kernel"], p["inputs"]["conv"]["bias"]
    padded = np.concatenate([np.zeros((B, KERNEL - 1, pre.shape[-1])), pre], axis=1)
    conv = _silu(bias + sum(w[j] * padded[:, j : j + T] for j in range(KERNEL)))
    c = conv[..., : G * N].reshape(B, T, G, N)
    b = conv[..., G * N : 2 * G * N].reshape(B, T, G, N)
    xs = conv[..., 2 * G * N :].reshape(B, T, H, P)
    decay = p["decay"]
    dt = _softplus(x @ decay["proj"]["kernel"] + decay["dt_bias"])  # [B, T, H]
    a = -np.exp(decay["a_log"])
    y = np.zeros((B, T, H, P))
    state = np.zeros((B, H, N, P))
    for t in range(T):
        for h in range(H):
            g = h // (H // G)
            step = dt[:, t, h, None, None]
            state[:, h] = np.exp(step * a[h]) * state[:, h] + step * np.einsum(
                "bn,bp->bnp", b[:, t, g], xs[:, t, h]
            )
            y[:, t, h] = np.einsum("bn,bnp->bp", c[:, t, g], state[:, h])
            if skip:
                y[:, t, h] += p["skip"][h] * xs[:, t, h]
    return y


def mamba2_64(mixer, x):
    """Mamba-2's layer in float64: `ssm64`, the RMSNorm of y ⊙ silu(z) over G groups of
    channels, and the output projection."""
    p, y = _params64(mixer), ssm64(mixer, x)
    x = np.asarray(x, np.float64)
    gated = y.reshape(B, T, H * P) * _silu(x @ p["output"]["gate_proj"]["kernel"])
    grouped = gated.reshape(B, T, G, H * P // G)
    normed = grouped / np.sqrt(np.mean(grouped**2, axis=-1, keepdims=True) + EPS)
    normed = (normed * p["output"]["norm"]["scale"]).reshape(B, T, H * P)
    return normed @ p["output"]["out_proj"]["kernel"]


_full = nnx.jit(lambda mixer, x: mixer(x))
_prefill = nnx.jit(lambda mixer, x, state: mixer.prefill(x, state))
_step = nnx.jit(lambda mixer, x, state: mixer.step(x, state))


def test_mamba2_options_match_float64_and_decode():
    mixer = get_mixer("gated")(D, G, **MAMBA2, rngs=nnx.Rngs(0))
    perturb_params(mixer, 1)
    # B/C have G heads and the state size N; v, dt, D and the state the H value heads
    assert mixer.inputs.qkv_proj.kernel.shape == (D, 2 * G * N + H * P)
    assert mixer.init_state(B, T).core.kv.shape == (B, H, N, P)
    assert mixer.skip.shape == (H,) and mixer.output.norm.scale.shape == (G, H * P // G)
    x = jax.random.normal(jax.random.key(2), (B, T, D))
    full = _full(mixer, x)
    np.testing.assert_allclose(full, mamba2_64(mixer, x), rtol=1e-4, atol=1e-5)
    y, state = _prefill(mixer, x[:, :SPLIT], mixer.init_state(B, T))
    ys = [y]
    for t in range(SPLIT, T):
        y_t, state = _step(mixer, x[:, t], state)
        ys.append(y_t[:, None])
    np.testing.assert_allclose(jnp.concatenate(ys, axis=1), full, rtol=1e-4, atol=1e-5)


def test_mamba2_options_in_bfloat16():
    """bfloat16 compute: the float32 model's numbers to bfloat16's precision."""
    mixer = get_mixer("gated")(D, G, **MAMBA2, rngs=nnx.Rngs(0))
    half = get_mixer("gated")(D, G, **MAMBA2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    perturb_params(mixer, 1)
    nnx.update(half, nnx.state(mixer, nnx.Param))
    x = jax.random.normal(jax.random.key(2), (B, T, D))
    y = _full(half, x.astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    want = _full(mixer, x)
    assert float(jnp.max(jnp.abs(y - want)) / jnp.max(jnp.abs(want))) < 0.05


def test_attention_inputs_are_what_the_kernel_attends_with():
    """`layers.attention_inputs` of the grouped, dt-scaled mixer: q/k per value head, and the
    weighted sum Σ_s (q_t·k_s) exp(Σ log γ) v_s gives Mamba-2's y (without D); with the D skip
    the output is no weighted sum (refused)."""
    options = {**MAMBA2, "d_skip": False}
    mixer = get_mixer("gated")(D, G, **options, rngs=nnx.Rngs(0))
    perturb_params(mixer, 3)
    x = jax.random.normal(jax.random.key(4), (B, T, D))
    inputs = attention_inputs(mixer, x)
    q, k, v, log_decay = (np.asarray(a, np.float64) for a in inputs)
    assert q.shape == k.shape == (B, T, H, N) and log_decay.shape == (B, T, H)
    cum = np.cumsum(log_decay, axis=1)  # [B, T, H]
    decay = np.exp(cum[:, :, None] - cum[:, None, :])  # [B, t, s, H]
    weights = np.einsum("bthn,bshn->btsh", q, k) * decay * np.tril(np.ones((T, T)))[..., None]
    y = np.einsum("btsh,bshp->bthp", weights, v)
    np.testing.assert_allclose(y, ssm64(mixer, x, skip=False), rtol=1e-4, atol=1e-5)
    with_skip = get_mixer("gated")(D, G, **MAMBA2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="d_skip adds D·v"):
        attention_inputs(with_skip, x)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(num_value_heads=3), "num_value_heads=3 must be a multiple of num_heads=2"),
        (dict(out_norm_groups=5), "out_norm_groups=5 needs out_norm on and must divide the 32"),
        (dict(out_norm_groups=2, out_norm=False), "out_norm_groups=2 needs out_norm on"),
        (dict(gate_before_norm=True, out_gate=False), "gate_before_norm needs out_norm and"),
        (dict(conv_bias=False), "conv_bias=False needs the short conv on"),
        (dict(state_dim=0), "state_dim"),
        (dict(out_norm_eps=0.0), "out_norm_eps"),
    ],
)
def test_mamba2_options_refused(options, message):
    with pytest.raises(ValueError, match=message):
        get_mixer("gated").check_options(D, G, **options)
