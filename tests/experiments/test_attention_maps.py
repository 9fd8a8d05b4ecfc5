"""experiments/attention_maps.py: the effective matrices against the kernels run on identity
values (o = A·I = A), the metrics on hand-computed maps, and the tiny preset end to end
(training two mixers for two steps, loading their checkpoints, writing the files)."""

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention import kernels as K
from linear_attention.data import IGNORE_INDEX
from linear_attention.layers import attention_inputs
from linear_attention.models import LanguageModel, ModelConfig
from tests.scripts import load_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def am():
    return load_module("experiments/attention_maps.py", "attention_maps")


# One map of each kind in the default run (exact softmax, random features, a decay per token);
# the other feature maps and the fixed decay under `-m slow`.
@pytest.mark.parametrize(
    "mixer",
    [
        m if m in ("softmax", "favor", "gated") else pytest.param(m, marks=pytest.mark.slow)
        for m in ("softmax", "linear", "favor", "taylor", "hedgehog", "retnet", "gated")
    ],
)
def test_effective_matrix_is_the_kernel_on_identity_values(am, mixer):
    config = ModelConfig(
        vocab_size=32,
        d_model=16,
        num_layers=1,
        num_heads=2,
        mixer=mixer,
        conv=4,
        mlp=False,
        position="rope" if mixer == "softmax" else "none",
        max_length=16,
        options=dict(feature_dim=4 if mixer == "taylor" else None),
    )
    model = LanguageModel(config, rngs=nnx.Rngs(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 10), 0, 32)
    x, layer = am.layer_input(model, tokens, 0)
    a, scores, v, kind, m = am.effective_maps(layer, x)
    b, h, t = a.shape[:3]
    assert a.shape == (2, 2, 10, 10) and scores.shape == a.shape
    assert np.all(np.triu(a, 1) == 0)  # causal

    # independent: the library's kernels on the mixer's attention inputs with v = identity
    # give o = A (attention_inputs itself is checked against float64 in tests/layers)
    inputs = attention_inputs(layer, x)
    eye = jnp.broadcast_to(jnp.eye(t)[None, :, None, :], (b, t, h, t))
    if mixer == "softmax":
        o = K.softmax_attention(inputs.q, inputs.k, eye, causal=True, scale=1.0)
        assert kind == "softmax" and m is None
    else:
        opts = dict(eps=layer.eps) if layer.NORMALIZE else {}
        o = K.causal_linear_attention(
            inputs.q,
            inputs.k,
            eye,
            log_decay=inputs.log_decay,
            normalize=layer.NORMALIZE,
            method="quadratic",
            **opts,
        )
        assert m == inputs.q.shape[-1]
        assert kind == ("normalized" if layer.NORMALIZE else "abs_row_normalized")
        # the unmasked φ(Q)φ(K)ᵀ has rank at most M
        for i in range(b):
            for j in range(h):
                assert np.linalg.matrix_rank(scores[i, j], tol=1e-8 * np.abs(scores).max()) <= m
    np.testing.assert_allclose(a, np.asarray(o).transpose(0, 2, 1, 3), rtol=2e-4, atol=1e-6)
    # and the output layers applied to A v give the mixer's own output
    assert am.reconstruct(layer, x, a, v) < 1e-4


def test_recall_positions_hand_case(am):
    ig = IGNORE_INDEX
    inputs = np.asarray([3, 40, 5, 41, 9, 5, 7, 3])
    labels = np.asarray([ig, ig, ig, ig, ig, 41, ig, 40])
    assert am.recall_positions(inputs, labels, 2) == [(5, 2, 3), (7, 0, 1)]
    with pytest.raises(ValueError, match="not the label"):
        am.recall_positions(inputs, np.where(labels == 41, 40, labels), 2)


def test_head_metrics_hand_cases(am):
    T = 8
    positions = [(5, 2, 3), (7, 0, 1)]
    # uniform causal rows: entropy log(t+1) (normalised 1), pair weight = chance 2/(t+1)
    uniform = np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]
    d = am.head_metrics(uniform, np.ones((T, T)), positions, 1e-3)
    assert d["entropy"] == pytest.approx((math.log(6) + math.log(8)) / 2)
    assert d["entropy_normalized"] == pytest.approx(1.0)
    assert (
        d["pair_weight"]
        == pytest.approx(d["chance_pair_weight"])
        == pytest.approx((2 / 6 + 2 / 8) / 2)
    )
    assert d["rank"] == T and d["kernel_rank"] == 1
    assert d["window_weight"] == d["pair_weight"]  # no window beyond the pair
    # a window of 2 after the value: [2, 6) for the query at 5, [0, 4) for the one at 7
    d = am.head_metrics(uniform, np.ones((T, T)), positions, 1e-3, window=2)
    assert d["window_weight"] == pytest.approx((4 / 6 + 4 / 8) / 2)
    assert d["chance_window_weight"] == pytest.approx(d["window_weight"])
    # one-hot rows on the value: zero entropy, all the weight on the pair, a permutation's rank
    onehot = np.eye(T)
    onehot[5] = np.eye(T)[3]
    onehot[7] = np.eye(T)[1]
    d = am.head_metrics(onehot, np.eye(T), positions, 1e-3)
    assert d["entropy"] == 0 and d["pair_weight"] == 1 and d["value_weight"] == 1
    assert d["key_weight"] == 0 and d["pair_argmax"] == 1 and d["window_argmax"] == 1
    assert d["rank"] == T - 2 and d["kernel_rank"] == T
    s = np.asarray([2**0.5, 2**0.5, 1, 1, 1, 1]) / (2 * 2**0.5 + 4)  # singular values / sum
    assert d["effective_rank"] == pytest.approx(math.exp(-np.sum(s * np.log(s))))


def test_tiny_preset_trains_loads_and_writes(am, tmp_path):
    res = am.run(tmp_path, "tiny", log=lambda _: None)
    for name in ("results.json", "results.md", "attention_maps.png", "attention_summary.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "results.json").read_text())["config"]["layer"] == "auto"
    t = res["config"]["seq_len"]
    assert set(res["mixers"]) == {"softmax", "gated"}
    for name, r in res["mixers"].items():
        assert (tmp_path / "runs" / name / "checkpoints").is_dir()
        # the layer shown is the one whose best head weighs the pair's window the most
        best = [lay["heads"][lay["best_head"]]["window_weight"] for lay in r["layers"]]
        assert r["shown_layer"] == int(np.argmax(best))
        assert r["checkpoint_step"] == 2 and 0 <= r["eval_accuracy"] <= 1
        for lay in r["layers"]:
            assert lay["recon_rel_err"] < 1e-4 and lay["row_sum_max_dev"] < 1e-6
            for hd in lay["heads"]:
                assert 0 <= hd["entropy_normalized"] <= 1 + 1e-9
                assert 0 <= hd["pair_weight"] <= 1 and 0 <= hd["pair_argmax"] <= 1
                assert hd["pair_weight"] == pytest.approx(hd["key_weight"] + hd["value_weight"])
                assert hd["pair_weight"] <= hd["window_weight"] + 1e-12 <= 1 + 1e-9
                assert lay["window"] == 3  # the smoke preset's conv has kernel 4
                assert 1 <= hd["effective_rank"] <= hd["rank"] <= t
                if name == "gated":
                    assert hd["kernel_rank"] <= lay["feature_dim"] == 16
    # a second run loads the checkpoints instead of training: same numbers
    again = am.run(tmp_path, "tiny", log=lambda _: None)
    assert again["mixers"]["gated"]["layers"] == res["mixers"]["gated"]["layers"]
