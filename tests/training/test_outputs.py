"""Files written for the user: ``--output`` checked before any work (a missing folder, a folder,
a folder that cannot be written in, an existing file without ``--overwrite``, a run's own file),
and writes that fail on a full disk leave nothing behind (``la-tokenizer``, `write_json`)."""

import contextlib
import json
import os
import resource
import subprocess
import sys

import pytest

from linear_attention.data.tokenizers import load_tokenizer
from linear_attention.training import tokenizer_cli
from linear_attention.training.metrics import write_json
from linear_attention.training.outputs import check_output, run_file
from tests.scripts import DEADLINE_S
from tests.training.conftest import ROOT

TEXT = "def f(x):\n    return x + 1\n" * 40


@contextlib.contextmanager
def full_disk(limit: int = 1024):
    """Files of this process can grow to ``limit`` bytes at most (as ``ulimit -f``); Python
    ignores SIGXFSZ, so a longer write fails with EFBIG ("File too large")."""
    before = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, before)


def test_check_output_refuses_before_any_work(tmp_path):
    """(/sys takes no new file, even from root, whose permissions a chmod would not stop.)"""
    (tmp_path / "old.json").write_text("{}")
    for path, kwargs, message in (
        (tmp_path, {}, "is a folder; give a file path inside it"),
        (
            tmp_path / "nope" / "a.json",
            {},
            "the folder '{}' does not exist".format(tmp_path / "nope"),
        ),
        (tmp_path / "old.json", {}, "exists; pass --overwrite to replace it"),
        ("/sys/la-output-check.json", {}, "cannot write in '/sys' ("),
    ):
        with pytest.raises(ValueError) as e:
            check_output(str(path), **kwargs)
        assert str(e.value).startswith(f"--output {str(path)!r}") and message in str(e.value)
    check_output(str(tmp_path / "old.json"), overwrite=True)
    check_output(str(tmp_path / "new.json"))
    assert sorted(os.listdir(tmp_path)) == ["old.json"]  # the write check leaves nothing


def test_a_runs_own_files_are_never_outputs(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "4").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    for name, what in (
        ("config.json", "the run's config.json"),
        ("summary.json", "the run's summary.json"),
        ("metrics.jsonl", "the run's metrics.jsonl"),
        ("checkpoints/4/meta.json", "part of the run's checkpoints/"),
        ("events.out.tfevents.1.x", "the run's TensorBoard event file"),
    ):
        assert run_file(str(run / name)) == what
        with pytest.raises(ValueError, match="choose another file"):
            check_output(str(run / name), overwrite=True)
    assert run_file(str(run / "eval_step4.json")) is None
    assert run_file(str(tmp_path / "config.json")) is None  # no run in tmp_path
    # the run being evaluated is named even before it has its config.json
    assert run_file(str(tmp_path / "w" / "summary.json"), workdir=str(tmp_path / "w")) == (
        "the run's summary.json"
    )


def test_write_json_on_a_full_disk_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "a.json"
    write_json(str(path), {"old": 1})
    with full_disk(), pytest.raises(OSError, match="File too large"):
        write_json(str(path), {"x": "y" * 5000})
    assert json.loads(path.read_text()) == {"old": 1}
    assert os.listdir(tmp_path) == ["a.json"]


def _tok(argv, capsys):
    code = tokenizer_cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_la_tokenizer_output_checks_come_before_training(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "tok.json"
    train = ["train", f"--input={corpus}", "--vocab_size=260"]
    assert _tok([*train, f"--output={out}"], capsys)[0] == 0
    before = out.read_bytes()
    for argv, message in (
        ([*train, f"--output={out}"], "exists; pass --overwrite to replace it"),
        ([*train, f"--output={tmp_path}/nope/t.json"], "does not exist"),
        (["train", f"--input={corpus}", "--vocab_size=1000000000", f"--output={tmp_path}/b.json"],
         "--vocab_size must be in [256, 16,777,216]"),
        ([*train, "--output=/sys/t.json"], "cannot write in '/sys'"),
        (["encode", f"--input={corpus}", "--tokenizer=bytes", f"--output={tmp_path}"],
         "is a folder"),
    ):  # fmt: skip
        code, _, err = _tok(argv, capsys)
        assert code == 2 and err.startswith("la-tokenizer: error: ") and message in err, err
    assert out.read_bytes() == before
    assert _tok([*train, "--vocab_size=270", f"--output={out}", "--overwrite"], capsys)[0] == 0
    assert load_tokenizer(str(out)).vocab_size == 270


def test_la_tokenizer_on_a_full_disk_says_so_and_leaves_no_file(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    for argv in (
        ["train", f"--input={corpus}", "--vocab_size=300", f"--output={tmp_path}/t.json"],
        ["encode", f"--input={corpus}", "--tokenizer=bytes", f"--output={tmp_path}/t.bin"],
    ):
        with full_disk(400):
            code, _, err = _tok(argv, capsys)
        last = err.strip().splitlines()[-1]  # (after the progress line)
        assert code == 2 and last.startswith("la-tokenizer: error: cannot write "), err
        assert last.endswith(": File too large")
        assert os.listdir(tmp_path) == ["c.txt"]


_LIMITED_RUN = """
import resource, sys
from linear_attention.training import cli
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
sys.exit(cli.main(["la-train", "--config=configs/mqar.py:smoke", f"--workdir={sys.argv[1]}",
                   "--config.train.num_steps=2", "--config.train.checkpoint_every=2"]))
"""


@pytest.mark.parametrize("limit, what", [(20_000, "checkpoint"), (1_000, "config.json")])
def test_a_full_disk_stops_the_run_with_one_line_and_no_partial_checkpoint(tmp_path, limit, what):
    """``ulimit -f``: a checkpoint (orbax's writer threads) or config.json that cannot be written
    ends in one ``la-train: error:`` line, exit 2, no traceback, and no partial step left."""
    workdir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-c", _LIMITED_RUN, str(workdir), str(limit)],
        capture_output=True, text=True, cwd=ROOT, timeout=DEADLINE_S,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("la-train: error:")]
    assert len(errors) == 1 and "File too large" in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    if what == "checkpoint":
        assert errors[0].startswith("la-train: error: checkpoint step 2 could not be written")
        assert os.listdir(workdir / "checkpoints") == []
    else:
        assert errors[0].startswith(f"la-train: error: cannot write {workdir}/config.json")
        assert not (workdir / "config.json").exists()
    assert not [name for name in os.listdir(workdir) if ".tmp" in name]


def test_a_failed_checkpoint_write_keeps_late_writer_reports_quiet(caplog):
    """The full-disk run's race, made certain: orbax's writer future fails, nobody retrieves its
    exception, and it is collected only after the `RunError` line was printed. Once a save has
    failed, the ``asyncio`` logger drops that report (CI saw it print a traceback), and still
    prints every other record."""
    import asyncio
    import gc
    import logging

    from linear_attention.training import checkpoint

    def abandoned_failure():
        loop = asyncio.new_event_loop()
        future = loop.create_future()
        future.set_exception(ValueError("OUT_OF_RANGE: File too large [os_error_code='27']"))
        loop.close()
        del future
        gc.collect()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        abandoned_failure()
        assert any("never retrieved" in r.getMessage() for r in caplog.records)  # the race's print
        caplog.clear()
        checkpoint._quiet_failed_writers()
        abandoned_failure()
        logging.getLogger("asyncio").error("another asyncio error")
    assert [r.getMessage() for r in caplog.records] == ["another asyncio error"]
    logging.getLogger("asyncio").removeFilter(checkpoint._drop_unretrieved)
