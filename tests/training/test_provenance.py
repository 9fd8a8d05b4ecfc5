"""A resumed run checks what it trains on: each checkpoint records the corpus's SHA-256, the
tokenizer's SHA-256 and vocabulary (and for token files the file's digest) with the seed/model/
data config; a resume whose corpus or tokenizer changed stops naming the change, unless
``--allow_data_change``; a workdir whose config.json is gone is checked against the record."""

import hashlib
import io
import json
import os
import shutil

import numpy as np
import pytest

from linear_attention.data.configs import TokenDataConfig
from linear_attention.data.sources import token_file_source
from linear_attention.data.tokenizers import train_bpe
from linear_attention.training import cli, eval_cli, train
from linear_attention.training.metrics import Reporter
from linear_attention.training.resume import ResumeConfigError
from linear_attention.training.run_data import data_changes, data_record
from linear_attention.training.workdir import RunError
from tests.training.conftest import load_config

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300))


def _config(folder, num_steps):
    config = load_config("lm", "smoke")
    config.data.path = str(folder / "corpus.txt")
    config.data.tokenizer = str(folder / "tok.json")
    config.data.loader = "windows"
    config.data.seq_len = 16
    config.data.num_val_windows = 4
    config.model.vocab_size = 260
    config.model.max_length = 16
    config.model.num_layers = 1
    config.train.num_steps = num_steps
    config.train.checkpoint_every = 2
    config.train.sample_tokens = 0
    return config


def _run(folder, workdir, num_steps, **kwargs):
    out = io.StringIO()
    train(_config(folder, num_steps), str(workdir), reporter=Reporter(4, stream=out), **kwargs)
    return out.getvalue()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step text run with a BPE of 260 tokens; its checkpoint records the data."""
    folder = tmp_path_factory.mktemp("provenance")
    (folder / "corpus.txt").write_text(TEXT)
    train_bpe([TEXT], vocab_size=260, output=str(folder / "tok.json"))
    _run(folder, folder / "run", 2)
    return folder


def test_the_checkpoint_records_the_data(trained):
    meta = json.load(open(trained / "run" / "checkpoints" / "2" / "meta.json"))
    data = TEXT.encode()
    corpus = hashlib.sha256(len(data).to_bytes(8, "little") + data).hexdigest()  # read_documents'
    tokenizer = hashlib.sha256((trained / "tok.json").read_bytes()).hexdigest()
    assert meta["data"] == {
        "path": str(trained / "corpus.txt"),
        "sha256": corpus,
        "tokenizer": str(trained / "tok.json"),
        "tokenizer_sha256": tokenizer,
        "vocab_size": 260,
    }
    assert meta["config"]["model"]["vocab_size"] == 260 and meta["config"]["seed"] == 0


@pytest.fixture
def copied(trained, tmp_path):
    """A copy of the trained run (on the same data files, put back as they were after)."""
    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    files = {name: (trained / name).read_bytes() for name in ("corpus.txt", "tok.json")}
    yield run
    for name, content in files.items():
        (trained / name).write_bytes(content)


def test_a_changed_corpus_or_tokenizer_stops_the_resume(trained, copied):
    run, folder = copied, trained
    # an edit inside the bytes read
    (folder / "corpus.txt").write_text(TEXT.replace("f17(", "g17("))
    with pytest.raises(RunError, match=r"the data changed since checkpoint step 2 .*: the corpus "):
        _run(folder, run, 4)
    (folder / "corpus.txt").write_text(TEXT)
    # the tokenizer replaced at the same path: same size, other merges
    train_bpe([TEXT.upper()], vocab_size=260, output=str(folder / "tok.json"))
    with pytest.raises(RunError) as e:
        _run(folder, run, 4)
    message = str(e.value)
    assert f"the tokenizer file {str(folder / 'tok.json')!r} (" in message
    assert "the corpus" not in message and "--allow_data_change" in message
    assert not (run / "checkpoints" / "4").exists()
    # the override goes on, and says so
    said = _run(folder, run, 4, allow_data_change=True)
    assert "going on with changed data (--allow_data_change): the tokenizer file" in said
    assert json.load(open(run / "summary.json"))["step"] == 4


def test_la_train_names_the_change_and_takes_the_override(trained, copied, capsys, monkeypatch):
    run = copied
    (trained / "corpus.txt").write_text(TEXT + "# one more line\n")
    argv = ["la-train", "--config=configs/lm.py:smoke", f"--workdir={run}"]
    config = _config(trained, 2)
    monkeypatch.setattr(cli, "_parse_train", lambda argv: (config, str(run), False))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("la-train: error: the data changed since checkpoint step 2")
    assert f"the corpus {str(trained / 'corpus.txt')!r} (" in err
    assert cli.main([*argv, "--allow_data_change"]) == 0  # (already trained to step 2)
    assert "going on with changed data" in capsys.readouterr().out


def test_a_deleted_config_json_is_checked_against_the_checkpoint(trained, copied):
    run = copied
    os.remove(run / "config.json")
    config = _config(trained, 4)
    config.seed = 1
    with pytest.raises(ResumeConfigError, match=r"config.seed = 0, but this config has 1"):
        train(config, str(run), reporter=Reporter(4, stream=io.StringIO()))
    # the same config: checked, said, and the finished run is found as it was
    said = _run(trained, run, 2)
    assert "config.json is missing: checked the config against checkpoint step 2" in said
    # a checkpoint from before the record: refused, not resumed unchecked
    os.remove(run / "config.json")
    meta = run / "checkpoints" / "2" / "meta.json"
    record = json.load(open(meta))
    del record["config"]
    meta.write_text(json.dumps(record))
    with pytest.raises(RunError, match="holds checkpoints but no config.json, and checkpoint"):
        _run(trained, run, 2)


def test_a_changed_token_file_is_named(tmp_path):
    path = tmp_path / "train.bin"
    ids = np.random.default_rng(0).integers(0, 200, 30000).astype(np.uint16)
    ids.tofile(path)

    def record():
        data = TokenDataConfig(kind="tokens", path=str(path), token_dtype="uint16", tokenizer="",
                               seq_len=8, val_fraction=0.1, num_val_windows=4)  # fmt: skip
        source = token_file_source(data, vocab_size=256, seed=0, batch_size=2)
        return data_record(source.provenance)

    before = record()
    assert data_changes(before, record()) == []
    ids[100] += 1  # same size
    ids.tofile(path)
    (change,) = data_changes(before, record())
    assert change.startswith(f"the token file {str(path)!r} (60000 bytes, ")
    ids[:10000].tofile(path)  # cut to a third
    (change,) = data_changes(before, record())
    assert "60000 bytes" in change and "20000 bytes" in change


def test_la_eval_says_when_the_tokenizer_file_changed(trained, copied, capsys):
    run = copied
    out = run.parent / "eval.json"
    argv = ["la-eval", f"--workdir={run}", f"--output={out}"]
    assert eval_cli.eval_main(argv) == 0
    assert capsys.readouterr().out.startswith("step 2: ")  # the same tokenizer: nothing said
    train_bpe([TEXT.upper()], vocab_size=260, output=str(trained / "tok.json"))
    assert eval_cli.eval_main([*argv, "--overwrite"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(
        "la-eval: warning: changed since the checkpoint was saved: the tokenizer file "
        f"{str(trained / 'tok.json')!r} ("
    )
    record = json.load(open(out))
    assert record["changed"]["data"][0].startswith("the tokenizer file")


@pytest.mark.slow  # a token-file run compiles its own step: ~35 s on the 2-core machine
def test_a_token_file_changed_between_run_and_resume_stops_it(tmp_path):
    path = tmp_path / "train.bin"
    ids = np.random.default_rng(0).integers(0, 64, 60000).astype(np.uint16)
    ids.tofile(path)
    config = load_config("lm_tokens", "smoke")
    config.data.path = str(path)
    config.model.vocab_size = 64
    config.train.num_steps, config.train.checkpoint_every = 2, 2

    def run(num_steps):
        config.train.num_steps = num_steps
        train(config, str(tmp_path / "run"), reporter=Reporter(4, stream=io.StringIO()))

    run(2)
    ids[:20000].tofile(path)  # cut to a third: the Grain state points past its end
    with pytest.raises(RunError, match=r"the token file .*\(120000 bytes, .* then, 40000 bytes"):
        run(4)
    ids[7] = (ids[7] + 1) % 64  # the same size, one id changed
    ids.tofile(path)
    with pytest.raises(RunError, match=r"the data changed since checkpoint step 2 .*token file"):
        run(4)
