"""experiments/state_probe.py: per-position states equal to the decoding path's, the ridge probe
against the normal equations, the figures against hand-computed cases, and a whole run."""

import json

import numpy as np
import pytest
from flax import nnx

from linear_attention.models import LanguageModel, ModelConfig
from linear_attention.training import build_data, trainer
from linear_attention.training.load import restore_run
from tests.scripts import load_module
from tests.training.conftest import full_pass, load_config

# The references' prefill and step, each one compiled program (eagerly, every operation
# compiles alone).
prefill = nnx.jit(lambda model, tokens, state: model.prefill(tokens, state))
step = nnx.jit(lambda model, token, state: model.step(token, state))


@pytest.fixture(scope="module")
def sp():
    return load_module("experiments/state_probe.py", "state_probe")


def then_softmax(seed: int, mixer: str = "kda") -> LanguageModel:
    """Two layers: a state (kda with β ∈ (0, 2), or ``mixer``) and a KV cache (softmax), on 5
    tokens."""
    cfg = ModelConfig(
        vocab_size=5,
        d_model=16,
        num_layers=2,
        num_heads=2,
        mixer=(mixer, "softmax"),
        max_length=8,
        options=dict(allow_neg_eigval=True if mixer == "kda" else None),
    )
    return LanguageModel(cfg, rngs=nnx.Rngs(seed))


def test_features_are_the_prefill_states_and_the_residual_stream(sp):
    model = then_softmax(seed=0)
    tokens = np.random.default_rng(0).integers(0, 5, (2, 6)).astype(np.int32)
    logits, residuals, states = sp.make_features(model)(tokens)
    np.testing.assert_allclose(logits, full_pass(model, tokens), rtol=1e-5, atol=1e-6)
    assert states[1] is None  # softmax: a KV cache, no recurrent state
    assert [r.shape for r in residuals] == [(2, 6, 16)] * 2
    # the head reads the last block's residual through the final norm (tied embedding)
    head = model.final_norm(residuals[-1]) @ np.asarray(model.embed.embedding[...]).T
    np.testing.assert_allclose(head, logits, rtol=1e-4, atol=1e-5)
    # the state after position t is the prefill state of the prefix tokens[:, : t + 1]
    h = states[0].shape[2]
    for t in (2, 5):
        _, state = prefill(model, tokens[:, : t + 1], model.init_state(2, 8))
        kv = np.asarray(state.layers[0].core.kv)
        assert kv.shape[1] == h
        np.testing.assert_allclose(states[0][:, t], kv.reshape(2, h, -1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mixer", ["kda", "taylor"])  # taylor: a normaliser k_sum beside kv
def test_capped_decoding_against_a_step_loop(sp, mixer):
    model = then_softmax(seed=1, mixer=mixer)
    tokens = np.random.default_rng(2).integers(0, 5, (2, 6)).astype(np.int32)
    decoder = sp.make_decoder(model)
    # no cap: the decoding path's logits are the full pass's, the norms the states' norms
    logits, norms = decoder(tokens, (None, None))
    np.testing.assert_allclose(logits, full_pass(model, tokens), rtol=1e-4, atol=1e-5)
    uncapped = logits
    assert norms[1] is None
    _, _, states = sp.make_features(model)(tokens)
    np.testing.assert_allclose(norms[0], np.linalg.norm(states[0], axis=-1), rtol=1e-5)
    # a cap between the heads' norms: reference is model.step in a Python loop, each head's
    # state scaled to the cap by hand whenever its norm exceeds it
    cap = np.array([np.median(norms[0][..., 0]), np.median(norms[0][..., 1])], np.float32)
    logits, capped = decoder(tokens, (cap, None))
    state, want_logits, want_norms = model.init_state(2, 8), [], []
    for t in range(tokens.shape[1]):
        step_logits, state = step(model, tokens[:, t], state)
        kv = np.asarray(state.layers[0].core.kv, np.float64)  # [B, H, M, Dv]
        norm = np.sqrt((kv**2).sum(axis=(2, 3)))
        scale = np.where(norm > cap, cap / norm, 1.0)
        core = state.layers[0].core._replace(kv=(kv * scale[:, :, None, None]).astype(np.float32))
        if core.k_sum is not None:
            core = core._replace(k_sum=(core.k_sum * scale[:, :, None]).astype(np.float32))
        state = state._replace(layers=(state.layers[0]._replace(core=core), *state.layers[1:]))
        want_logits.append(step_logits)
        want_norms.append(norm)
    np.testing.assert_allclose(logits, np.stack(want_logits, 1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(capped[0], np.stack(want_norms, 1), rtol=1e-4)
    assert (capped[0] > cap).any() and (capped[0] <= cap).any()  # the cap acted, not always
    assert np.abs(logits - uncapped).max() > 1e-3  # and what came after it changed


def test_ridge_fit_solves_the_regularised_normal_equations(sp):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(30, 4))
    y = rng.integers(0, 3, 30)
    ridge = 0.1
    # split into uneven batches: the sums must add up to the whole-set solution
    w = sp.ridge_fit([(x[:7], y[:7]), (x[7:], y[7:])], num_classes=3, ridge=ridge)
    design = np.concatenate([x, np.ones((30, 1))], axis=1)
    gram = design.T @ design
    lam = ridge * np.trace(gram) / 5
    want = np.linalg.solve(gram + lam * np.eye(5), design.T @ np.eye(3)[y])
    np.testing.assert_allclose(w, want, rtol=1e-10)
    np.testing.assert_array_equal(sp.probe_predict(w, x), (design @ want).argmax(-1))
    # features that are the labels' one-hot codes: the probe reads them back exactly
    onehot = 3.0 * np.eye(3)[y]
    w = sp.ridge_fit([(onehot, y)], num_classes=3, ridge=1e-6)
    np.testing.assert_array_equal(sp.probe_predict(w, onehot), y)
    with pytest.raises(ValueError, match="at least one batch"):
        sp.ridge_fit([], num_classes=3, ridge=0.0)


def test_accuracy_figures_and_state_norms_by_bucket(sp, monkeypatch):
    monkeypatch.setattr(sp, "BUCKETS", (0, 2, 16))
    right = np.array([[True, False, True, True], [True, True, True, False]])
    scored = np.array([[True, True, True, True], [False, False, True, True]])
    out = sp.accuracy_figures(right, scored)
    # scored: row 0 all four (3 right), row 1 positions 2, 3 (1 right): 4 of 6
    assert out["accuracy"] == 4 / 6
    assert out["sequence_accuracy"] == 0.0  # row 0 wrong at 1, row 1 at 3
    assert out["by_position"] == [
        dict(positions=[0, 2], accuracy=1 / 2),  # row 0: T, F (row 1 unscored there)
        dict(positions=[2, 4], accuracy=3 / 4),
    ]
    right[0, 1] = right[1, 3] = True
    assert sp.accuracy_figures(right, scored)["sequence_accuracy"] == 1.0
    # parity-like labels (last position only): a bucket with nothing scored is left out
    last = np.zeros((2, 4), bool)
    last[:, 3] = True
    assert sp.accuracy_figures(right, last)["by_position"] == [dict(positions=[2, 4], accuracy=1.0)]
    norms = np.arange(2 * 4 * 2, dtype=float).reshape(2, 4, 2)  # [B, T, H]
    (layer,) = sp.state_norms([norms, None], length=4)
    assert layer["layer"] == 0
    # bucket [0, 2): positions 0, 1 of both rows; head 0 values 0, 2, 8, 10
    assert layer["by_position"] == [
        dict(positions=[0, 2], norm=[5.0, 6.0]),
        dict(positions=[2, 4], norm=[9.0, 10.0]),
    ]


def test_state_probe_of_a_run(sp, tmp_path):
    config = load_config("state_tracking", "smoke")  # parity, evaluated at 12 and 20
    config.model.mixer, config.model.options.allow_neg_eigval = "kda", True
    config.train.num_steps = 2
    workdir = str(tmp_path / "run")
    summary = trainer.train(config, workdir)
    out = tmp_path / "probe.json"
    sp.main(["--workdir", workdir, "--fit_batches", "2", "--batch_size", "8", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["step"] == 2 and result["fit"]["first_step"] == 2
    # the run's header (`run_header`): what was probed
    assert result["workdir"] == workdir and result["task"] == "parity"
    assert result["model"] == dict(
        mixer="kda",
        num_layers=config.model.num_layers,
        num_heads=config.model.num_heads,
        num_householder=None,
        allow_neg_eigval=True,
    )
    assert result["learning_rate"] == config.optimizer.learning_rate
    assert result["seed"] == config.seed
    assert result["command"].startswith("python experiments/state_probe.py --workdir")
    figs_by_length = {}
    for length in (12, 20):
        figs = result["lengths"][str(length)]
        figs_by_length[length] = figs["model"]["accuracy"]
        # one label per parity sequence: the model's figure is the trainer's evaluation
        assert figs["model"]["accuracy"] == pytest.approx(
            summary[f"eval/length_{length}/accuracy"], abs=1e-6
        )
        assert figs["model"]["accuracy"] == figs["model"]["sequence_accuracy"]
        assert {"state_0", "state_1", "residual_0", "residual_1"} <= set(figs)
        assert [layer["layer"] for layer in figs["state_norms"]] == [0, 1]
        # a norm per head, positive once a token has been written
        assert all(n > 0 for r in figs["state_norms"][0]["by_position"] for n in r["norm"])
    assert set(result["fit"]["accuracy"]) == {"state_0", "state_1", "residual_0", "residual_1"}
    # the default cap: each head at its largest norm on the fitting batches (both layers kda)
    caps = result["caps"]
    assert list(caps["scales"]) == ["1"]
    assert [len(m) for m in caps["max_norm"]] == [config.model.num_heads] * 2
    assert all(n > 0 for m in caps["max_norm"] for n in m)
    for length in (12, 20):
        fig = caps["scales"]["1"][str(length)]
        assert 0 <= fig["accuracy"] <= 1 and len(fig["binds"]) == 2
        assert all(0 <= b <= 1 for b in fig["binds"])
    # a cap that always acts and one that never does
    run = restore_run(workdir)
    model, _ = nnx.merge(run.graphdef, run.state)
    max_norms = [np.asarray(m) for m in caps["max_norm"]]
    data = build_data(run.config)
    scales = sp.capped_accuracy(model, data, max_norms, [1e-6, 1e6], 8)
    for length in (12, 20):
        assert scales["scales"]["1e-06"][str(length)]["binds"] == [1.0, 1.0]
        never = scales["scales"]["1e+06"][str(length)]
        assert never["binds"] == [0.0, 0.0]
        # the uncapped decoding path against the full pass: equal but for a near-tie's
        # rounding, at most one sequence (one parity label each) of the evaluation set
        one = 1 / len(data.eval_sets[length][0])
        assert abs(never["accuracy"] - figs_by_length[length]) <= one + 1e-9


def test_bad_arguments_exit_2(sp, capsys):
    for argv, message in (
        (["--fit_batches", "0"], "--fit_batches must be >= 1"),
        (["--ridge", "-1"], "--ridge must be >= 0"),
        (["--cap_scales", "1,x"], "argument --cap_scales: positive numbers"),
        (["--cap_scales", "0"], "argument --cap_scales: positive numbers"),
    ):
        with pytest.raises(SystemExit) as e:
            sp.main(["--workdir", "x", "--out", "y", *argv])
        assert e.value.code == 2 and message in capsys.readouterr().err
