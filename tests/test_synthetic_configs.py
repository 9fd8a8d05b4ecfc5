"""configs/mad.py and configs/state_tracking.py (and MQAR's forgetting preset): every preset
validates and builds, bad settings stop naming the numbers, and a tiny run of each data kind
trains, evaluates and records its metrics."""

import json
import math
import os

import jax
import pytest
from flax import nnx

from linear_attention.data.mad import MAD_SETTINGS, mad_num_tokens
from linear_attention.data.state_tracking import TASKS, task_vocab_size
from linear_attention.training import experiment_config, make_optimizer, train, trainer
from linear_attention.training.cli import UsageError, parse_args
from tests.training.conftest import ROOT, load_config

PRESETS = [("mad", t) for t in MAD_SETTINGS] + [("state_tracking", t) for t in TASKS]


@pytest.mark.parametrize("name,task", PRESETS)
def test_every_preset_validates_and_builds(name, task):
    cfg = experiment_config(load_config(name, task))
    assert (cfg.data.kind, cfg.data.task) == (name, task)
    if name == "mad":
        assert (cfg.data.vocab_size, cfg.data.seq_len) == MAD_SETTINGS[task]
        assert (cfg.data.num_train_examples, cfg.data.num_test_examples) == (12_800, 1_280)
        assert cfg.model.vocab_size == mad_num_tokens(task, *MAD_SETTINGS[task])
    else:
        assert cfg.model.vocab_size == task_vocab_size(task)
        assert (cfg.data.min_len, cfg.data.seq_len) == (3, 40)
        assert cfg.data.eval_lengths == (40, 64, 128, 256) == tuple(cfg.data.eval_lengths)
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.num_steps)
    model, _ = nnx.eval_shape(lambda: trainer.build_model(cfg, tx))
    graphdef, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((2, cfg.model.max_length), "int32")
    logits = jax.eval_shape(lambda s, t: nnx.merge(graphdef, s)(t), state, tokens)
    assert logits.shape == (2, cfg.model.max_length, cfg.model.vocab_size)
    with open(ROOT / "configs" / f"{name}.py") as f:
        assert f"python experiments/train.py --config configs/{name}.py:" in f.read()


@pytest.mark.slow
@pytest.mark.parametrize("name,task", PRESETS)
def test_every_preset_trains_two_steps_and_evaluates(name, task, tmp_path):
    """Each preset at its own model, lengths and vocabulary (only the batch and the evaluation
    set shrunk) goes through the trainer: 2 steps, a finite loss, every score recorded. Slow (a
    compilation per preset); the fast check of the same configs is the build test above and the
    smoke runs below."""
    config = load_config(name, task)
    config.train.num_steps = 2
    config.optimizer.warmup_steps = 1
    config.train.batch_size = 4
    config.train.eval_every = 2
    config.train.checkpoint_every = 2
    if name == "mad":
        config.data.num_test_examples = 8
    else:
        config.data.num_eval_examples = 4
    summary = train(config, str(tmp_path))
    assert summary["step"] == 2 and math.isfinite(summary["train/loss"])
    assert 0.0 <= summary["eval/accuracy"] <= 1.0
    if name == "state_tracking":
        assert all(f"eval/length_{n}/accuracy" in summary for n in (40, 64, 128, 256))


def _args(config, *extra):
    return ["la-train", f"--config={config}", "--workdir=/tmp/unused", *extra]


@pytest.mark.parametrize(
    "config,extra,message",
    [
        (
            "configs/mad.py:in_context_recall",
            ("--config.data.noise_fraction=0.5",),
            "config.data: noise_fraction=0.5 is not an option of 'in_context_recall'",
        ),
        (
            "configs/mad.py:noisy_recall",
            ("--config.data.noise_vocab_size=32",),
            "config.model.vocab_size = 32 is smaller than the data's vocabulary \\(48\\)",
        ),
        (
            "configs/mad.py:selective_copying",
            ("--config.data.num_tokens_to_copy=200",),
            "config.data: seq_len=256 must be >= 2 \\* num_tokens_to_copy = 400",
        ),
        (
            "configs/state_tracking.py:mod_arith",
            ("--config.data.eval_lengths=(40,63)",),
            "config.data: mod_arith lengths are even .* eval_lengths=\\(40, 63\\)",
        ),
        (
            "configs/state_tracking.py:parity",
            ("--config.model.max_length=128",),
            "config.model.max_length = 128 is shorter than the longest of config.data.eval_"
            "lengths = 256",
        ),
        (
            "configs/state_tracking.py:s3",
            ("--config.data.min_len=50",),
            "config.data: max_len must be >= min_len, got max_len=40, min_len=50",
        ),
        (
            "configs/mqar.py:forgetting",
            ("--config.data.num_reassignments=9",),
            "config.data: num_reassignments must be in \\[1, num_kv_pairs=8\\], got 9",
        ),
    ],
)
def test_bad_settings_stop_naming_the_numbers(config, extra, message):
    with pytest.raises(UsageError, match=message):
        parse_args(_args(config, *extra))


def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    with open(os.path.join(workdir, "summary.json")) as f:
        return records, json.load(f)


def test_state_tracking_run_records_every_length(tmp_path):
    summary = train(load_config("state_tracking", "smoke"), str(tmp_path))
    records, saved = _metrics(tmp_path)
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for record in (*evals, saved, summary):
        by_length = [record[f"eval/length_{n}/accuracy"] for n in (12, 20)]
        assert all(0.0 <= a <= 1.0 for a in by_length)
        # eval/accuracy is the mean over the lengths; parity's chance is 1/2.
        assert record["eval/accuracy"] == pytest.approx(sum(by_length) / 2)
        assert record["eval/scaled_accuracy"] == pytest.approx(2 * record["eval/accuracy"] - 1)


def test_mad_and_forgetting_runs_score_their_tasks(tmp_path):
    summary = train(load_config("mad", "smoke"), str(tmp_path / "mad"))
    assert 0.0 <= summary["eval/accuracy"] <= 1.0
    assert 0.0 <= summary["eval/token_accuracy"] <= 1.0
    records, _ = _metrics(tmp_path / "mad")
    assert "eval/token_accuracy" in records[-1]
    config = load_config("mqar", "smoke")
    config.data.num_reassignments = 1
    config.train.num_steps = 2
    summary = train(config, str(tmp_path / "forget"))
    assert summary["step"] == 2 and 0.0 <= summary["eval/accuracy"] <= 1.0


# Grazzi et al.'s files (automl/unlocking_state_tracking, xlstm/experiments/*.yaml), typed here
# from the files: layers, d_model, heads, batch, steps, warmup, weight decay; mod_arith's layers
# and batch are the paper appendix's (3 and 1,024, as the file's training count 102,400,000 =
# 100,000 steps × 1,024 has it), and parity_fork_1layer is the fork's single-layer file
# (adankow/unlocking_state_tracking).
PAPER = {
    "parity_paper": (2, 128, 4, 256, 20_000, 2_000, 0.0),
    "mod_arith_paper": (3, 128, 4, 1_024, 100_000, 10_000, 0.1),
    "parity_fork_1layer": (1, 16, 4, 256, 20_000, 2_000, 0.0),
}


@pytest.mark.parametrize("preset", PAPER)
def test_paper_presets_are_the_authors_settings_and_train(preset, tmp_path):
    cfg = experiment_config(load_config("state_tracking", preset))
    m, o, t = cfg.model, cfg.optimizer, cfg.train
    got = (m.num_layers, m.d_model, m.num_heads, t.batch_size, t.num_steps, o.warmup_steps)
    assert (*got, o.weight_decay) == PAPER[preset]
    assert (o.learning_rate, o.min_lr_ratio, o.grad_clip, o.b2) == (1e-3, 1e-3, 0.0, 0.999)
    assert (m.mixer, m.options.get("allow_neg_eigval"), cfg.data.min_len, cfg.data.seq_len) == (
        "deltanet",
        True,
        3,
        40,
    )
    assert m.tie_embeddings is False  # the files' tie_weights: false
    config = load_config("state_tracking", preset)  # two steps at the preset's own model
    config.train.update(num_steps=2, batch_size=4, eval_every=2, checkpoint_every=2)
    config.optimizer.warmup_steps = 1
    config.data.num_eval_examples = 4
    summary = train(config, str(tmp_path))
    assert summary["step"] == 2 and math.isfinite(summary["train/loss"])
    assert all(f"eval/length_{n}/accuracy" in summary for n in (40, 64, 128, 256))


# Siems et al.'s DeltaProduct runs (automl/DeltaProduct, README.md's S3 commands and
# state_tracking/src/main.py's defaults), typed here from the files: layers, d_model, heads,
# head_dim, batch, 100 epochs of ceil(99,000 / 2048) = 49 batches, warmup, weight decay, train
# length, test length, test sequences (1 % of 100,000).
GROUP_PAPER = {"s3_paper": 2, "s5_paper": 4, "a5_paper": 4}  # Householder steps, one layer


@pytest.mark.parametrize("preset", GROUP_PAPER)
def test_deltaproduct_presets_are_the_authors_settings_and_train(preset, tmp_path):
    cfg = experiment_config(load_config("state_tracking", preset))
    m, o, t, d = cfg.model, cfg.optimizer, cfg.train, cfg.data
    assert (m.num_layers, m.d_model, m.num_heads, m.head_dim) == (1, 128, 8, 32)
    assert (t.batch_size, t.num_steps, o.warmup_steps, o.weight_decay) == (2048, 100 * 49, 0, 1e-6)
    assert (o.learning_rate, o.min_lr_ratio, o.grad_clip, o.b2) == (1e-3, 0.0, 0.0, 0.999)
    assert (m.mixer, m.options.get("num_householder"), m.options.get("allow_neg_eigval")) == (
        "gated_deltaproduct",
        GROUP_PAPER[preset],
        True,
    )
    assert (m.conv, m.out_gate, m.tie_embeddings) == (0, False, False)
    assert (d.task, d.min_len, d.seq_len) == (preset.removesuffix("_paper"), 128, 128)
    assert (tuple(d.eval_lengths), d.num_eval_examples) == ((128, 512), 1000)
    config = load_config("state_tracking", preset)  # two steps at the preset's own model
    config.train.update(num_steps=2, batch_size=4, eval_every=2, checkpoint_every=2)
    config.data.num_eval_examples = 4
    summary = train(config, str(tmp_path))
    assert summary["step"] == 2 and math.isfinite(summary["train/loss"])
    assert all(f"eval/length_{n}/accuracy" in summary for n in (128, 512))


# MAD's baseline per task (mad-lab, configs/tasks/<task>.yml), typed from the files: content
# vocabulary (noisy recall: 32 less its 16 noise tokens), length, training examples.
MAD_PAPER = {
    "in_context_recall": (16, 128, 12_800),
    "noisy_recall": (16, 128, 12_800),
    "fuzzy_recall": (16, 128, 12_800),
    "selective_copying": (16, 256, 12_800),
    "compression": (16, 32, 12_800),
    "memorization": (256, 32, 256),
}


@pytest.mark.parametrize("task", MAD_PAPER)
def test_mad_paper_presets_are_mads_settings(task):
    cfg = experiment_config(load_config("mad", f"{task}_paper"))
    d, m, o, t = cfg.data, cfg.model, cfg.optimizer, cfg.train
    assert (d.vocab_size, d.seq_len, d.num_train_examples) == MAD_PAPER[task]
    assert d.num_test_examples == 1_280 and cfg.seed == 12345
    # 200 epochs of batch 128 (steps per epoch rounded up, as a DataLoader's last batch)
    assert (t.batch_size, t.num_steps) == (128, 200 * -(-MAD_PAPER[task][2] // 128))
    assert (t.eval_every, t.stop_at) == (-(-MAD_PAPER[task][2] // 128), 0.999)
    assert (m.d_model, m.num_layers, m.num_heads, m.mlp_dim, m.conv) == (128, 2, 16, 352, 0)
    assert (m.mixer, m.position, m.tie_embeddings) == ("softmax", "rope", False)
    assert (o.learning_rate, o.weight_decay, o.warmup_steps, o.grad_clip) == (5e-4, 0.0, 0, 0.0)
    assert o.learning_rate * o.min_lr_ratio == pytest.approx(1e-6)


def test_mad_paper_settings_are_presets_and_one_trains(tmp_path):
    """A change is a preset of its own (one field from the baseline); unknown ones stop."""
    cfg = experiment_config(load_config("mad", "noisy_recall_paper.noise_fraction-0.6"))
    assert (cfg.data.noise_fraction, cfg.data.seq_len, cfg.train.num_steps) == (0.6, 128, 20_000)
    cfg = experiment_config(load_config("mad", "in_context_recall_paper.num_train_examples-800"))
    assert (cfg.data.num_train_examples, cfg.train.num_steps) == (800, 200 * 7)
    with pytest.raises(UsageError, match="unknown preset 'in_context_recall_paper.seq_len-7'"):
        parse_args(_args("configs/mad.py:in_context_recall_paper.seq_len-7"))
    config = load_config("mad", "selective_copying_paper")  # two steps at MAD's own model
    config.train.update(num_steps=2, batch_size=4, eval_every=2, checkpoint_every=2)
    config.data.update(num_train_examples=8, num_test_examples=8)
    summary = train(config, str(tmp_path))
    assert summary["step"] == 2 and math.isfinite(summary["train/loss"])
    assert 0.0 <= summary["eval/accuracy"] <= 1.0
