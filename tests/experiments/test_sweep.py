"""The sweep engine (`linear_attention.training.sweep`, run as experiments/sweep.py): grid
expansion and its errors, best-lr selection on hand-made results, the MQAR and LM smoke sweeps
end to end, and resuming (finished points are skipped, a point without summary resumes from its
checkpoint, a changed grid on the same workdir is refused)."""

import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from linear_attention.models import LanguageModel
from linear_attention.training import NonFiniteLossError, experiment_config
from linear_attention.training import sweep as sweep_package
from linear_attention.training.metrics import write_json
from linear_attention.training.sweep import points as sweep_points
from tests.scripts import DEADLINE_S, wait_until

ROOT = Path(__file__).resolve().parents[2]
MQAR = str(ROOT / "configs/sweeps/mqar.py")
LM = str(ROOT / "configs/sweeps/lm.py")


@pytest.fixture(scope="module")
def sweep():
    return sweep_package


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def quiet(_):
    pass


def no_training(*args, **kwargs):
    raise AssertionError("train() called for a finished point")


# --------------------------------------------------------------------------- grid
def test_expand_applies_each_choice_and_keeps_base(sweep):
    config = sweep.load_sweep(f"{MQAR}:smoke")
    axes, points = sweep.expand(config)
    names = ["d_model", "lr", "mixer", "seed", "task"]
    assert [a.name for a in axes] == names
    assert len(points) == 8 and len({p.name for p in points}) == 8
    got = {(p.config.model.mixer, p.config.optimizer.learning_rate, p.config.seed) for p in points}
    assert got == {(m, lr, s) for m in ("softmax", "linear") for lr in (1e-3, 3e-3) for s in (0, 1)}
    for p in points:
        assert p.name == "_".join(f"{k}-{p.labels[k]}" for k in names)
        assert (p.config.data.seq_len, p.config.data.num_kv_pairs) == (32, 4)
        experiment_config(p.config)
    # each point is a deep copy: the shared vocab reference still links data and model
    p = points[0]
    p.config.data.vocab_size = 96
    assert p.config.model.vocab_size == 96 and points[1].config.model.vocab_size == 64
    assert config.base.model.mixer == "softmax" and config.base.optimizer.learning_rate == 1e-3

    _, only = sweep.expand(config, ["mixer=linear", "lr=0.003", "seed=1"])
    assert [p.name for p in only] == ["d_model-32_lr-0.003_mixer-linear_seed-1_task-32x4"]


def test_presets_expand_and_validate(sweep):
    sizes, mixers = {}, {}
    for path in (MQAR, LM):
        for preset in ("smoke", "cpu", "default"):
            axes, points = sweep.expand(sweep.load_sweep(f"{path}:{preset}"))
            for p in points:
                experiment_config(p.config)
            sizes[Path(path).stem, preset] = len(points)
            mixers[Path(path).stem, preset] = len(next(a for a in axes if a.name == "mixer").labels)
    # The MQAR grids' mixer lists grow as families land (swa, Based and scaled elu+1 beside the
    # registered mixers), so their sizes are per mixer.
    assert mixers["mqar", "cpu"] == mixers["mqar", "default"] >= 15
    n = mixers["mqar", "cpu"]
    assert sizes == {
        ("mqar", "smoke"): 8,
        ("mqar", "cpu"): n * 2 * 3 * 2,  # mixers x 2 widths x 3 lrs x 2 seeds
        ("mqar", "default"): n * 4 * 4 * 4 * 2,  # mixers x 4 widths x 4 tasks x 4 lrs x 2 seeds
        ("lm", "smoke"): 2,
        ("lm", "cpu"): 13,
        ("lm", "default"): 26,
    }


def test_mqar_cpu_mixer_labels_set_their_options(sweep):
    axes, points = sweep.expand(
        sweep.load_sweep(f"{MQAR}:cpu"), ["d_model=64", "lr=0.01", "seed=0"]
    )
    models = {p.labels["mixer"]: experiment_config(p.config).model for p in points}
    labels = next(a for a in axes if a.name == "mixer").labels
    assert sorted(models) == sorted(labels) and {"softmax", "based", "fox"} <= set(models)
    # rwkv7 without the base's conv (it refuses one); every other mixer keeps it
    assert models["rwkv7"].conv is False and models["deltanet"].conv == 4
    scaled, linear = models["linear_scale8"], models["linear"]
    assert (
        scaled.mixer,
        scaled.options.get("feature_scale"),
        linear.options.get("feature_scale"),
    ) == ("linear", 8.0, None)
    based = models["based"]
    assert (based.mixer, based.options["feature_dim"]) == (("taylor", "swa"), 8)
    assert models["swa"].options["window"] == based.options["window"] == 16
    # (a mixer that does not use an option leaves it unset: the config would refuse it)
    assert models["softmax"].options == {}


def test_lm_cpu_variants_match_softmax_parameter_count(sweep):
    _, points = sweep.expand(sweep.load_sweep(f"{LM}:cpu"))
    counts = {}
    for p in points:
        cfg = experiment_config(p.config)
        model = nnx.eval_shape(lambda cfg=cfg: LanguageModel(cfg.model, rngs=nnx.Rngs(0)))
        leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
        counts[p.labels["mixer"]] = sum(int(np.prod(x.shape)) for x in leaves)
    assert set(counts) == {
        *("softmax", "linear", "favor", "taylor", "retnet", "gated", "gla", "hybrid"),
        *("deltanet", "gated_deltanet", "kda", "gated_deltaproduct", "rwkv7"),
    }
    # the nearest widths: gla +1.03% at d_model 124 (122: −2.1%), kda −1.25% at 120,
    # gated_deltaproduct +1.06% at 118
    nearest = {"gla": 0.011, "kda": 0.013, "gated_deltaproduct": 0.011}
    for name, count in counts.items():
        tolerance = nearest.get(name, 0.01)
        assert abs(count / counts["softmax"] - 1) < tolerance, (name, count, counts["softmax"])


def test_run_order(sweep):
    """cpu: d_model, then lr in its listed order (1e-2 first), then mixer, seed; without an
    ``order``, a setting's runs (every lr and seed) are consecutive."""
    config = sweep.load_sweep(f"{MQAR}:cpu")
    axes, points = sweep.expand(config)
    ordered = sweep.run_order(config, axes, points)
    assert sorted(p.name for p in ordered) == sorted(p.name for p in points)
    n = 2 * len(config.grid.mixer.choices)  # every mixer, both seeds
    first = ordered[:n]
    assert {(p.labels["d_model"], p.labels["lr"]) for p in first} == {("64", "0.01")}
    assert [p.labels["seed"] for p in first[:4]] == ["0", "1", "0", "1"]
    assert [p.labels["mixer"] for p in first[:4:2]] == ["softmax", "linear"]
    assert [p.labels["lr"] for p in ordered[n : n + 1] + ordered[2 * n : 2 * n + 1]] == [
        "0.03",
        "0.003",
    ]
    assert ordered[3 * n].labels["d_model"] == "128"

    del config["order"]
    ordered = sweep.run_order(config, axes, points)
    cells = [(p.labels["d_model"], p.labels["mixer"]) for p in ordered]
    assert cells[:6] == [("64", "softmax")] * 6 and cells[6] == ("64", "linear")
    config.order = ("lr", "width")
    with pytest.raises(ValueError, match=r"order names unknown axes \['width'\]"):
        sweep.run_order(config, axes, points)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.grid.lr.update(field="optimizer.lr"), "'optimizer.lr' is not in the base"),
        (lambda c: c.grid.task.update(choices=((32, 4, 1),)), "must hold 2 values"),
        (lambda c: c.grid.lr.update(labels=("a",)), "1 labels for 2 choices"),
        (lambda c: c.grid.lr.update(labels=("a", "a")), "labels must be distinct"),
        (lambda c: c.update(tune="steps"), "tune='steps' is not a grid axis"),
    ],
)
def test_bad_grid_raises_naming_the_part(sweep, edit, message):
    config = sweep.load_sweep(f"{MQAR}:smoke")
    with config.ignore_type():
        edit(config)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        sweep.expand(config)


def test_bad_only_and_cli_errors(sweep, tmp_path, capsys):
    config = sweep.load_sweep(f"{MQAR}:smoke")
    with pytest.raises(ValueError, match=r"unknown mixer labels \['favor'\]"):
        sweep.expand(config, ["mixer=favor"])
    with pytest.raises(ValueError, match="axes: "):
        sweep.expand(config, ["width=32"])
    assert sweep.main(["--config", f"{MQAR}:smoke", "--workdir", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "8 points" in out and "11,296 params" in out
    assert not (tmp_path / "runs").exists()
    args = ["--config", f"{MQAR}:nope", "--workdir", str(tmp_path)]
    assert sweep.main(args) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err


def test_pallas_method_off_a_tpu_stops_the_sweep_before_any_run(sweep, tmp_path, capsys):
    """A grid whose runs take method="pallas" on the CPU: the usage error, exit 2 and no run
    folder; its dry run still lists the grid."""
    spec = tmp_path / "pallas_sweep.py"
    spec.write_text(
        "from linear_attention.training.sweep import load_sweep\n\n\n"
        "def get_config(arg=None):\n"
        f"    config = load_sweep({MQAR + ':smoke'!r})\n"
        "    config.base.model.options.method = 'pallas'\n"
        "    return config\n"
    )
    args = ["--config", str(spec), "--workdir", str(tmp_path / "w"), "--only", "mixer=linear"]
    assert sweep.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "sweep: error: config.model.options.method = 'pallas' runs the Pallas kernels, which need"
    )
    assert "this machine's backend is 'cpu'" in err
    assert not (tmp_path / "w").exists()
    assert sweep.main([*args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 points") and out.count("mixer-linear_seed-") == 4


def test_dry_run_counts_the_parameters_of_the_model_as_trained(sweep):
    # learned positions: max_length (2048) rows, not the training context's 32
    config = sweep.load_sweep(f"{MQAR}:smoke")
    config.base.model.position = "learned"
    axes, points = sweep.prepare(config)
    lines = []
    sweep.dry_run(axes, points[:1], log=lines.append)
    model = LanguageModel(experiment_config(points[0].config).model, rngs=nnx.Rngs(0))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert params == 11_296 + 2048 * 32
    assert f"{params:,} params" in lines[1]


# --------------------------------------------------------------------------- selection
def test_lr_tuned_by_mean_over_seeds_and_diverged_runs(sweep, tmp_path, monkeypatch):
    """Runs replaced by files with chosen accuracies (mixer, lr, seed). softmax: lr 1e-3 holds
    the single best run (0.9) but the lower mean (0.5 against 0.55), so 3e-3 is chosen;
    linear: lr 3e-3 has the best run (0.99) and a diverged seed, so it is not eligible and
    1e-3 is chosen. Diverged runs are recorded; an all-diverged setting keeps a diverged row."""
    config = sweep.load_sweep(f"{MQAR}:smoke")
    accuracy = {
        ("softmax", 1e-3, 0): 0.9,
        ("softmax", 1e-3, 1): 0.1,
        ("softmax", 3e-3, 0): 0.6,
        ("softmax", 3e-3, 1): 0.5,
        ("linear", 1e-3, 0): 0.3,
        ("linear", 1e-3, 1): 0.4,
        ("linear", 3e-3, 1): 0.99,
    }

    def fake_train(config, workdir, *, reporter):
        cfg = experiment_config(config)
        write_json(f"{workdir}/config.json", json.loads(json.dumps(cfg.to_dict())))
        key = (cfg.model.mixer, cfg.optimizer.learning_rate, cfg.seed)
        if key not in accuracy:
            raise NonFiniteLossError("non-finite loss at step 3")
        write_json(f"{workdir}/summary.json", {"eval/accuracy": accuracy[key], "step": 6})

    monkeypatch.setattr(sweep_points, "train", fake_train)
    # --only trains a subset; the tables still list the whole grid, the rest pending
    result = sweep.run(config, tmp_path, only=["mixer=softmax"], log=quiet)
    status = {(r["mixer"], r["lr"], r["seed"]) for r in read_csv(tmp_path / "results.csv")}
    assert len(status) == 8
    rows = read_csv(tmp_path / "results.csv")
    assert {r["status"] for r in rows if r["mixer"] == "linear"} == {"pending"}
    assert [(r["mixer"], r["lr"]) for r in result["best"]] == [("softmax", "0.003")]

    result = sweep.run(config, tmp_path, log=quiet)
    rows = {(r["mixer"], r["lr"], r["seed"]): r for r in read_csv(tmp_path / "results.csv")}
    for key, value in accuracy.items():
        row = rows[key[0], f"{key[1]:g}", str(key[2])]
        assert float(row["eval/accuracy"]) == value and row["seed"] == str(key[2])
        assert row["model.mixer"] == key[0] and float(row["optimizer.learning_rate"]) == key[1]
    assert rows["linear", "0.003", "0"]["status"] == "diverged"
    best = {r["mixer"]: r for r in result["best"]}
    assert (best["softmax"]["lr"], best["linear"]["lr"]) == ("0.003", "0.001")
    assert best["softmax"]["eval/accuracy"] == pytest.approx(0.55)
    assert best["softmax"]["eval/accuracy min"] == 0.5
    assert best["softmax"]["eval/accuracy max"] == 0.6
    assert (
        best["softmax"]["seeds"] == 2 and best["softmax"]["eval/accuracy runs"] == "0.6000/0.5000"
    )
    assert best["linear"]["eval/accuracy"] == pytest.approx(0.35)
    md = (tmp_path / "results.md").read_text()
    assert "| softmax | 0.550 (0.500–0.600) |" in md and "| linear | 0.350 (0.300–0.400) |" in md
    cells = {r["mixer"]: r for r in read_csv(tmp_path / "best.csv")}
    assert float(cells["softmax"]["eval/accuracy"]) == pytest.approx(0.55)
    # --report-only --only: the tables of that part of the grid (here: tuned over lr 1e-3)
    part = sweep.run(config, tmp_path, only=["lr=0.001"], report_only=True, log=quiet)
    assert len(read_csv(tmp_path / "results.csv")) == 4
    best = {r["mixer"]: r for r in part["best"]}
    assert best["softmax"]["lr"] == "0.001" and best["softmax"]["eval/accuracy"] == 0.5
    sweep.run(config, tmp_path, report_only=True, log=quiet)
    # --partial: linear's lr 3e-3 made pending again; tuned over its finished lr (1e-3) only
    hidden = tmp_path / "runs" / rows["linear", "0.003", "1"]["point"]
    (hidden / "summary.json").rename(hidden / "summary.hidden")
    full = sweep.run(config, tmp_path, report_only=True, log=quiet)
    assert [r["mixer"] for r in full["best"]] == ["softmax"]  # linear has a pending run
    part = sweep.run(config, tmp_path, report_only=True, partial=True, log=quiet)
    best = {r["mixer"]: r for r in part["best"]}
    assert (best["linear"]["lr"], best["linear"]["tuned over"]) == ("0.001", "1/2")
    assert best["linear"]["eval/accuracy"] == pytest.approx(0.35)
    assert best["softmax"]["tuned over"] == "2/2"
    assert "| 0.3000/0.4000 | 1/2 | ok |" in (tmp_path / "results.md").read_text()
    (hidden / "summary.hidden").rename(hidden / "summary.json")

    # all of linear's lrs have a diverged seed: its setting keeps a diverged row
    accuracy.pop(("linear", 1e-3, 1))
    (tmp_path / "runs" / rows["linear", "0.001", "1"]["point"] / "summary.json").unlink()
    result = sweep.run(config, tmp_path, log=quiet)
    best = {r["mixer"]: r for r in result["best"]}
    assert best["linear"]["status"] == "diverged" and best["linear"]["seeds"] == 0
    assert "| linear | nan |" in (tmp_path / "results.md").read_text()


# --------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def mqar_run(sweep, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("mqar_sweep")
    config = sweep.load_sweep(f"{MQAR}:smoke")
    result = sweep.run(config, workdir, log=quiet)
    return config, workdir, result


def test_mqar_smoke_sweep_writes_sane_results(sweep, mqar_run):
    config, workdir, result = mqar_run
    rows = read_csv(workdir / "results.csv")
    assert len(rows) == 8
    for column in (
        *("model.mixer", "optimizer.learning_rate", "seed", "model.d_model", "data.seq_len"),
        *("data.num_kv_pairs", "state_bytes", "eval/accuracy", "step", "stopped_early"),
        *("train_time_sec", "wall_time_sec"),
    ):
        assert column in rows[0], column
    for row in rows:
        assert row["status"] == "ok"
        assert 0.0 <= float(row["eval/accuracy"]) <= 1.0
        summary = json.loads((workdir / "runs" / row["point"] / "summary.json").read_text())
        assert float(row["eval/accuracy"]) == summary["eval/accuracy"]
        assert int(row["param_count"]) == summary["param_count"] == 11_296
        assert (row["step"], row["stopped_early"]) == ("6", "False")
        assert json.loads((workdir / "runs" / row["point"] / "config.json").read_text())[
            "seed"
        ] == int(row["seed"])
    # the two seeds are different runs (initialisation and batches)
    by_seed = {}
    for row in rows:
        by_seed.setdefault((row["mixer"], row["lr"]), set()).add(row["eval/loss"])
    assert all(len(losses) == 2 for losses in by_seed.values())
    # best lr per mixer: the largest mean over seeds of its rows in the CSV
    best = {r["mixer"]: r for r in result["best"]}
    for mixer in ("softmax", "linear"):
        means = {}
        for r in rows:
            if r["mixer"] == mixer:
                means.setdefault(r["lr"], []).append(float(r["eval/accuracy"]))
        lr = max(means, key=lambda k: np.mean(means[k]))
        assert best[mixer]["lr"] == lr
        assert best[mixer]["eval/accuracy"] == pytest.approx(np.mean(means[lr]), abs=1e-12)
        assert best[mixer]["eval/accuracy min"] == min(means[lr])
        assert best[mixer]["eval/accuracy max"] == max(means[lr])
    # state bytes: softmax's KV cache (2·T·H·D float32 per layer at T = seq_len) against the
    # linear state (H·M·Dv + H·M, M = Dv = head dim); the conv tails are the same and cancel.
    state = {r["mixer"]: int(r["state_bytes"]) for r in rows}
    layers, heads, dim, seq = 2, 2, 16, 32
    per_layer = 2 * seq * heads * dim - (heads * dim * dim + heads * dim)
    assert state["softmax"] - state["linear"] == 4 * layers * per_layer
    for name in ("accuracy_vs_d_model.png", "accuracy_vs_state_bytes.png"):
        assert (workdir / name).read_bytes()[:4] == b"\x89PNG"
    md = (workdir / "results.md").read_text()
    assert "seq_len=32, num_kv_pairs=4" in md and md.count("| softmax |") == 2
    assert "mean (min–max) over seeds" in md


def test_report_from_results_csv_matches_the_run_folders(sweep, mqar_run, tmp_path):
    """--report-only --results-csv: the tables and figures of a finished sweep from its
    results.csv alone (no run folders) are the ones the sweep wrote; a file of another grid
    raises, and the figures' nudge is at most NUDGE either way."""
    config, workdir, result = mqar_run
    saved = tmp_path / "saved.csv"
    saved.write_text((workdir / "results.csv").read_text())
    again = sweep.run(config, tmp_path / "re", report_only=True, results_csv=saved, log=quiet)
    assert again["markdown"] == result["markdown"]
    assert read_csv(tmp_path / "re" / "best.csv") == read_csv(workdir / "best.csv")
    assert read_csv(tmp_path / "re" / "results.csv") == read_csv(workdir / "results.csv")
    for name in ("accuracy_vs_d_model.png", "accuracy_vs_state_bytes.png"):
        assert (tmp_path / "re" / name).read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "re" / "runs").exists()
    # a row with another learning rate than the grid's point of that name: another grid
    text = saved.read_text().splitlines()
    text[1] = text[1].replace(",0.001,", ",0.002,")
    saved.write_text("\n".join(text) + "\n")
    with pytest.raises(ValueError, match="optimizer.learning_rate = '0.002'.* another grid"):
        sweep.run(config, tmp_path / "re", report_only=True, results_csv=saved, log=quiet)
    with pytest.raises(ValueError, match="use it with report_only"):
        sweep.run(config, tmp_path / "re", results_csv=saved, log=quiet)
    nudge = sweep.nudge_factors(["a", "b", "c", "d"])
    assert max(nudge.values()) == pytest.approx(sweep.NUDGE) and sweep.NUDGE <= 1.03
    assert min(nudge.values()) == pytest.approx(1 / sweep.NUDGE)
    assert nudge["b"] * nudge["c"] == pytest.approx(1.0) and sweep.nudge_factors(["a"]) == {"a": 1}


def test_mqar_rerun_skips_finished_points_and_resumes_unfinished(sweep, mqar_run, monkeypatch):
    config, workdir, _ = mqar_run
    before = read_csv(workdir / "results.csv")
    real_train = sweep_points.train
    monkeypatch.setattr(sweep_points, "train", no_training)
    sweep.run(config, workdir, log=quiet)
    assert read_csv(workdir / "results.csv") == before

    # a point without summary.json (interrupted after its last checkpoint) resumes from it
    point = before[0]["point"]
    (workdir / "runs" / point / "summary.json").unlink()
    calls = []

    def counting_train(*args, **kwargs):
        calls.append(args[1])
        return real_train(*args, **kwargs)

    monkeypatch.setattr(sweep_points, "train", counting_train)
    sweep.run(config, workdir, log=quiet)
    assert calls == [str(workdir / "runs" / point)]
    summary = json.loads((workdir / "runs" / point / "summary.json").read_text())
    assert summary["resumed_from_step"] == config.base.train.num_steps
    after = {r["point"]: r for r in read_csv(workdir / "results.csv")}
    assert float(after[point]["eval/accuracy"]) == pytest.approx(
        float(before[0]["eval/accuracy"]), abs=1e-6
    )

    # a run from before a config field existed (absent from its config.json) still counts
    # as finished while the grid holds that field's default, and is refused otherwise
    saved_path = workdir / "runs" / point / "config.json"
    saved = json.loads(saved_path.read_text())
    del saved["train"]["stop_at"]
    saved_path.write_text(json.dumps(saved))
    monkeypatch.setattr(sweep_points, "train", no_training)
    sweep.run(config, workdir, log=quiet)
    config.base.train.stop_at = 0.5
    with pytest.raises(
        ValueError, match=r"config\.train\.stop_at = None but the grid now has 0\.5"
    ):
        sweep.run(config, workdir, log=quiet)
    config.base.train.stop_at = 0.0

    # the same workdir with a changed grid is refused before anything runs
    config.base.train.num_steps = 7
    with pytest.raises(ValueError, match=r"config\.train\.num_steps = 6 but the grid now has 7"):
        sweep.run(config, workdir, log=quiet)
    config.base.train.num_steps = 6


def test_interrupted_sweep_writes_the_finished_runs(sweep, mqar_run, tmp_path, monkeypatch):
    """Ctrl-C during a run leaves results.csv listing the runs finished before it (ok, with
    their metrics) and the rest pending, without a rerun or --report-only."""
    config, finished, _ = mqar_run
    workdir = tmp_path / "sweep"
    shutil.copytree(finished / "runs", workdir / "runs")
    before = read_csv(finished / "results.csv")
    stopped = [r["point"] for r in before[2:4]]
    for point in stopped:
        (workdir / "runs" / point / "summary.json").unlink()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep_points, "train", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sweep.run(config, workdir, log=quiet)
    assert not (workdir / "results.md").exists()  # the tables wait for a finished invocation
    rows = read_csv(workdir / "results.csv")
    assert [r["point"] for r in rows] == [r["point"] for r in before]
    for row, old in zip(rows, before, strict=True):
        if row["point"] in stopped:
            assert row["status"] == "pending" and row["eval/accuracy"] == ""
        else:
            assert row["status"] == "ok"
            assert float(row["eval/accuracy"]) == float(old["eval/accuracy"])


def test_lm_smoke_sweep_bits_per_byte_throughput_and_curves(sweep, tmp_path, monkeypatch):
    config = sweep.load_sweep(f"{LM}:smoke")
    result = sweep.run(config, tmp_path, log=quiet)
    rows = read_csv(tmp_path / "results.csv")
    assert [r["mixer"] for r in rows] == ["softmax", "hybrid"]
    for row in rows:
        run_dir = tmp_path / "runs" / row["point"]
        summary = json.loads((run_dir / "summary.json").read_text())
        bpb = float(row["eval/bits_per_byte"])
        assert math.isfinite(bpb) and 0 < bpb < 9
        assert bpb == pytest.approx(summary["eval/loss"] / math.log(2), rel=1e-9)
        assert float(row["tokens_per_sec"]) == summary["tokens_per_sec"] > 0
        decode = json.loads((run_dir / "decode.json").read_text())
        assert decode["decode_context"] == 32 and decode["decode_batch_size"] == 1
        assert float(row["decode_tokens_per_sec"]) == decode["decode_tokens_per_sec"] > 0
        assert decode["decode_tokens_per_sec"] == pytest.approx(
            1e3 / decode["decode_ms_per_step"], rel=1e-9
        )
    assert rows[1]["model.mixer"] == "gated+softmax"
    assert (tmp_path / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    md = result["markdown"]
    assert "| softmax | 42,080 |" in md and "| hybrid | 43,204 |" in md

    monkeypatch.setattr(sweep_points, "train", no_training)
    monkeypatch.setattr(sweep_points, "measure_decode", no_training)
    sweep.run(config, tmp_path, log=quiet)
    assert read_csv(tmp_path / "results.csv") == rows


def test_mqar_sweep_early_stop_and_parallel_workers(sweep, mqar_run, tmp_path, monkeypatch):
    """Two worker processes (--jobs 2, one XLA thread each) give the serial sweep's numbers;
    with an early stop that every run meets at its first evaluation (eval/loss <= 1e9, at
    step 3 of 6), every run ends at step 3 and a rerun trains nothing."""
    config, workdir, _ = mqar_run
    serial = {r["point"]: r for r in read_csv(workdir / "results.csv")}
    parallel = tmp_path / "parallel"
    sweep.run(config, parallel, only=["mixer=linear"], jobs=2, log=quiet)
    rows = [r for r in read_csv(parallel / "results.csv") if r["status"] != "pending"]
    assert len(rows) == 4
    for row in rows:
        ref = serial[row["point"]]
        assert float(row["eval/loss"]) == pytest.approx(float(ref["eval/loss"]), rel=1e-4)
        assert float(row["eval/accuracy"]) == pytest.approx(float(ref["eval/accuracy"]), abs=0.01)

    config.base.train.stop_metric = "eval/loss"
    config.base.train.stop_at = 1e9
    try:
        stopped = tmp_path / "stopped"
        sweep.run(config, stopped, only=["mixer=softmax", "lr=0.001"], log=quiet)
        rows = [r for r in read_csv(stopped / "results.csv") if r["status"] == "ok"]
        assert len(rows) == 2
        for row in rows:
            assert (row["step"], row["stopped_early"]) == ("3", "True")
            metrics = (stopped / "runs" / row["point"] / "metrics.jsonl").read_text().splitlines()
            assert json.loads(metrics[-1])["step"] == 3
        monkeypatch.setattr(sweep_points, "train", no_training)
        sweep.run(config, stopped, only=["mixer=softmax", "lr=0.001"], log=quiet)
    finally:
        config.base.train.stop_metric = "eval/accuracy"
        config.base.train.stop_at = 0.0


def test_point_queue_keeps_seeds_together_until_a_worker_would_idle(sweep):
    """A setting's seeds go to the worker that took its first, in a row; a worker with no
    setting left takes the last waiting seed of the setting with the most waiting."""

    def points(settings, seeds):
        return [
            sweep.Point(f"{s}{r}", {"mixer": s, "seed": r}, {}, None)
            for s in settings
            for r in range(seeds)
        ]

    def names(queue, workers):
        taken = [queue.take(w) for w in workers]
        return [None if t is None else t[1].name for t in taken]

    # Fewer settings than workers: the second worker takes seed 2, then seed 1 is left to it.
    queue = sweep.PointQueue(points("a", 3), replicate="seed")
    assert names(queue, [0, 1, 0, 1]) == ["a0", "a2", "a1", None]
    # Three settings on two workers: seeds stay together until c's second is the only one left.
    queue = sweep.PointQueue(points("abc", 2), replicate="seed")
    assert names(queue, [0, 1, 0, 1, 0, 1, 0]) == ["a0", "b0", "a1", "b1", "c0", "c1", None]
    # The last seed is taken from the setting with the most waiting, indices kept.
    queue = sweep.PointQueue(points("ab", 4), replicate="seed")
    assert [queue.take(w)[0] for w in (0, 1, 1, 1, 1)] == [0, 4, 5, 6, 7]
    assert [queue.take(w)[0] for w in (1, 1, 0)] == [3, 2, 1]
    assert queue.take(0) is None and queue.take(1) is None
    # Without a replicate axis every point is its own setting.
    queue = sweep.PointQueue(points("ab", 2))
    assert names(queue, [0, 0, 0, 0, 0]) == ["a0", "a1", "b0", "b1", None]


def test_ctrl_c_stops_parallel_workers_with_checkpoints(tmp_path):
    """SIGINT to `sweep.py --jobs 2` (a terminal's Ctrl-C reaches the parent only: workers run
    in their own session) is forwarded once: every run in progress saves a checkpoint, the sweep
    exits 130 with one line naming them and no traceback, and nothing is marked finished."""
    grid = tmp_path / "long.py"
    grid.write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('mqar_sweep', {MQAR!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n\n\n"
        "def get_config(arg=None):\n"
        "    config = module.get_config('smoke')\n"
        "    config.base.train.num_steps = 100_000\n"
        "    config.base.train.log_every = 1\n"
        "    config.base.train.eval_every = 100_000\n"
        "    config.base.train.checkpoint_every = 100_000\n"
        "    return config\n"
    )
    workdir = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "experiments/sweep.py"), "--config", str(grid)]
    proc = subprocess.Popen(
        [*command, "--workdir", str(workdir), "--jobs", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:

        def both_training():
            logs = list(workdir.glob("runs/*/train.log"))
            return len(logs) == 2 and all("step " in p.read_text() for p in logs)

        wait_until(both_training, proc, "a logged step in both workers")
        logs = list(workdir.glob("runs/*/train.log"))
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in out + err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("sweep: interrupted (") and "rerun the same command" in line
    assert line.count("checkpoint saved") == 2
    for log in logs:
        run = log.parent
        assert run.name in line
        steps = [int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
        assert steps and max(steps) > 0
        assert not (run / "summary.json").exists()
    rows = read_csv(workdir / "results.csv")  # written on the way out: nothing finished yet
    assert len(rows) == 8 and {r["status"] for r in rows} == {"pending"}


def test_the_studys_results_file_is_of_the_cpu_grid():
    """docs/studies/mqar.md redraws its tables and figures from docs/results/mqar_sweep_cpu.csv
    (`--report-only --results-csv`): every row must match a point of today's `:cpu` grid, field
    by field, and report its accuracy."""
    from linear_attention.training.sweep.grid import expand, load_sweep
    from linear_attention.training.sweep.results import rows_from_csv

    sweep = load_sweep(MQAR + ":cpu")
    axes, points = expand(sweep)
    rows = rows_from_csv(axes, points, ROOT / "docs/results/mqar_sweep_cpu.csv", sweep.base)
    done = [r for r in rows if r["status"] == "ok"]
    assert len(done) >= 137 and all(0.0 <= r["eval/accuracy"] <= 1.0 for r in done)
    assert {r["mixer"] for r in done} >= {"softmax", "deltanet", "kda", "rwkv7"}
