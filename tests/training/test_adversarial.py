"""Faults and bad input around a run (issue 14): damaged checkpoints and workdirs, a torn
metrics line, two runs on one workdir, a config that no longer fits the saved run, and the
command line's ``la-train: error: ...`` (exit 2) for each."""

import gc
import glob
import io
import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from linear_attention.training import cli, trainer
from linear_attention.training.load import load_run
from linear_attention.training.metrics import MetricsWriter, Reporter, read_jsonl
from linear_attention.training.workdir import LOCK_NAME, RunError, WorkdirLock, verify_digest
from tests.scripts import DEADLINE_S, wait_until
from tests.training.conftest import ROOT, final_state, load_config


def smoke():
    """``configs/mqar.py:smoke``, the config `la-train --config configs/mqar.py:smoke` runs."""
    return load_config("mqar", "smoke")


class Log:
    """A `Reporter` whose messages are kept."""

    def __init__(self):
        self.stream = io.StringIO()

    def reporter(self, num_steps=6):
        return Reporter(num_steps, stream=self.stream, tty=False)

    @property
    def text(self):
        return self.stream.getvalue()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished tiny run (checkpoints 2, 4, 6) and its final state, to copy and damage."""
    workdir = str(tmp_path_factory.mktemp("base") / "run")
    summary = trainer.train(smoke(), workdir, reporter=Log().reporter())
    return workdir, summary


def _copy(finished_run, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(finished_run[0], workdir)
    return workdir


def _largest_file(step_dir):
    files = [f for f in glob.glob(f"{step_dir}/**", recursive=True) if os.path.isfile(f)]
    return max(files, key=os.path.getsize)


def _flip_a_byte(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _truncate(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


DAMAGE = {
    # what is done to step 6, and the file the report must name
    "flipped bytes": (lambda d: _flip_a_byte(_largest_file(d)), "has changed"),
    "truncated data file": (lambda d: _truncate(_largest_file(d)), "truncated"),
    "removed manifest": (
        lambda d: os.remove(f"{d}/default/manifest.ocdbt"),
        "default/manifest.ocdbt is missing",
    ),
    "empty file": (
        lambda d: open(f"{d}/_CHECKPOINT_METADATA", "w").close(),
        "_CHECKPOINT_METADATA is empty",
    ),
    "save cut short": (lambda d: os.remove(f"{d}/integrity.json"), "integrity.json is missing"),
    "every file empty": (
        lambda d: [
            open(f, "w").close() for f in glob.glob(f"{d}/**", recursive=True) if os.path.isfile(f)
        ],
        "integrity.json is damaged (JSONDecodeError",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_checkpoint_is_named_and_the_run_falls_back(finished_run, tmp_path, damage):
    workdir = _copy(finished_run, tmp_path)
    step6 = os.path.join(workdir, "checkpoints", "6")
    assert verify_digest(step6) is None
    damage_fn, named = DAMAGE[damage]
    damage_fn(step6)
    assert named in verify_digest(step6)

    log = Log()
    summary = trainer.train(smoke(), workdir, reporter=log.reporter())
    assert f"checkpoint step 6 is damaged or incomplete: {step6}" in log.text
    assert named in log.text
    assert "falling back to step 4" in log.text
    assert "resuming from step 4" in log.text and "resuming from step 6" not in log.text
    assert summary["resumed_from_step"] == 4 and summary["steps_this_run"] == 2
    # The damaged step is kept aside, and step 6 is saved afresh, intact.
    assert os.listdir(os.path.join(workdir, "checkpoints_damaged")) == ["6"]
    assert verify_digest(step6) is None
    # Steps 5 and 6 are replayed exactly: the same parameters as the uninterrupted run.
    _, a = final_state(finished_run[0], smoke())
    _, b = final_state(workdir, smoke())
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert summary["eval/loss"] == finished_run[1]["eval/loss"]
    assert [r["step"] for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]


def test_a_transformers_folder_is_not_taken_for_a_workdir(tmp_path):
    """la-train (and la-eval) given a transformers checkpoint folder as --workdir: named as
    one, nothing in it written (before: "holds a run with config.data = None")."""
    folder = tmp_path / "hf"
    shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "hf", "mamba2"), folder)
    before = sorted(os.listdir(folder))
    message = r"is a transformers checkpoint \(config.json with model_type 'mamba2'\), not a run"
    with pytest.raises(RunError, match=message):
        trainer.train(smoke(), str(folder), reporter=Log().reporter())
    with pytest.raises(ValueError, match=message):
        load_run(str(folder))
    assert sorted(os.listdir(folder)) == before


def test_no_intact_checkpoint_stops_with_the_steps_named(finished_run, tmp_path, capsys):
    workdir = _copy(finished_run, tmp_path)
    for step in (2, 4, 6):
        os.remove(os.path.join(workdir, "checkpoints", str(step), "default", "manifest.ocdbt"))
    with pytest.raises(RunError, match="no intact checkpoint .*step 6: .*step 4: .*step 2: "):
        trainer.train(smoke(), workdir, reporter=Log().reporter())
    assert not os.path.exists(os.path.join(workdir, LOCK_NAME))  # released on the error
    rc = cli.main(["la-train", "--config", "configs/mqar.py:smoke", "--workdir", workdir])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("la-train: error: no intact checkpoint")
    assert "Traceback" not in err


def test_torn_last_metrics_line_is_dropped_and_a_damaged_one_is_named(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    with open(path, "w") as f:
        f.write('{"step": 1, "train/loss": 2.0}\n{"step": 2, "train/loss": 1.5}\n{"step": 3, "tr')
    notes = []
    writer = MetricsWriter(path, resume_step=2, message=notes.append)
    assert len(notes) == 1 and "dropped a half-written last line 3" in notes[0]
    writer.write({"step": 3, "train/loss": 1.0})
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]

    with open(path, "w") as f:
        f.write('{"step": 1}\n{"step": 2, "tr\n{"step": 3}\n')
    with pytest.raises(RunError, match=r"metrics.jsonl line 2 is damaged"):
        read_jsonl(path)


def test_a_run_killed_mid_line_resumes(finished_run, tmp_path):
    workdir = _copy(finished_run, tmp_path)
    shutil.rmtree(os.path.join(workdir, "checkpoints", "6"))
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 7, "train/lo')  # the kill came mid-write
    log = Log()
    summary = trainer.train(smoke(), workdir, reporter=log.reporter())
    assert "dropped a half-written last line 7" in log.text
    assert summary["resumed_from_step"] == 4
    assert [r["step"] for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]


def test_damaged_config_json_is_named(finished_run, tmp_path):
    workdir = _copy(finished_run, tmp_path)
    open(os.path.join(workdir, "config.json"), "w").close()
    with pytest.raises(RunError, match="config.json is damaged"):
        trainer.train(smoke(), workdir, reporter=Log().reporter())


def test_damaged_summary_of_a_finished_run_is_rewritten(finished_run, tmp_path):
    workdir = _copy(finished_run, tmp_path)
    path = os.path.join(workdir, "summary.json")
    open(path, "w").close()
    log = Log()
    summary = trainer.train(smoke(), workdir, reporter=log.reporter())
    assert f"{path} is damaged: evaluating the final checkpoint again" in log.text
    assert summary["steps_this_run"] == 0
    assert json.load(open(path))["eval/loss"] == finished_run[1]["eval/loss"]


def _la_train(workdir, *overrides):
    return cli.main(
        ["la-train", "--config", "configs/mqar.py:smoke", "--workdir", str(workdir), *overrides]
    )


def test_fewer_steps_than_the_checkpoint_refuses(finished_run, tmp_path, capsys):
    workdir = _copy(finished_run, tmp_path)
    before = open(os.path.join(workdir, "config.json")).read()
    assert _la_train(workdir, "--config.train.num_steps=4") == 2
    err = capsys.readouterr().err
    assert "checkpoint at step 6, past config.train.num_steps = 4" in err
    assert "already past num_steps" in err and "Traceback" not in err
    # Nothing was written: no summary claiming step 4, the recorded config unchanged.
    assert json.load(open(os.path.join(workdir, "summary.json")))["step"] == 6
    assert open(os.path.join(workdir, "config.json")).read() == before


def test_resuming_after_an_optimizer_change_is_a_clear_error(finished_run, tmp_path, capsys):
    workdir = _copy(finished_run, tmp_path)
    before = open(os.path.join(workdir, "config.json")).read()
    # grad_clip 0 drops the clipping transform: the optimizer state has another tree.
    assert _la_train(workdir, "--config.optimizer.grad_clip=0", "--config.train.num_steps=8") == 2
    err = capsys.readouterr().err
    assert err.startswith("la-train: error: checkpoint step 6 in ")
    assert "does not fit this config's parameters and optimizer state" in err
    assert "opt_state" in err and "Traceback" not in err
    assert open(os.path.join(workdir, "config.json")).read() == before


# An error, not a warning: a restore abandoned part-way leaves orbax's pending reads to raise
# when garbage-collected ("Exception ignored in: <coroutine ...>"), as it once did here.
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_loading_into_other_shapes_is_named_and_leaves_nothing_behind(finished_run):
    config = smoke()
    config.model.d_model = 16  # the same tree, other shapes
    # the qkv conv's bias (3·d_model, under the input projections) differs first in sorted order
    want = (
        r"does not fit .* \(0/blocks/0/mixer/inputs/conv/bias has shape \(96,\) in the checkpoint, "
        r"\(48,\) here\)"
    )
    with pytest.raises(RunError, match=want):
        load_run(finished_run[0], config=config)
    gc.collect()  # whatever the failed restore left behind is collected during this test


def _text_file(tmp_path, size):
    path = tmp_path / f"text_{size}.txt"
    path.write_bytes(b"a" * size)
    return str(path)


def _unwritable_dir(tmp_path):
    if os.geteuid() != 0:
        path = tmp_path / "readonly"
        path.mkdir()
        path.chmod(0o500)
        return str(path)
    return "/proc/1"  # root writes anywhere but in procfs


@pytest.mark.parametrize(
    "case",
    ["empty text", "small text", "workdir is a file", "workdir unwritable", "too many devices"],
)
def test_cli_errors_exit_2_without_traceback(tmp_path, capsys, case):
    workdir, extra = tmp_path / "run", []
    if case in ("empty text", "small text"):
        size = 0 if case == "empty text" else 20
        extra = [
            "--config.data.path=" + _text_file(tmp_path, size),
            "--config.data.max_bytes=0",
        ]
        argv = ["la-train", "--config", "configs/lm.py:smoke", "--workdir", str(workdir), *extra]
        expected = "holds no bytes" if size == 0 else "fewer than seq_len + 1 = 33"
    else:
        argv = ["la-train", "--config", "configs/mqar.py:smoke", "--workdir", str(workdir)]
        if case == "workdir is a file":
            workdir.write_text("not a folder")
            expected = "exists and is not a folder"
        elif case == "workdir unwritable":
            argv[-1] = _unwritable_dir(tmp_path)
            expected = "is not writable"
        else:
            argv.append(f"--config.mesh.num_devices={jax.device_count() + 1}")
            expected = f"only {jax.device_count()} devices are visible"
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("la-train: error: ") and expected in err, err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- the lock
def test_second_run_on_a_busy_workdir_is_refused_and_a_dead_ones_lock_is_stale(tmp_path, capsys):
    """Two real processes: a long `la-train` holds the workdir; a second one is refused with
    the holder's pid; once the holder is killed (-9, so it cannot clean up) the lock is stale
    and a new run takes over."""
    workdir = str(tmp_path / "run")
    # Never logs or checkpoints, so the kill leaves only its lock and config behind.
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "linear_attention.training.cli",
            "--config",
            "configs/mqar.py:smoke",
            "--workdir",
            workdir,
            "--config.train.num_steps=100000",
            "--config.train.log_every=100000",
            "--config.train.eval_every=100000",
            "--config.train.checkpoint_every=100000",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lock = os.path.join(workdir, LOCK_NAME)
        wait_until(lambda: os.path.exists(lock), first, "the first run's lock")
        assert _la_train(workdir) == 2
        err = capsys.readouterr().err
        assert err.startswith("la-train: error: ")
        assert f"is in use by another run (process {first.pid} on this host" in err
        assert "Traceback" not in err
        assert os.path.exists(lock)  # the refused run left the holder's lock alone
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert os.path.exists(lock)  # killed: nothing released it

    log = Log()
    summary = trainer.train(smoke(), workdir, reporter=log.reporter())
    assert f"removed a stale lock of process {first.pid}" in log.text
    assert summary["steps_this_run"] == 6
    assert not os.path.exists(lock)  # released on exit


def test_lock_of_another_host_or_damaged_lock(tmp_path):
    workdir = str(tmp_path)
    lock = os.path.join(workdir, LOCK_NAME)
    with open(lock, "w") as f:
        json.dump({"pid": 1, "hostname": "elsewhere", "started": "2026-01-01"}, f)
    with pytest.raises(RunError, match="in use by process 1 on host 'elsewhere'"):
        WorkdirLock(workdir).acquire()

    open(lock, "w").close()  # a damaged lock file: stale
    notes = []
    with WorkdirLock(workdir, message=notes.append) as held:
        assert notes == [f"removed a damaged lock file {lock}"]
        owner = json.load(open(lock))
        assert owner["pid"] == os.getpid() and owner == {**held.owner, "started": owner["started"]}
        with pytest.raises(RunError, match=f"process {os.getpid()} on this host"):
            WorkdirLock(workdir).acquire()  # the same lock taken twice in this process
    assert not os.path.exists(lock)


def test_lock_of_a_reused_pid_is_stale(tmp_path):
    """A lock records its process's start time: the same pid with another start time is a
    reused pid (the holder died and another process got its number), so the lock is stale."""
    workdir = str(tmp_path)
    lock = os.path.join(workdir, LOCK_NAME)
    with WorkdirLock(workdir) as held:
        owner = json.load(open(lock))
    # field 22 of /proc/<pid>/stat, the process start time in clock ticks since boot
    with open(f"/proc/{os.getpid()}/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    assert owner["pid_start"] == held.owner["pid_start"] == start
    # This live process's pid, recorded with an earlier start time: another process's lock.
    with open(lock, "w") as f:
        json.dump({**owner, "pid_start": start - 1}, f)
    notes = []
    with WorkdirLock(workdir, message=notes.append):
        assert notes == [
            f"removed a stale lock of process {os.getpid()} from {lock}: pid {os.getpid()} now "
            f"belongs to another process (started at tick {start}, the lock's holder at tick "
            f"{start - 1})"
        ]
    # The right start time (or none, a lock of an older version): the holder is alive.
    for record in ({**owner}, {k: v for k, v in owner.items() if k != "pid_start"}):
        with open(lock, "w") as f:
            json.dump(record, f)
        with pytest.raises(RunError, match=f"process {os.getpid()} on this host"):
            WorkdirLock(workdir).acquire()


def test_batch_size_not_divisible_by_the_devices_exits_2(tmp_path):
    """Four forced CPU devices, a mesh of 3: the smoke batch of 8 does not split."""
    code = "import sys; from linear_attention.training import cli; sys.exit(cli.main(sys.argv))"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "--config",
            "configs/mqar.py:smoke",
            "--workdir",
            str(tmp_path / "run"),
            "--config.mesh.num_devices=3",
        ],
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        },
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(
        "la-train: error: config.train.batch_size = 8 must be divisible by the number of "
        "devices (3)"
    )
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "run")  # refused before the workdir was made


def test_a_batch_with_ids_outside_the_vocabulary_stops_the_run(tmp_path, monkeypatch):
    real_build = trainer.build_data

    def bad_build(cfg, **kwargs):
        data = real_build(cfg, **kwargs)
        real_batch = data.train_batch

        def train_batch(step, batch_size):
            batch = real_batch(step, batch_size)
            if step == 2:
                batch["inputs"] = batch["inputs"].copy()
                batch["inputs"][1, 4] = cfg.model.vocab_size
            return batch

        data.train_batch = train_batch
        return data

    monkeypatch.setattr(trainer, "build_data", bad_build)
    config = smoke()
    with pytest.raises(RunError, match=r"inputs of the batch of step 3 must be token ids in \[0, "):
        trainer.train(config, str(tmp_path / "run"), reporter=Log().reporter())
    # Labels may be IGNORE_INDEX, nothing else outside the vocabulary.
    batch = {"inputs": np.zeros((1, 3), np.int32), "labels": np.array([[-100, 5, 64]])}
    with pytest.raises(RunError, match=r"labels of here .* got 64 at index \(0, 2\)"):
        trainer.checked(batch, trainer.experiment_config(config).model, "here")
    batch["labels"][0, 2] = 63
    assert trainer.checked(batch, trainer.experiment_config(config).model, "here") is batch
