"""The lstm mixer: a hand-computed cell, the float64 NumPy loop (outputs, states, a gradient),
bfloat16 parameters, its decoding state and FLOPs, and the config's refusals."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention.layers import LSTMState, MixerState, get_mixer
from linear_attention.models import ModelConfig, state_size_bytes
from tests.layers.numpy_reference import lstm_loop, lstm_reference

B, T, D, H = 2, 9, 16, 2
SPLIT = 4


def inputs(seed: int = 1, shape=(B, T, D)):
    return jax.random.normal(jax.random.key(seed), shape)


def sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


def test_one_cell_by_hand():
    """d_model = Dh = 1, one head: two tokens computed here with `math`, gate order i, f, g, o."""
    mixer = get_mixer("lstm")(1, 1, rngs=nnx.Rngs(0))
    w, b, r = [0.5, -0.5, 1.0, 2.0], [0.0, 1.0, 0.0, 0.0], [0.3, 0.2, -0.4, 0.1]
    mixer.inputs.proj.kernel[...] = jnp.asarray([w])
    mixer.inputs.proj.bias[...] = jnp.asarray(b)
    mixer.recurrent[...] = jnp.asarray(r).reshape(1, 1, 4)
    mixer.output.out_proj.kernel[...] = jnp.asarray([[2.0]])
    h, c, ys = 0.0, 0.0, []
    for x in (1.0, -2.0):
        z = [wj * x + bj + rj * h for wj, bj, rj in zip(w, b, r, strict=True)]
        c = sigmoid(z[1]) * c + sigmoid(z[0]) * math.tanh(z[2])
        h = sigmoid(z[3]) * math.tanh(c)
        ys.append(2.0 * h)
    y, state = mixer.prefill(jnp.asarray([[[1.0], [-2.0]]]), mixer.init_state(1, 2))
    np.testing.assert_allclose(np.asarray(y)[0, :, 0], ys, rtol=1e-6)
    np.testing.assert_allclose(float(state.core.h[0, 0, 0]), h, rtol=1e-6)
    np.testing.assert_allclose(float(state.core.c[0, 0, 0]), c, rtol=1e-6)


def test_init_biases_and_shapes():
    mixer = get_mixer("lstm")(D, H, rngs=nnx.Rngs(0))
    bias = np.asarray(mixer.inputs.proj.bias[...]).reshape(H, 4, D // H)
    np.testing.assert_array_equal(bias[:, 1], 1.0)  # the forget gate starts open
    np.testing.assert_array_equal(bias[:, [0, 2, 3]], 0.0)
    r = np.asarray(mixer.recurrent[...])
    assert r.shape == (H, D // H, 4 * D // H) and np.abs(r).max() <= (D // H) ** -0.5
    assert not mixer.SEQUENCE_PARALLEL and mixer.inputs.init_state(B) is None


def test_prefill_from_a_state_then_steps_match_the_loop():
    """Prefill of SPLIT tokens, then steps: outputs and the final (h, c) equal the float64 loop;
    a second prefill continues from the first's state (the loop given that state)."""
    mixer, x = get_mixer("lstm")(D, H, rngs=nnx.Rngs(2)), inputs()

    @nnx.jit
    def run(mixer, x):
        head, state = mixer.prefill(x[:, :SPLIT], mixer.init_state(B, T))
        ys = [head]
        for t in range(SPLIT, T):
            y, state = mixer.step(x[:, t], state)
            ys.append(y[:, None])
        return jnp.concatenate(ys, axis=1), state

    y, state = run(mixer, x)
    _, h, c = lstm_loop(mixer, np.asarray(x))
    np.testing.assert_allclose(y, lstm_reference(mixer, np.asarray(x)), rtol=1e-4, atol=1e-5)
    assert isinstance(state, MixerState) and isinstance(state.core, LSTMState)
    assert state.core.h.dtype == state.core.c.dtype == jnp.float32 and state.conv is None
    np.testing.assert_allclose(state.core.h, h, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(state.core.c, c, rtol=1e-4, atol=1e-6)
    # from a nonzero state: the loop started at that state
    more = inputs(5, (B, 3, D))
    y2, _ = mixer.prefill(more, state)
    want = lstm_reference(mixer, np.asarray(more), np.asarray(state.core.h), state.core.c)
    np.testing.assert_allclose(y2, want, rtol=1e-4, atol=1e-5)


def test_gradient_matches_finite_differences_of_the_loop():
    """d Σ w·y / d R[head 1, 2, 5] by the scan's gradient and by central differences of the
    float64 loop."""
    mixer, x = get_mixer("lstm")(D, H, rngs=nnx.Rngs(3)), inputs()
    w = np.cos(np.arange(B * T * D)).reshape(B, T, D)
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) * w)))(mixer)
    got = float(grads["recurrent"][...][1, 2, 5])
    base = np.asarray(mixer.recurrent[...], np.float64)
    eps, values = 1e-4, []
    for sign in (1.0, -1.0):
        mixer.recurrent[...] = jnp.asarray(base).at[1, 2, 5].add(sign * eps)
        # (the loop reads the parameters in float64; float32 rounds the perturbed entry)
        shifted = float(np.asarray(mixer.recurrent[...], np.float64)[1, 2, 5] - base[1, 2, 5])
        values.append((np.sum(lstm_reference(mixer, np.asarray(x)) * w), shifted))
    (plus, dp), (minus, dm) = values
    assert abs(got) > 1e-4
    np.testing.assert_allclose(got, (plus - minus) / (dp - dm), rtol=2e-3)


def test_bfloat16_parameters_and_compute():
    """bfloat16 parameters and compute: the three paths run and agree, outputs bfloat16, the
    state float32, and the output is the float64 loop's on the same (bfloat16) parameters to
    bfloat16 rounding."""
    mixer = get_mixer("lstm")(D, H, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert {p.dtype for p in jax.tree.leaves(nnx.state(mixer, nnx.Param))} == {
        jnp.dtype(jnp.bfloat16)
    }
    x = inputs().astype(jnp.bfloat16)
    y = nnx.jit(lambda m, x: m(x))(mixer, x)
    assert y.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(y)))
    y_pre, state = nnx.jit(lambda m, x: m.prefill(x, m.init_state(B, T)))(mixer, x)
    y_step, state1 = nnx.jit(lambda m, x: m.step(x, m.init_state(B, T)))(mixer, x[:, 0])
    assert y_step.dtype == jnp.bfloat16
    assert {leaf.dtype for leaf in jax.tree.leaves(state.core)} == {jnp.dtype(jnp.float32)}
    assert {leaf.dtype for leaf in jax.tree.leaves(state1.core)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_array_equal(np.asarray(y_pre, np.float32), np.asarray(y, np.float32))
    np.testing.assert_allclose(
        np.asarray(y_step, np.float32), np.asarray(y[:, 0], np.float32), rtol=0.02, atol=0.01
    )
    ref = lstm_reference(mixer, np.asarray(x, np.float64))
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=0.05, atol=0.02)
    # bfloat16 parameters with float32 compute: the same loop to float32 rounding
    mixed = get_mixer("lstm")(D, H, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    y32 = mixed(inputs())
    assert y32.dtype == jnp.float32
    np.testing.assert_allclose(y32, lstm_reference(mixed, np.asarray(inputs())), atol=1e-5)


def test_state_size_and_flops():
    """(h, c) of H·Dh float32 per layer, whatever the context; 8·H·Dh² FLOPs per token."""
    config = ModelConfig(vocab_size=32, d_model=D, num_layers=3, num_heads=H, mixer="lstm")
    assert state_size_bytes(config) == 3 * 2 * D * 4
    longer = ModelConfig(
        vocab_size=32, d_model=D, num_layers=3, num_heads=H, mixer="lstm", max_length=4096
    )
    assert state_size_bytes(longer) == state_size_bytes(config)
    mixer = get_mixer("lstm")(D, 4, head_dim=8, rngs=nnx.Rngs(0))
    assert mixer.mixing_flops(10) == mixer.mixing_flops(1000) == 8.0 * 4 * 8**2
    assert mixer.init_state(B, 5).core.h.shape == (B, 4, 8)


def test_config_refuses_a_time_split_and_names_the_conv():
    from linear_attention.training import experiment_config
    from tests.training.conftest import load_config

    config = load_config("state_tracking", "parity")
    config.model.mixer = "lstm"
    with pytest.raises(ValueError, match=r"lstm takes no conv .*--config.model.conv=0"):
        experiment_config(config)
    config.model.conv = 0
    experiment_config(config)  # builds
    config = load_config("mqar", "smoke")  # (state tracking refuses a split on its own)
    config.model.mixer, config.model.conv = "lstm", 0
    config.mesh.num_devices, config.mesh.seq = 2, 2
    with pytest.raises(ValueError, match=r"config.mesh.seq = 2 splits the time axis.*lstm"):
        experiment_config(config)
