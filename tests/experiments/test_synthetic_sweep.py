"""The state-tracking and MAD sweep presets: every preset expands and validates, and the
state-tracking smoke grid runs end to end (best lr by the mean over seeds, per-length columns,
the table and the figure)."""

import csv

import numpy as np
import pytest

from linear_attention.training import experiment_config
from linear_attention.training import sweep as engine
from linear_attention.training.sweep.mixers import mixer_axis, mixer_settings
from tests.mixer_cases import MIXER_CASES
from tests.training.conftest import ROOT

SWEEPS = ROOT / "configs" / "sweeps"


# Points per mixer: tasks × learning rates × seeds. The full grids' mixer lists grow with the
# registry (rwkv7 joins when it lands), so their counts are per mixer.
@pytest.mark.parametrize(
    "spec,per_mixer,mixers",
    [
        ("state_tracking.py:cpu", 2 * 3 * 2, None),
        ("state_tracking.py:groups", 4 * 3 * 2, None),
        ("state_tracking.py:parity", 1 * 3 * 2, None),
        ("state_tracking.py:mod_arith", 1 * 3 * 2, None),
        ("state_tracking.py:s3", 1 * 3 * 2, None),
        ("state_tracking.py:s5", 1 * 3 * 2, None),
        ("state_tracking.py:s5_swaps", 1 * 3 * 2, None),
        ("state_tracking.py:a5", 1 * 3 * 2, None),
        ("state_tracking.py:s3_one_layer", 1 * 3 * 2, 2),
        ("state_tracking.py:smoke", 1 * 2 * 2, 2),
        ("mad.py:cpu", 6 * 3 * 2, None),
        ("mad.py:smoke", 1 * 3 * 2, 2),
        ("mad.py:table1", 6 * 3 * 2, 3),
    ],
)
def test_presets_expand_and_validate(spec, per_mixer, mixers):
    config = engine.load_sweep(str(SWEEPS / spec))
    axes, points = engine.expand(config)
    labels = next(a for a in axes if a.name == "mixer").labels
    if mixers is None:  # every mixer of the registry but the random-feature / learned maps
        used = set()
        for point in points:
            mixer = point.config.model.mixer
            used |= set(mixer) if isinstance(mixer, tuple) else {mixer}
        # (the rows of tests/mixer_cases.py say which mixers the CPU grids cover, and why not)
        assert {name for name, case in MIXER_CASES.items() if case.cpu_grids} <= used
    else:
        assert len(labels) == mixers
    assert len(points) == per_mixer * len(labels)
    names = {a.name for a in axes}
    assert {"task", "mixer", "lr", "seed"} <= names
    lrs = next(a for a in axes if a.name == "lr").choices
    assert len(lrs) >= 2 if spec.endswith("smoke") else len(lrs) >= 3
    for point in points:  # every point: a mixer that refuses a preset option shows here
        cfg = experiment_config(point.config)
        assert cfg.data.task == point.labels["task"]
        assert cfg.model.vocab_size >= cfg.data.tokens
        if point.labels["mixer"].endswith("_neg"):
            assert cfg.model.options.get("allow_neg_eigval")
        if point.labels["mixer"] == "based":
            assert cfg.model.mixer == ("taylor", "swa")
        # Every mixer has the preset's kernel-4 conv but rwkv7, which refuses one; unset, the
        # conv would be each mixer's default, off for all but the delta rules.
        assert cfg.model.conv == (0 if cfg.model.mixer == "rwkv7" else 4)


def test_parity_paper_sweep_is_grazzis_protocol():
    """``state_tracking.py:parity_paper``: Grazzi et al.'s parity run (2 layers, d_model 128,
    batch 256, 20,000 steps, their one rate) for both delta rules × both β ranges × 3 seeds,
    seed 0 of every mixer first, by the default (chunk) form: the scan pays at head width 4 only."""
    config = engine.load_sweep(str(SWEEPS / "state_tracking.py:parity_paper"))
    axes, points = engine.expand(config)
    assert len(points) == 4 * 3
    order = [(p.labels["seed"], p.labels["mixer"]) for p in engine.run_order(config, axes, points)]
    assert order[:4] == [
        ("0", "gated_deltanet_neg"),
        ("0", "gated_deltanet"),
        ("0", "deltanet_neg"),
        ("0", "deltanet"),
    ]
    for point in points:
        cfg = experiment_config(point.config)
        m, o, t = cfg.model, cfg.optimizer, cfg.train
        assert (m.num_layers, m.d_model, m.num_heads, m.conv, m.options.get("method")) == (
            2,
            128,
            4,
            4,
            None,
        )
        assert (t.batch_size, t.num_steps, o.warmup_steps, o.learning_rate) == (
            256,
            20_000,
            2_000,
            1e-3,
        )
        assert bool(m.options.get("allow_neg_eigval")) == point.labels["mixer"].endswith("_neg")
        assert m.mixer == point.labels["mixer"].removesuffix("_neg")


def test_parity_fork_sweep_is_the_single_layer_variant():
    """``state_tracking.py:parity_fork_1layer``: the fork's single-layer parity run (1 layer,
    d_model 16, batch 256, 20,000 steps, their one rate) for 7 mixers × 3 seeds; the delta
    rules and gated by their step-by-step scan, lstm without a conv, every β range as
    labelled."""
    config = engine.load_sweep(str(SWEEPS / "state_tracking.py:parity_fork_1layer"))
    axes, points = engine.expand(config)
    assert len(points) == 7 * 3
    order = [p.labels["mixer"] for p in engine.run_order(config, axes, points)]
    assert order[:6] == ["gated_deltanet_neg"] * 3 + ["gated_deltanet"] * 3
    methods = {}
    for point in points:
        cfg = experiment_config(point.config)
        m, o, t = cfg.model, cfg.optimizer, cfg.train
        assert (m.num_layers, m.d_model, m.num_heads) == (1, 16, 4)
        assert (t.batch_size, t.num_steps, o.warmup_steps, o.weight_decay) == (
            256,
            20_000,
            2_000,
            0,
        )
        assert o.learning_rate == 1e-3 and cfg.data.task == "parity"
        assert bool(m.options.get("allow_neg_eigval")) == point.labels["mixer"].endswith("_neg")
        methods[point.labels["mixer"]] = (m.mixer, m.options.get("method"), m.conv)
    assert methods == {
        "gated_deltanet_neg": ("gated_deltanet", "scan", 4),
        "gated_deltanet": ("gated_deltanet", "scan", 4),
        "deltanet_neg": ("deltanet", "scan", 4),
        "deltanet": ("deltanet", "scan", 4),
        "gated": ("gated", "scan", 4),
        "lstm": ("lstm", None, 0),
        "softmax": ("softmax", None, 4),
    }


def test_delta_family_labels_set_the_options():
    """``gated_deltaproduct_n<k>[_neg]`` is gated_deltaproduct with k Householder steps (and
    β ∈ (0, 2)); the other mixers leave num_householder unset."""
    config = engine.load_sweep(str(SWEEPS / "state_tracking.py:parity"))
    _, points = engine.expand(config)
    seen = {}
    for point in points:
        m = experiment_config(point.config).model
        seen[point.labels["mixer"]] = (
            m.mixer,
            m.options.get("allow_neg_eigval"),
            m.options.get("num_householder"),
        )
    assert seen["gated_deltaproduct_n1_neg"] == ("gated_deltaproduct", True, 1)
    assert seen["gated_deltaproduct_n2"] == ("gated_deltaproduct", None, 2)  # (the default)
    assert seen["kda_neg"][:2] == ("kda", True)
    assert seen["deltanet"] == ("deltanet", None, None)


def test_mixer_labels_set_only_the_fields_their_mixer_uses():
    """One label per model setting (`sweep.mixers`), written out by hand for each kind of
    label; an axis whose fields lack one a label sets raises rather than drop it."""
    unset = dict.fromkeys(
        ("allow_neg_eigval", "feature_dim", "window", "feature_scale", "num_householder")
        + ("forget_bias",)  # (fox's fox_bias5 label: every label names the fields labels set)
    )

    def expect(mixer, conv=4, **fields):
        options = {f"model.options.{k}": v for k, v in {**unset, **fields}.items()}
        return {"model.mixer": mixer, **options, "model.conv": conv}

    def settings(label):
        return mixer_settings(label, taylor_dim=8, window=16, conv=4, no_conv=0)

    assert settings("deltanet") == expect("deltanet")
    assert settings("kda_neg") == expect("kda", allow_neg_eigval=True)
    assert settings("based") == expect(("taylor", "swa"), feature_dim=8, window=16)
    assert settings("taylor") == expect("taylor", feature_dim=8)
    assert settings("swa") == expect("swa", window=16)
    assert settings("linear_scale8") == expect("linear", feature_scale=8.0)
    assert settings("gated_deltaproduct_n2_neg") == expect(
        "gated_deltaproduct", allow_neg_eigval=True, num_householder=2
    )
    assert settings("rwkv7") == expect("rwkv7", conv=0)
    axis = mixer_axis(
        ("model.mixer", "model.options.window"), ("swa", "gla"), taylor_dim=8, window=16, conv=None
    )
    assert axis.choices == (("swa", 16), ("gla", None)) and axis.labels == ("swa", "gla")
    assert mixer_axis(("model.mixer",), ("gla",), taylor_dim=8, window=16, conv=None).choices == (
        "gla",
    )
    with pytest.raises(ValueError, match="'taylor' sets {'model.options.feature_dim': 8}"):
        mixer_axis(("model.mixer",), ("gla", "taylor"), taylor_dim=8, window=16, conv=None)


@pytest.mark.slow  # 8 runs, 2 delta-rule models compiled at 3 shapes: minutes on a loaded CPU
def test_state_tracking_smoke_sweep(tmp_path):
    config = engine.load_sweep(str(SWEEPS / "state_tracking.py:smoke"))
    result = engine.run(config, tmp_path, log=lambda *_: None)
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and all(r["status"] == "ok" for r in rows)
    for column in ("task", "model.mixer", "optimizer.learning_rate", "seed", "eval/accuracy"):
        assert column in rows[0], column
    for row in rows:
        per_length = [float(row[f"eval/length_{n}/accuracy"]) for n in (12, 20)]
        assert float(row["eval/accuracy"]) == pytest.approx(np.mean(per_length))
        # (True for the *_neg labels; unset, the mixer's default False, for the others)
        assert (row["model.options.allow_neg_eigval"] == "True") == row["mixer"].endswith("_neg")
    best = {r["mixer"]: r for r in result["best"]}
    for mixer in ("gated_deltanet", "gated_deltanet_neg"):
        means = {}
        for r in rows:
            if r["mixer"] == mixer:
                means.setdefault(r["lr"], []).append(float(r["eval/accuracy"]))
        lr = max(means, key=lambda k: np.mean(means[k]))
        assert best[mixer]["lr"] == lr
        assert best[mixer]["eval/accuracy"] == pytest.approx(np.mean(means[lr]))
        assert best[mixer]["eval/accuracy min"] == min(means[lr])
        assert best[mixer]["eval/accuracy max"] == max(means[lr])
    md = (tmp_path / "results.md").read_text()
    assert "| gated_deltanet_neg |" in md and "L=12 | L=20" in md
    assert (tmp_path / "accuracy_vs_length.png").read_bytes()[:4] == b"\x89PNG"
    # The tables and figure again from results.csv alone (no run folders needed).
    again = engine.run(
        config,
        tmp_path / "redraw",
        report_only=True,
        results_csv=tmp_path / "results.csv",
        log=lambda *_: None,
    )
    assert again["markdown"] == result["markdown"]


def test_s3_one_layer_is_one_layer_with_one_and_two_householder_steps():
    """DeltaProduct's question needs one layer, β ∈ (0, 2) and n = 1 against n = 2 (2000 steps)."""
    _, points = engine.expand(engine.load_sweep(str(SWEEPS / "state_tracking.py:s3_one_layer")))
    seen = set()
    for point in points:
        cfg = experiment_config(point.config)
        assert (cfg.data.task, cfg.model.num_layers, cfg.train.num_steps) == ("s3", 1, 2000)
        assert cfg.model.mixer == "gated_deltaproduct" and cfg.model.options.get("allow_neg_eigval")
        seen.add(cfg.model.options.get("num_householder"))
    assert seen == {1, 2}


def test_heatmap_title_says_how_the_cells_were_tuned():
    from linear_attention.training.sweep.synthetic import heatmap_title

    one = [{"lr": "0.003", "tuned over": "1/1"}, {"lr": "0.003", "tuned over": "1/3"}]
    assert heatmap_title(one, "lr").endswith("(mean over seeds at lr 0.003)")
    mixed = [{"lr": "0.01", "tuned over": "3/3"}, {"lr": "0.001", "tuned over": "2/3"}]
    assert heatmap_title(mixed, "lr").endswith("(mean over seeds, best lr of 2–3)")
    full = [{"lr": "0.01", "tuned over": "3/3"}, {"lr": "0.001", "tuned over": "3/3"}]
    assert heatmap_title(full, "lr").endswith("(mean over seeds, best lr of 3)")
    assert heatmap_title(full, None).endswith("(mean over seeds)")


def test_results_csv_written_before_a_field_joined_the_grid(tmp_path):
    """``model.conv`` joined the MAD grid (for rwkv7) after docs/results/mad_table1_cpu.csv was
    first written (as here, without the column): the file's rows still match the points whose
    value is the base's, which its runs had, and a value the grid does not have still marks
    the file as another grid's."""
    from linear_attention.training.sweep.results import rows_from_csv

    sweep = engine.load_sweep(str(SWEEPS / "mad.py:table1"))
    axes, points = engine.expand(sweep)
    with open(ROOT / "docs/results/mad_table1_cpu.csv", newline="") as f:
        old = [{k: v for k, v in r.items() if k != "model.conv"} for r in csv.DictReader(f)]
    saved = tmp_path / "before_conv.csv"
    with open(saved, "w", newline="") as f:
        writer = csv.DictWriter(f, list(old[0]))
        writer.writeheader()
        writer.writerows(old)
    rows = rows_from_csv(axes, points, saved, sweep.base)
    done = {r["point"]: r for r in rows if r["status"] == "ok"}
    assert len(done) == len(old)
    first = old[0]
    assert done[first["point"]]["eval/accuracy"] == pytest.approx(float(first["eval/accuracy"]))
    other = tmp_path / "other.csv"
    with open(other, "w", newline="") as f:
        writer = csv.DictWriter(f, [*first, "model.conv"])
        writer.writeheader()
        writer.writerow({**first, "model.conv": "2"})
    with pytest.raises(ValueError, match="model.conv = '2'.* another grid"):
        rows_from_csv(axes, points, other, sweep.base)


def test_results_from_several_files_take_each_points_first_finished_row(tmp_path):
    """--results-csv given twice: a point's row is the first finished one in the order given
    (a pending row in an earlier file gives way), and a later file of another grid still
    raises although an earlier file had the point finished."""
    from linear_attention.training.sweep.results import rows_from_csv

    sweep = engine.load_sweep(str(SWEEPS / "mad.py:table1"))
    axes, points = engine.expand(sweep)
    with open(ROOT / "docs/results/mad_table1_cpu.csv", newline="") as f:
        old = list(csv.DictReader(f))

    def write(name, rows, columns=old[0]):
        path = tmp_path / name
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, list(columns))
            writer.writeheader()
            writer.writerows(rows)
        return path

    first, second = old[0]["point"], old[1]["point"]
    a = write("a.csv", old[:1] + [{**old[1], "status": "pending"}])
    b = write("b.csv", [{**r, "eval/accuracy": "0.5"} for r in old[:2]])
    rows = {r["point"]: r for r in rows_from_csv(axes, points, [a, b], sweep.base)}
    assert rows[first]["eval/accuracy"] == pytest.approx(float(old[0]["eval/accuracy"]))
    assert rows[second]["eval/accuracy"] == 0.5 and rows[second]["status"] == "ok"
    assert sum(r["status"] == "ok" for r in rows.values()) == 2
    rows = {r["point"]: r for r in rows_from_csv(axes, points, [b, a], sweep.base)}
    assert rows[first]["eval/accuracy"] == 0.5
    trimmed = write(
        "trimmed.csv",
        [{k: v for k, v in old[0].items() if k != "status"}],
        [k for k in old[0] if k != "status"],
    )
    with pytest.raises(ValueError, match="trimmed.csv: not a sweep's results.csv .no status"):
        rows_from_csv(axes, points, [a, trimmed], sweep.base)
    other = write("other.csv", [{**old[0], "optimizer.learning_rate": "0.5"}])
    with pytest.raises(ValueError, match="other.csv: point .*optimizer.learning_rate = '0.5'"):
        rows_from_csv(axes, points, [a, other], sweep.base)


def test_the_cli_redraws_a_table_from_two_results_files(tmp_path):
    """`--results-csv A --results-csv B`: the table of the union of the two files' finished
    runs (Table 1's file cut in two), equal to the table of the whole file."""
    from linear_attention.training.sweep.cli import main

    with open(ROOT / "docs/results/mad_table1_cpu.csv", newline="") as f:
        old = list(csv.DictReader(f))
    halves = []
    for i, rows in enumerate((old[::2], old[1::2])):
        halves.append(tmp_path / f"half{i}.csv")
        with open(halves[-1], "w", newline="") as f:
            writer = csv.DictWriter(f, list(old[0]))
            writer.writeheader()
            writer.writerows(rows)
    args = ["--config", str(SWEEPS / "mad.py:table1"), "--report-only", "--partial"]
    whole = [*args, "--workdir", str(tmp_path / "whole")]
    assert main([*whole, "--results-csv", str(ROOT / "docs/results/mad_table1_cpu.csv")]) == 0
    both = [*args, "--workdir", str(tmp_path / "both")]
    assert main([*both, *(a for h in halves for a in ("--results-csv", str(h)))]) == 0
    with open(tmp_path / "both" / "results.csv", newline="") as f:
        done = {r["point"] for r in csv.DictReader(f) if r["status"] == "ok"}
    assert done == {r["point"] for r in old} and len(done) == len(old) >= 44
    for name in ("results.md", "best.csv"):
        assert (tmp_path / "both" / name).read_text() == (tmp_path / "whole" / name).read_text()


# MAD's settings per task, counted from mad-lab's configs/tasks/*.yml (the baseline and one
# run per value of each change).
MAD_SETTING_COUNTS = {
    "in_context_recall": 1 + 3 + 3 + 4,
    "noisy_recall": 1 + 3 + 3 + 4 + 3,
    "fuzzy_recall": 1 + 3 + 3 + 4,
    "selective_copying": 1 + 3 + 2 + 4 + 3,
    "compression": 1 + 3 + 3 + 4,
    "memorization": 1 + 5,
}


def test_mad_paper_grid_is_mads_protocol():
    """Every MAD setting × MAD's 3 rates × 2 weight decays × Table 1's mixers, one seed, each
    point a valid config at MAD's budget (200 epochs of batch 128)."""
    config = engine.load_sweep(str(SWEEPS / "mad.py:paper"))
    axes, points = engine.expand(config)
    by_name = {a.name: a for a in axes}
    assert set(by_name) == {"task", "opt", "mixer"} and config.tune == "opt"
    assert len(points) == 66 * 6 * 3
    counts = {}
    for label in by_name["task"].labels:
        counts[label.partition(".")[0]] = counts.get(label.partition(".")[0], 0) + 1
    assert counts == MAD_SETTING_COUNTS
    opts = {(p.config.optimizer.learning_rate, p.config.optimizer.weight_decay) for p in points}
    assert opts == {(lr, wd) for lr in (1e-4, 5e-4, 1e-3) for wd in (0.0, 0.1)}
    for point in points[::7]:  # a spread of the grid (every point costs a validation)
        cfg = experiment_config(point.config)
        per_epoch = -(-cfg.data.num_train_examples // 128)
        assert (cfg.train.batch_size, cfg.train.num_steps) == (128, 200 * per_epoch)
        assert cfg.optimizer.learning_rate * cfg.optimizer.min_lr_ratio == pytest.approx(1e-6)
        assert (cfg.model.d_model, cfg.model.num_layers, cfg.model.conv) == (128, 2, 0)
        heads = {"softmax": 16, "gla": 8, "deltanet": 16}[point.labels["mixer"]]
        assert cfg.model.num_heads == heads
        assert cfg.model.position == ("rope" if point.labels["mixer"] == "softmax" else "none")


def test_mad_score_is_the_mean_over_a_tasks_settings_of_the_best_runs():
    """Hand-computed: two settings of one task and one of another, each at its best of two
    optimizer choices (mad-lab's compute_model_mad_scores)."""
    from linear_attention.training.sweep.grid import Axis
    from linear_attention.training.sweep.synthetic import mad_score_table, mad_scores

    task = Axis("task", ("data.task",), (), ("a", "a.seq_len-2", "b"))
    mixer = Axis("mixer", ("model.mixer",), (), ("m",))
    best = [
        {"task": "a", "mixer": "m", "eval/accuracy": 0.9},
        {"task": "a.seq_len-2", "mixer": "m", "eval/accuracy": 0.5},
        {"task": "b", "mixer": "m", "eval/accuracy": 0.2},
    ]
    assert mad_scores(best, task, mixer) == {("m", "a"): (0.7, 2), ("m", "b"): (0.2, 1)}
    assert "| m | 0.700 (2/2) | 0.200 (1/1) | 0.450 |" in mad_score_table(best, task, mixer)
    partial = mad_score_table(best[1:], task, mixer)
    assert "| m | 0.500 (1/2) | 0.200 (1/1) |  |" in partial  # no mean until all finished


@pytest.mark.slow  # 8 runs of two models: a minute on a loaded CPU
def test_mad_paper_smoke_sweep_reports_mads_score(tmp_path):
    config = engine.load_sweep(str(SWEEPS / "mad.py:paper_smoke"))
    result = engine.run(config, tmp_path, log=lambda *_: None)
    rows = result["rows"]
    assert len(rows) == 8 and all(r["status"] == "ok" for r in rows)
    for mixer in ("softmax", "deltanet"):
        best = [
            max(
                (r for r in rows if r["mixer"] == mixer and r["task"] == t),
                key=lambda r: r["eval/accuracy"],
            )["eval/accuracy"]
            for t in ("in_context_recall", "in_context_recall.num_train_examples-32")
        ]
        assert f"| {mixer} | {np.mean(best):.3f} (2/2) |" in result["markdown"]


def test_budget_curve_is_s3_and_a5_at_1_4_16_times_the_preset():
    """Two tasks × three budgets × two mixers × two seeds at one rate; the dry run sizes it."""
    config = engine.load_sweep(str(SWEEPS / "state_tracking.py:budget"))
    axes, points = engine.expand(config)
    assert len(points) == 2 * 3 * 2 * 2
    seen = set()
    for point in points:
        cfg = experiment_config(point.config)
        assert cfg.optimizer.warmup_steps == cfg.train.num_steps // 10
        assert cfg.train.eval_every == cfg.train.num_steps and cfg.model.options.get(
            "allow_neg_eigval"
        )
        seen.add((cfg.data.task, cfg.train.num_steps, cfg.model.mixer, cfg.seed))
    assert {(t, n) for t, n, _, _ in seen} == {
        (t, n) for t in ("s3", "a5") for n in (500, 2000, 8000)
    }
    assert {m for _, _, m, _ in seen} == {"gated_deltaproduct", "gated_deltanet"}
    lines = []
    engine.run(config, "/nonexistent", dry=True, log=lines.append)
    assert lines[0].startswith("24 points") and len(lines) == 25
    assert any("8000 steps x" in line for line in lines)


def test_budget_curve_report_keeps_a_row_per_mixer_and_budget(tmp_path):
    """The budget axis is neither the table's x (task) nor its line (mixer): each (mixer,
    budget) is its own row of both tables and its own line of the figure, with the mean over
    the two seeds of that budget's runs (hand-set accuracies), not one budget's value for all."""
    from linear_attention.training.sweep.results import best_rows
    from linear_attention.training.sweep.synthetic import (
        plot_accuracy_vs_length,
        synthetic_report,
    )

    config = engine.load_sweep(str(SWEEPS / "state_tracking.py:budget"))
    axes, points = engine.expand(config)
    budgets = {"1x": 0.2, "4x": 0.5, "16x": 0.9}
    rows = []
    for point in points:
        labels = point.labels
        acc = budgets[labels["budget"]] + 0.02 * int(labels["seed"])
        acc -= 0.1 * (labels["mixer"] == "gated_deltanet_neg") + 0.05 * (labels["task"] == "a5")
        lengths = {f"eval/length_{n}/accuracy": acc - n / 1e4 for n in (40, 256)}
        rows.append({**labels, "status": "ok", "eval/accuracy": acc, **lengths})
    best = best_rows(rows, axes, config.tune, "state_tracking", config.replicate)
    assert len(best) == 2 * 3 * 2
    text = synthetic_report(rows, best, axes, config, by_length=True)
    assert "| gated_deltaproduct_n2_neg, budget 1x | 0.210 (0.200–0.220) | 0.160 " in text
    assert "| gated_deltanet_neg, budget 16x | 0.810 (0.800–0.820) | 0.760 " in text
    assert "| s3 | gated_deltaproduct_n2_neg, budget 4x | 0.506 | 0.484 |" in text
    assert text.count(", budget ") == 3 * (2 + 2 + 2 * 2)  # 2 tables of 6 rows; 12 curves
    plot_accuracy_vs_length(rows, best, axes, config, tmp_path)
    assert (tmp_path / "accuracy_vs_length.png").stat().st_size > 0
