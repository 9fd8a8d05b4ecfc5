"""The training loop on a tiny MQAR run: workdir files, numbers against an independent NumPy
computation, interrupt-and-resume equality, non-finite loss handling; a packed text run."""

import io
import json
import logging
import math
import os
import signal
import struct
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from linear_attention.training import evaluation, experiment_config, make_optimizer, trainer
from linear_attention.training.checkpoint import Checkpoints
from linear_attention.training.machine import cpu_identity
from linear_attention.training.metrics import Reporter
from tests.training.conftest import final_state, full_pass, np_stats


def _read(workdir, name):
    with open(os.path.join(workdir, name)) as f:
        if name.endswith(".jsonl"):
            return [json.loads(line) for line in f]
        return json.load(f)


def _events(workdir) -> dict[str, dict[int, float]]:
    """TensorBoard scalars ``{tag: {step: value}}`` of every event file, read independently of
    the writer: TFRecord framing (u64 length, u32 crc, data, u32 crc) and the Event protobuf. A
    session START at step s (a resumed run's purge) drops earlier files' values at steps >= s."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    scalars = {}
    for name in sorted(f for f in os.listdir(workdir) if f.startswith("events.out.tfevents")):
        with open(os.path.join(workdir, name), "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                for values in scalars.values():
                    for step in [s for s in values if s >= event.step]:
                        del values[step]
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def _check_events_match_metrics(workdir):
    expected = {}
    for record in _read(workdir, "metrics.jsonl"):
        for key, value in record.items():
            if key != "step":
                expected.setdefault(key, {})[record["step"]] = value
    found = _events(workdir)
    assert set(found) == set(expected)
    for tag, values in expected.items():
        assert sorted(found[tag]) == sorted(values), tag
        np.testing.assert_allclose(
            [found[tag][s] for s in sorted(values)], [values[s] for s in sorted(values)], rtol=1e-6
        )


def test_tiny_run_writes_every_file_with_checked_numbers(tmp_path, tiny_config, capsys):
    workdir = str(tmp_path / "run")
    tiny_config.train.profile_steps = 2
    tiny_config.train.peak_flops = 1e9
    summary = trainer.train(tiny_config, workdir)
    events = [f for f in os.listdir(workdir) if f.startswith("events.out.tfevents.")]
    assert len(events) == 1
    assert sorted(set(os.listdir(workdir)) - set(events)) == [
        "checkpoints",
        "config.json",
        "metrics.jsonl",
        "plugins",
        "summary.json",
    ]
    # TensorBoard holds the records of metrics.jsonl; steps 2-3 were traced by jax.profiler.
    _check_events_match_metrics(workdir)
    (trace,) = os.listdir(os.path.join(workdir, "plugins", "profile"))
    traced = os.listdir(os.path.join(workdir, "plugins", "profile", trace))
    assert any(f.endswith(".xplane.pb") for f in traced)
    assert "profiled steps 2..3" in capsys.readouterr().out
    cfg = experiment_config(tiny_config)
    assert _read(workdir, "config.json") == json.loads(json.dumps(cfg.to_dict()))
    # keep_checkpoints=3 of the saves at 2, 4, 6.
    assert sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints"))) == [2, 4, 6]

    records = _read(workdir, "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for r in records:
        assert {"train/loss", "train/accuracy", "lr", "grad_norm"} <= set(r)
        assert ("eval/loss" in r) == (r["step"] in (3, 6))
        assert ("tokens_per_sec" in r) == (r["step"] > 1)  # step 1 compiles: not timed
        if "tokens_per_sec" in r:  # one device; MFU = FLOPs/token · tokens/s / peak
            assert r["tokens_per_sec_per_device"] == r["tokens_per_sec"]
            flops = _read(workdir, "summary.json")["flops_per_token"]
            np.testing.assert_allclose(r["mfu"], flops * r["tokens_per_sec"] / 1e9, rtol=1e-12)
    # lr used by update s (warmup 2 steps to 1e-3, then cosine to 0 over 4 steps).
    peak = 1e-3
    expected = [0.0, peak / 2] + [peak * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    np.testing.assert_allclose([r["lr"] for r in records], expected, rtol=1e-6, atol=1e-12)

    # Step 1's loss is the initial model's loss on batch 0, computed here in float64.
    data = trainer.build_data(cfg)
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.num_steps)
    model0, _ = trainer.build_model(cfg, tx)
    batch0 = data.train_batch(0, cfg.train.batch_size)
    loss0, acc0 = np_stats(model0(batch0["inputs"]), batch0["labels"])
    np.testing.assert_allclose(records[0]["train/loss"], loss0, rtol=1e-5)
    np.testing.assert_allclose(records[0]["train/accuracy"], acc0)

    # Final eval metrics: the final checkpoint's model on the whole test set, in float64.
    graphdef, state = final_state(workdir, tiny_config)
    model, _ = nnx.merge(graphdef, state)
    loss, acc = np_stats(model(data.test_inputs), data.test_labels)
    final = _read(workdir, "summary.json")
    np.testing.assert_allclose(final["eval/loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(final["eval/accuracy"], acc)
    assert records[-1]["eval/loss"] == final["eval/loss"]
    assert final["step"] == 6 and final["steps_this_run"] == 6
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert final["param_count"] == n_params
    # FLOPs per token by hand: favor (random features, 8 per head) and softmax layers of
    # d 32, 2 heads of 16, conv 4, no MLP, vocab and T from the config, chunk min(64, T).
    d, h, dh, f = 32, 2, 16, 8
    v, t = cfg.model.vocab_size, cfg.data.seq_len
    c = min(cfg.model.options.get("chunk_size") or 64, t)  # (None: favor's default chunk size, 64)
    weights = 2 * (4 * d * d + 4 * 3 * d) + v * d
    favor = 2 * h * (c * (f + dh) + 2 * f * dh)
    softmax = 2 * h * t * 2 * dh
    np.testing.assert_allclose(final["flops_per_token"], 3 * (2 * weights + favor + softmax))
    for key in ("wall_time_sec", "tokens_per_sec", "train/loss", "num_devices"):
        assert final[key] > 0
    assert summary["eval/loss"] == final["eval/loss"]
    # the machine, read independently: the CPU model from /proc/cpuinfo, jax's own version
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        lines = [ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")]
        assert final["machine"]["cpu_model"] == lines[0].split(":", 1)[1].strip()
        # (cpu_identity's reading is checked in test_machine.py; here, that the run keeps it)
        identity = cpu_identity(cpuinfo.read_text())
        assert final["machine"]["cpu_id"] == identity["cpu_id"]
        assert final["machine"]["cpu_flags"] == identity["cpu_flags"]
    assert final["machine"]["jax_version"] == jax.__version__
    assert final["machine"]["device_kind"] == jax.devices()[0].device_kind
    assert len(final["machine"]["load_avg_end"]) == 3 and "load_avg_start" not in final["machine"]


class _Interrupt(KeyboardInterrupt):
    pass


def test_interrupt_and_resume_equals_uninterrupted(tmp_path, tiny_config, monkeypatch):
    straight = str(tmp_path / "straight")
    resumed = str(tmp_path / "resumed")
    trainer.train(tiny_config, straight)

    # Interrupt while fetching the batch of step index 3 (after the checkpoint at step 2 and
    # the logged step 3): the rerun restarts from step 2, redoes step 3, redraws at 4.
    real_build = trainer.build_data

    def interrupting_build(cfg, **kwargs):
        data = real_build(cfg, **kwargs)
        real_batch = data.train_batch

        def train_batch(step, batch_size):
            if step == 3:
                raise _Interrupt
            return real_batch(step, batch_size)

        data.train_batch = train_batch
        return data

    monkeypatch.setattr(trainer, "build_data", interrupting_build)
    with pytest.raises(_Interrupt):
        trainer.train(tiny_config, resumed)
    assert sorted(os.listdir(os.path.join(resumed, "checkpoints"))) == ["2"]
    assert [r["step"] for r in _read(resumed, "metrics.jsonl")] == [1, 2, 3]
    monkeypatch.setattr(trainer, "build_data", real_build)
    summary = trainer.train(tiny_config, resumed)
    assert summary["resumed_from_step"] == 2

    _, a = final_state(straight, tiny_config)
    _, b = final_state(resumed, tiny_config)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ra, rb = _read(straight, "metrics.jsonl"), _read(resumed, "metrics.jsonl")
    assert [r["step"] for r in rb] == [1, 2, 3, 4, 5, 6]
    _check_events_match_metrics(resumed)  # step 3, logged twice, is shown once
    for x, y in zip(ra, rb, strict=True):
        for key in ("train/loss", "grad_norm", "lr", "eval/loss", "eval/accuracy"):
            assert x.get(key) == y.get(key), (x["step"], key)
    sa, sb = _read(straight, "summary.json"), _read(resumed, "summary.json")
    assert sa["eval/loss"] == sb["eval/loss"] and sa["eval/accuracy"] == sb["eval/accuracy"]
    # Timings cover both sessions: the first's up to its checkpoint at step 2 (saved with it:
    # step 2 timed, step 1 compiled) and the second's (steps 4-6 timed, step 3 compiled).
    ckpt = Checkpoints(os.path.join(resumed, "checkpoints"), keep=3)
    try:
        first = ckpt.meta(2)["timings"]
    finally:
        ckpt.close()
    assert first["timed_steps"] == 1 and sa["timed_steps"] == 5 and sb["timed_steps"] == 1 + 3
    assert sb["train_time_sec"] > first["train_time_sec"] > 0
    assert sb["compile_time_sec"] > first["compile_time_sec"] > 0
    assert sb["wall_time_sec"] > first["wall_time_sec"]
    tokens_per_step = experiment_config(tiny_config).tokens_per_step
    np.testing.assert_allclose(sb["tokens_per_sec"], 4 * tokens_per_step / sb["train_time_sec"])

    # Rerunning a finished run trains nothing and keeps its summary (timings included).
    with open(os.path.join(resumed, "summary.json")) as f:
        before = f.read()
    again = trainer.train(tiny_config, resumed)
    with open(os.path.join(resumed, "summary.json")) as f:
        assert f.read() == before
    assert again == sb and again["tokens_per_sec"] > 0 and again["train_time_sec"] > 0

    # A workdir cannot be resumed with another model.
    tiny_config.model.d_model = 16
    with pytest.raises(ValueError, match="config.model.d_model = 32, but this config has 16"):
        trainer.train(tiny_config, resumed)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, tiny_config, monkeypatch):
    workdir = str(tmp_path / "nan")
    real_step = trainer.train_step
    calls = []

    def poisoned_step(state, batch, **kw):
        state, metrics = real_step(state, batch, **kw)
        calls.append(1)
        if len(calls) == 4:  # the update that completes step 4
            metrics = dict(metrics, **{"train/loss": metrics["train/loss"] * np.nan})
        return state, metrics

    monkeypatch.setattr(trainer, "train_step", poisoned_step)
    with pytest.raises(trainer.NonFiniteLossError, match="at step 4: .*checkpoint \\(step 2\\)"):
        trainer.train(tiny_config, workdir)
    # Step 4 would have been checkpointed: the last good one (2) is the only one.
    assert os.listdir(os.path.join(workdir, "checkpoints")) == ["2"]
    assert [r["step"] for r in _read(workdir, "metrics.jsonl")] == [1, 2, 3]


def test_sigterm_saves_a_checkpoint_at_the_current_step(tmp_path, tiny_config, monkeypatch, caplog):
    """A signal mid-interval: the step in flight finishes, is checked and saved (step 3 is no
    scheduled checkpoint), and the resumed run ends with the uninterrupted run's parameters;
    the restore logs no warning (orbax's "Metadata file does not exist" used to appear)."""
    straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
    trainer.train(tiny_config, straight)
    real_build = trainer.build_data

    def signalling_build(cfg, **kwargs):
        data = real_build(cfg, **kwargs)
        real_batch = data.train_batch

        def train_batch(step, batch_size):
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return real_batch(step, batch_size)

        data.train_batch = train_batch
        return data

    monkeypatch.setattr(trainer, "build_data", signalling_build)
    out = io.StringIO()
    with pytest.raises(trainer.Interrupted, match="SIGTERM at step 3: checkpoint saved") as e:
        trainer.train(tiny_config, stopped, reporter=Reporter(6, stream=out, tty=False))
    assert e.value.step == 3 and "SIGTERM received" in out.getvalue()
    assert sorted(os.listdir(os.path.join(stopped, "checkpoints"))) == ["2", "3"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is removed again
    monkeypatch.setattr(trainer, "build_data", real_build)
    out = io.StringIO()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        summary = trainer.train(tiny_config, stopped, reporter=Reporter(6, stream=out, tty=False))
    assert "resuming from step 3" in out.getvalue() and summary["resumed_from_step"] == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [], warnings
    _, a = final_state(straight, tiny_config)
    _, b = final_state(stopped, tiny_config)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_packed_text_run_feeds_segment_ids_to_the_model(tmp_path):
    """configs/lm.py:smoke packs documents: the run trains on rows with segment ids, and the
    loss the loop computes is the model's loss *with* those segments (NumPy cross-entropy)."""
    from tests.training.conftest import load_config

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    for i in range(60):  # 60 short documents (25-80 bytes): many 32-byte rows cross a boundary
        words = rng.choice([b"def", b"x", b"=", b"(", b")", b"return", b"\n"], rng.integers(8, 25))
        (corpus / f"{i:02d}.py").write_bytes(b" ".join(words))
    config = load_config("lm", "smoke")
    assert config.data.pack
    config.data.path, config.data.max_bytes = str(corpus), 0
    config.data.val_fraction, config.data.num_val_windows = 0.2, 8
    config.train.sample_tokens = 0
    summary = trainer.train(config, str(tmp_path / "run"))
    assert math.isfinite(summary["eval/bits_per_byte"])

    cfg = experiment_config(config)
    graphdef, state = final_state(str(tmp_path / "run"), config)
    batch = trainer.build_data(cfg).train_batch(cfg.train.num_steps, cfg.train.batch_size)
    assert (batch["segment_ids"][:, -1] > 0).mean() >= 0.5
    model, _ = nnx.merge(graphdef, state)
    loss_sum, _, count = evaluation.eval_step(state, batch, graphdef=graphdef)
    want, _ = np_stats(full_pass(model, batch["inputs"], batch["segment_ids"]), batch["labels"])
    np.testing.assert_allclose(float(loss_sum / count), want, rtol=1e-5)
    unpacked, _ = np_stats(full_pass(model, batch["inputs"]), batch["labels"])
    assert abs(unpacked - want) > 1e-4  # the segments changed the loss


def test_early_stop_ends_at_the_eval_that_meets_the_threshold(tmp_path, tiny_config, monkeypatch):
    """stop_at on eval/loss set to the straight run's step-3 eval loss: the run stops at step 3
    (not at 6) with that evaluation, counts as finished on rerun, and trains on to step 6 with
    the straight run's numbers once the threshold is switched off."""
    straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
    trainer.train(tiny_config, straight)
    evals = {r["step"]: r for r in _read(straight, "metrics.jsonl") if "eval/loss" in r}
    assert sorted(evals) == [3, 6] and evals[6]["eval/loss"] < evals[3]["eval/loss"]

    tiny_config.train.stop_metric = "eval/loss"
    tiny_config.train.stop_at = evals[3]["eval/loss"]  # met at step 3 (<=), exactly
    summary = trainer.train(tiny_config, stopped)
    assert summary["stopped_early"] is True
    assert summary["step"] == summary["steps_this_run"] == 3
    assert summary["eval/loss"] == evals[3]["eval/loss"]
    assert summary["eval/accuracy"] == evals[3]["eval/accuracy"]
    assert [r["step"] for r in _read(stopped, "metrics.jsonl")] == [1, 2, 3]
    assert sorted(os.listdir(os.path.join(stopped, "checkpoints"))) == ["2", "3"]
    assert _read(stopped, "summary.json")["step"] == 3

    # A rerun with the same threshold trains nothing and keeps the summary.
    def no_step(*args, **kwargs):
        raise AssertionError("a stopped run was trained again")

    monkeypatch.setattr(trainer, "train_step", no_step)
    assert trainer.train(tiny_config, stopped) == _read(stopped, "summary.json")
    monkeypatch.undo()

    # A run saved before a config field existed (no `remat` in its config.json) resumes while
    # the field holds its default, and is refused with another value, as is a mixer option the
    # run did not set (eps: the favor layer's).
    tiny_config.train.stop_at = 0.0
    saved = _read(stopped, "config.json")
    del saved["model"]["remat"]
    with open(os.path.join(stopped, "config.json"), "w") as f:
        json.dump(saved, f)
    tiny_config.model.remat = "block"
    with pytest.raises(ValueError, match="config.model.remat = None, but this config has 'block'"):
        trainer.train(tiny_config, stopped)
    tiny_config.model.remat = "none"
    tiny_config.model.options.eps = 1e-3
    with pytest.raises(
        ValueError, match="config.model.options.eps = None, but this config has 0.001"
    ):
        trainer.train(tiny_config, stopped)
    tiny_config.model.options.eps = None

    # Switched off (or raised), the run resumes at 3 and ends as the straight run.
    summary = trainer.train(tiny_config, stopped)
    assert summary["resumed_from_step"] == 3 and summary["step"] == 6
    assert summary["stopped_early"] is False
    assert summary["eval/loss"] == _read(straight, "summary.json")["eval/loss"]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("stop_at", 1.5, r"config\.train\.stop_at must be in \[0, 1\.0\]"),
        ("stop_at", -0.1, r"config\.train\.stop_at must be in"),
        (
            "stop_metric",
            "eval/acc",
            r"unknown config\.train\.stop_metric .eval/acc. \(did you mean .eval/accuracy.\?\); ",
        ),
        ("stop_metric", "eval/bits_per_byte", "is for text data, not MQAR"),
    ],
)
def test_bad_early_stop_settings_raise(tiny_config, field, value, message):
    tiny_config.train[field] = value
    with pytest.raises(ValueError, match=message):
        experiment_config(tiny_config)
