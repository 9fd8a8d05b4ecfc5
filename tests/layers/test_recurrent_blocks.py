"""Mamba-1's block (`mamba`) and Griffin's recurrent block (`rglru`): their initialisation
(transformers' rules), the options they refuse, and (`-m hf`) the peer check of
experiments/peer_check_recurrent.py: outputs and the gradients of every parameter and of the
input against transformers' torch `MambaMixer` (slow path) and `RecurrentGemmaRecurrentBlock`
with the weights copied across, within the peer's own float32 error against its float64 run or
1e-5 relative. (Their three paths, float64 references, packed rows and bfloat16 are in
test_mixers.py with every mixer's.)"""

from __future__ import annotations

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention.layers import get_mixer
from tests.scripts import ROOT


def test_mamba_initialises_as_transformers():
    """A_log = log n on every channel, D = 1, softplus(dt_proj bias) in [1e-3, 1e-1], the
    dt_proj kernel within ±1/√R and out_proj within ±1/√E; E = 2·d_model, R = ⌈d/16⌉."""
    mixer = get_mixer("mamba")(48, 2, state_dim=6, rngs=nnx.Rngs(0))
    assert (mixer.channels, mixer.dt_rank, mixer.state_size) == (96, 3, 6)
    np.testing.assert_allclose(np.exp(mixer.A_log[...]), np.tile(np.arange(1, 7), (96, 1)), 1e-6)
    np.testing.assert_array_equal(mixer.D[...], 1.0)
    dt = np.log1p(np.exp(np.asarray(mixer.dt_proj.bias[...], np.float64)))
    assert 1e-3 * (1 - 1e-5) <= dt.min() and dt.max() <= 1e-1 * (1 + 1e-5) and np.ptp(dt) > 0
    assert np.abs(mixer.dt_proj.kernel[...]).max() <= 3**-0.5
    assert np.abs(mixer.out_proj.kernel[...]).max() <= 96**-0.5
    core = mixer.init_state(3, 100).core
    assert core.shape == (3, 96, 6) and core.dtype == jnp.float32


def test_rglru_initialises_as_transformers():
    """a = exp(−softplus(Λ)) in [0.9, 0.999], the gates' biases 0 and weights N(0, 0.01/bw)
    (bw = lru_width / num_heads), the conv N(0, 0.01/4)."""
    mixer = get_mixer("rglru")(32, 4, lru_width=64, rngs=nnx.Rngs(0))
    a = np.exp(-np.log1p(np.exp(np.asarray(mixer.recurrent_param[...], np.float64))))
    assert a.min() >= 0.9 - 1e-6 and a.max() <= 0.999 + 1e-6 and np.ptp(a) > 0.01
    assert mixer.input_gate_weight[...].shape == (4, 16, 16)
    for gate in (mixer.input_gate_weight, mixer.recurrent_gate_weight):
        assert abs(float(np.std(gate[...])) / (0.01 / 16) ** 0.5 - 1) < 0.15
    np.testing.assert_array_equal(mixer.recurrent_gate_bias[...], 0.0)
    assert abs(float(np.std(mixer.inputs.conv_1d.kernel[...])) / 0.05 - 1) < 0.3
    assert mixer.init_state(3, 100).core.shape == (3, 64)


@pytest.mark.parametrize(
    "name, options, match",
    [
        ("mamba", dict(conv=False), "mixer 'mamba' needs its causal conv"),
        ("mamba", dict(rope=True), "mixer 'mamba' does not use option rope"),
        ("mamba", dict(method="chunk"), "method"),
        ("rglru", dict(lru_width=25), "lru_width=25 must be a multiple of num_heads=2"),
        ("rglru", dict(out_gate=True), "mixer 'rglru' does not use option out_gate"),
    ],
)
def test_bad_options_raise(name, options, match):
    with pytest.raises(ValueError, match=match):
        get_mixer(name)(16, 2, **options, rngs=nnx.Rngs(0))


def _peer_check():
    path = ROOT / "experiments" / "peer_check_recurrent.py"
    spec = importlib.util.spec_from_file_location("peer_check_recurrent", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.hf
@pytest.mark.parametrize("name", ["mamba", "rglru"])
def test_against_the_transformers_block(name):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    errors = getattr(_peer_check(), f"{name}_check")()
    assert {"y", "dx"} <= set(errors) and len(errors) >= 10
    for quantity, e in errors.items():
        assert e["ours"] <= e["bound"], (name, quantity, e)
