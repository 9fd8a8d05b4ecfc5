"""experiments/gate_stats.py: the per-token gate figures and the per-length accuracy, margin and
accuracy by number of ones, against hand-computed cases."""

import numpy as np
import pytest
from flax import nnx

from linear_attention.data.batches import IGNORE_INDEX
from linear_attention.models import LanguageModel, ModelConfig
from tests.scripts import load_module
from tests.training.conftest import full_pass


@pytest.fixture(scope="module")
def gs():
    return load_module("experiments/gate_stats.py", "gate_stats")


def test_gate_figures_by_token_and_products(gs):
    # one sequence of 3 tokens [1, 0, 1], one head: β = (2·0.9, 0.1, 2·0.9), γ = (0.5, 1, 0.5)
    tokens = np.array([[1, 0, 1]])
    beta = np.array([[[1.8], [0.1], [1.8]]], np.float32)
    log_gamma = np.log(np.array([[[0.5], [1.0], [0.5]]], np.float32))
    (head,) = gs.gate_figures(beta, log_gamma, tokens)
    one, zero = head["by_token"]["1"], head["by_token"]["0"]
    assert (one["count"], zero["count"]) == (2, 1)
    np.testing.assert_allclose(one["beta"]["mean"], 1.8, rtol=1e-6)
    np.testing.assert_allclose(one["gamma"]["max"], 0.5, rtol=1e-6)
    np.testing.assert_allclose(one["gamma_times_one_minus_beta"]["mean"], 0.5 * -0.8, rtol=1e-6)
    np.testing.assert_allclose(zero["gamma_times_one_minus_beta"]["min"], 0.9, rtol=1e-6)
    # Π γ = 0.25; Π |γ(1 − β)| = 0.4 · 0.9 · 0.4
    np.testing.assert_allclose(
        head["log10_prod_gamma_per_sequence"]["mean"], np.log10(0.25), rtol=1e-6
    )
    np.testing.assert_allclose(
        head["log10_prod_abs_along_k_per_sequence"]["mean"], np.log10(0.4 * 0.9 * 0.4), rtol=1e-6
    )


def test_per_channel_decay_is_read_along_the_key(gs):
    # kda: one sequence [1, 0], one head, K = 2; keys e_0 and (0.6, 0.8); γ per channel
    # (0.5, 1) then (0.25, 1); β = 1.8 then 0.5. Along the key: kᵀ Diag(γ) k = 0.5, then
    # 0.36·0.25 + 0.64·1 = 0.73; times (1 − β): −0.4, 0.365
    tokens = np.array([[1, 0]])
    beta = np.array([[[1.8], [0.5]]], np.float32)
    log_gamma = np.log(np.array([[[[0.5, 1.0]], [[0.25, 1.0]]]], np.float32))
    keys = np.array([[[[1.0, 0.0]], [[0.6, 0.8]]]], np.float32)
    (head,) = gs.gate_figures(beta, log_gamma, tokens, keys)
    one, zero = head["by_token"]["1"], head["by_token"]["0"]
    np.testing.assert_allclose(one["gamma"]["mean"], 0.5, rtol=1e-6)
    np.testing.assert_allclose(zero["gamma"]["mean"], 0.73, rtol=1e-6)
    np.testing.assert_allclose(one["gamma_times_one_minus_beta"]["mean"], -0.4, rtol=1e-6)
    np.testing.assert_allclose(zero["gamma_times_one_minus_beta"]["mean"], 0.365, rtol=1e-6)
    np.testing.assert_allclose(zero["gamma_min_over_channels"]["mean"], 0.25, rtol=1e-6)
    # channel 0 keeps 0.5 · 0.25 over the sequence, channel 1 everything
    prod = head["log10_prod_gamma_per_sequence"]
    np.testing.assert_allclose([prod["min"], prod["max"]], [np.log10(0.125), 0.0], atol=1e-6)
    np.testing.assert_allclose(
        head["log10_prod_abs_along_k_per_sequence"]["mean"], np.log10(0.4 * 0.365), rtol=1e-6
    )
    with pytest.raises(ValueError, match="needs keys of the same shape"):
        gs.gate_figures(beta, log_gamma, tokens)


def test_forward_gives_kda_its_keys_per_value_head(gs):
    # 4 value heads over 2 key heads: value heads 0, 1 read key head 0 and 2, 3 key head 1
    cfg = ModelConfig(
        vocab_size=3,
        d_model=8,
        num_layers=1,
        num_heads=2,
        mixer="kda",
        options=dict(num_value_heads=4, allow_neg_eigval=True),
    )
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    tokens = np.array([[0, 2, 1, 1]], np.int32)
    logits, betas, log_decays, keys, decay_keys = gs.make_forward(model)(tokens)
    assert keys == [] and log_decays[0].shape == decay_keys[0].shape
    assert log_decays[0].shape[:3] == betas[0].shape == (1, 4, 4)
    k = np.asarray(decay_keys[0])
    np.testing.assert_array_equal(k[:, :, 0], k[:, :, 1])
    np.testing.assert_array_equal(k[:, :, 2], k[:, :, 3])
    assert np.abs(k[:, :, 0] - k[:, :, 2]).max() > 1e-3
    np.testing.assert_allclose(np.linalg.norm(decay_keys[0], axis=-1), 1.0, rtol=1e-4)  # l2norm eps
    np.testing.assert_allclose(logits, full_pass(model, tokens), rtol=1e-5, atol=1e-6)


def test_length_figures_accuracy_margin_and_ones(gs, monkeypatch):
    # 4 parity sequences of length 2, label at the last position; logits chosen by hand
    inputs = np.array([[0, 0], [0, 1], [1, 1], [1, 0]], np.int32)
    labels = np.full((4, 2), IGNORE_INDEX, np.int32)
    labels[:, 1] = inputs.sum(-1) % 2  # 0, 1, 0, 1
    logits = np.zeros((4, 2, 2), np.float32)
    logits[:, 1] = [[2.0, 0.0], [0.0, 0.5], [0.0, 1.0], [3.0, 0.0]]  # right, right, wrong, wrong
    # position 0 (prefix length 1, parity = the first bit 0, 0, 1, 1): predicts 0, 0, 0, 1
    logits[:, 0] = [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]
    beta = np.full((4, 2, 1), 0.5, np.float32)
    log_gamma = np.zeros((4, 2, 1), np.float32)

    keys = np.zeros((4, 2, 1, 2), np.float32)
    keys[..., 0] = 1.0  # every token writes along e_0

    def forward(tokens):  # one batch of all four sequences
        assert np.asarray(tokens).shape == (4, 2)
        return logits, [beta], [log_gamma], [keys], [None]

    monkeypatch.setattr(gs, "PREFIX_EVERY", 1)  # every prefix length
    out = gs.length_figures(forward, inputs, labels, "parity", batch_size=4, keys=True)
    (geometry,) = out["layers"][0]["keys"]
    assert geometry["tokens"] == [0, 1] and geometry["consistency"] == [1.0, 1.0]
    np.testing.assert_allclose(geometry["cosines"], [[1.0, 1.0], [1.0, 1.0]])
    np.testing.assert_allclose(geometry["singular_values"], [1.0, 0.0], atol=1e-7)
    assert out["num_sequences"] == 4 and out["sequence_accuracy"] == 0.5
    np.testing.assert_allclose(sorted([out["margin"]["min"], out["margin"]["max"]]), [-3.0, 2.0])
    np.testing.assert_allclose(out["abs_margin_right"]["mean"], 1.25)
    np.testing.assert_allclose(out["abs_margin_wrong"]["mean"], 2.0)
    by_ones = {(b["ones_from"], b["ones_to"]): b for b in out["accuracy_by_number_of_ones"]}
    assert sum(b["count"] for b in by_ones.values()) == 4
    # 0 ones: [0, 0] right; 2 ones: [1, 1] wrong; 1 one: one right, one wrong
    accuracy = {lo: b["accuracy"] for (lo, hi), b in by_ones.items() if lo == hi}
    assert accuracy[0] == 1.0 and accuracy[2] == 0.0 and accuracy[1] == 0.5
    assert out["prefix_accuracy"] == dict(prefix_length=[1, 2], accuracy=[0.75, 0.5])


def test_key_geometry_by_token_against_a_hand_computed_case(gs):
    # one head, K = 3: token 0 writes e_2; token 1 writes e_0, then (e_0 + e_1)/√2 (its mean
    # direction is 22.5° from e_0, at |mean| = cos 22.5°); token 2 writes 2·e_1 (made unit)
    tokens = np.array([[0, 1, 2, 1]])
    keys = np.zeros((1, 4, 1, 3), np.float32)
    keys[0, 0, 0, 2] = 1.0
    keys[0, 1, 0, 0] = 1.0
    keys[0, 2, 0, 1] = 2.0
    keys[0, 3, 0, :2] = 0.5**0.5
    (head,) = gs.key_geometry(keys, tokens)
    s = np.sin(np.pi / 8)  # cosine between token 1's mean direction and e_1
    assert head["tokens"] == [0, 1, 2]
    np.testing.assert_allclose(head["consistency"], [1.0, np.cos(np.pi / 8), 1.0], rtol=1e-6)
    np.testing.assert_allclose(
        head["cosines"], [[1, 0, 0], [0, 1, s], [0, s, 1]], rtol=1e-6, atol=1e-7
    )
    # the Gram matrix's eigenvalues are 1 (e_2) and 1 ± s, the singular values their roots
    expected = np.sqrt([1 + s, 1, 1 - s]) / np.sqrt(1 + s)
    np.testing.assert_allclose(head["singular_values"], expected, rtol=1e-6)


def test_only_delta_rule_models_are_read(gs):
    cfg = ModelConfig(vocab_size=2, d_model=8, num_layers=1, num_heads=2, mixer="gla")
    with pytest.raises(ValueError, match="delta-rule mixers"):
        gs.check_model(LanguageModel(cfg, rngs=nnx.Rngs(0)))


def test_exact_reflection_sets_one_head_to_gamma_one_and_beta_saturated(gs):
    cfg = ModelConfig(
        vocab_size=2,
        d_model=8,
        num_layers=1,
        num_heads=2,
        mixer="gated_deltanet",
        options=dict(allow_neg_eigval=True),
    )
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    mixer = model.blocks[0].mixer
    x = np.random.default_rng(0).normal(size=(1, 5, 8)).astype(np.float32)
    beta0, log_gamma0 = np.asarray(mixer.beta(x)), np.asarray(mixer.decay(x))
    gs.exact_reflection(model, 0, 1)
    beta, log_gamma = np.asarray(mixer.beta(x)), np.asarray(mixer.decay(x))
    np.testing.assert_array_equal(beta[..., 0], beta0[..., 0])  # head 0 untouched
    np.testing.assert_array_equal(log_gamma[..., 0], log_gamma0[..., 0])
    assert np.all(log_gamma[..., 1] == 0.0)  # γ = 1 exactly
    # β = 2 where the logit was > 0 (β0 > 1), 0 where < 0: the sign of the logit is kept
    np.testing.assert_array_equal(beta[..., 1], np.where(beta0[..., 1] > 1.0, 2.0, 0.0))
    with pytest.raises(ValueError, match="head must be in"):
        gs.exact_reflection(model, 0, 2)
    assert gs.layer_head("0:1") == (0, 1)
