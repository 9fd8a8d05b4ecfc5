"""Language-model data end to end: a JSONL corpus with a BPE tokenizer through the Grain loader,
killed with SIGKILL mid-epoch and rerun (same batches, same parameters as an uninterrupted
run); a uint16 token file; la-eval on another corpus in bits per byte; errors naming the file."""

import io
import json
import math
import os
import random
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention.data import IGNORE_INDEX
from linear_attention.data.tokenized import cache_key
from linear_attention.data.tokenizers import train_bpe
from linear_attention.training import build_data, cli, eval_cli, experiment_config, load_run, train
from linear_attention.training.metrics import Reporter, read_jsonl
from tests.scripts import DEADLINE_S
from tests.training.conftest import ROOT, full_pass, load_config

WORDS = "the cat sat on a mat while dogs ran around quickly and slowly near rivers".split()
KILL_AT = 5  # the subprocess dies asking for the batch of step 6 (checkpoint at step 4)

# Runs train(config, workdir) with the Grain loader patched to SIGKILL the process when it
# is asked for batch KILL_AT: a hard kill mid-run, after the checkpoint of step 4.
KILLED_RUN = """
import json, os, signal, sys
from linear_attention.data.sources import GrainData
from linear_attention.training import train
config, workdir, kill_at = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
original = GrainData.train_batch
def train_batch(self, step, batch_size):
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, step, batch_size)
GrainData.train_batch = train_batch
train(config, workdir)
"""


def _write_corpus(path, seed, n):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) + "."
            f.write(json.dumps({"text": text, "id": i}) + "\n")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_data")
    _write_corpus(folder / "train.jsonl", 0, 300)
    _write_corpus(folder / "other.jsonl", 1, 120)
    docs = [json.loads(line)["text"] for line in open(folder / "train.jsonl")]
    tokenizer = train_bpe(docs, vocab_size=300, output=str(folder / "tokenizer.json"))
    return folder, tokenizer


def _config(folder, tokenizer):
    config = load_config("lm", "smoke")
    config.data.path = str(folder / "train.jsonl")
    config.data.tokenizer = tokenizer.name
    config.data.loader = "grain"
    config.data.seq_len = 16
    config.data.num_val_windows = 8
    config.model.vocab_size = 300
    config.model.d_model = 16
    config.model.max_length = 64
    config.train.batch_size = 4
    config.train.num_steps = 7
    config.train.checkpoint_every = 2
    config.train.eval_every = 7
    config.train.sample_tokens = 0
    return config


def _params(workdir):
    model, _ = load_run(workdir)
    return jax.tree.leaves(jax.tree.map(np.asarray, model))


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    folder, tokenizer = corpus
    workdir = str(tmp_path_factory.mktemp("lm_data_runs") / "whole")
    train(_config(folder, tokenizer), workdir, reporter=Reporter(7, stream=io.StringIO()))
    return workdir


def test_sigkill_mid_epoch_then_rerun_equals_an_uninterrupted_run(corpus, uninterrupted, tmp_path):
    folder, tokenizer = corpus
    config = _config(folder, tokenizer)
    workdir = str(tmp_path / "killed")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-c", KILLED_RUN, json.dumps(config.to_dict()), workdir, str(KILL_AT)]
    killed = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert killed.returncode == -9, killed.stderr
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]
    # The epoch is far from over: 300 documents, 4 steps of 64 tokens.
    state = json.load(open(os.path.join(workdir, "checkpoints/4/data_iterator.process0.json")))
    assert state["step"] == 4 and state["iterator"]["parent_state"]["next_index"] < 300

    out = io.StringIO()
    summary = train(config, workdir, reporter=Reporter(7, stream=out))
    assert "resuming from step 4" in out.getvalue() and summary["resumed_from_step"] == 4
    whole = json.load(open(os.path.join(uninterrupted, "summary.json")))
    for key in ("eval/loss", "eval/bits_per_byte", "train/loss", "train/accuracy"):
        assert summary[key] == whole[key], key
    # Every logged step saw the same batch: the same losses and gradient norms.
    timing = ("tokens_per_sec", "tokens_per_sec_per_device", "mfu")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in timing} for r in rows]  # noqa: E731
    assert strip(read_jsonl(os.path.join(workdir, "metrics.jsonl"))) == strip(
        read_jsonl(os.path.join(uninterrupted, "metrics.jsonl"))
    )
    for a, b in zip(_params(workdir), _params(uninterrupted), strict=True):
        np.testing.assert_array_equal(a, b)


def test_summary_records_the_corpus_and_tokenizer(corpus, uninterrupted):
    folder, tokenizer = corpus
    summary = json.load(open(os.path.join(uninterrupted, "summary.json")))
    record = summary["corpus"]
    assert record["path"] == str(folder / "train.jsonl") and record["files"] == 1
    assert record["bytes"] == sum(
        len(json.loads(line)["text"].encode()) for line in open(folder / "train.jsonl")
    )
    assert record["tokenizer"] == tokenizer.name
    assert record["tokenizer_sha256"] == tokenizer.fingerprint
    assert record["python"] == ".".join(map(str, sys.version_info[:3]))
    assert math.isfinite(summary["eval/bits_per_byte"])


def test_la_eval_on_another_corpus_reports_bits_per_byte(corpus, uninterrupted, capsys):
    folder, tokenizer = corpus
    other = str(folder / "other.jsonl")
    argv = ["la-eval", f"--workdir={uninterrupted}", f"--config.data.path={other}"]
    assert eval_cli.eval_main(argv) == 0
    path = capsys.readouterr().out.split("written to ")[1].strip()
    record = json.load(open(path))
    # Independently: the model's float64 cross-entropy on the other corpus's validation
    # windows, over the bytes of the labelled tokens (each decoded on its own: ASCII text).
    model, cfg = load_run(uninterrupted)
    cfg = experiment_config({**cfg.to_dict(), "data": {**cfg.to_dict()["data"], "path": other}})
    data = build_data(cfg)
    rows = data.eval_rows
    logits = np.asarray(
        full_pass(model, jnp.asarray(rows["inputs"]), jnp.asarray(rows["segment_ids"])), np.float64
    )
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    labelled = rows["labels"] != IGNORE_INDEX
    safe = np.where(labelled, rows["labels"], 0)
    nats = (logz - np.take_along_axis(logits, safe[..., None], -1)[..., 0])[labelled].sum()
    num_bytes = sum(len(tokenizer.decode([t]).encode()) for t in rows["labels"][labelled])
    assert num_bytes > labelled.sum()  # BPE tokens cover more than a byte on average
    assert record["eval/bits_per_byte"] == pytest.approx(nats / num_bytes / math.log(2), rel=1e-5)
    assert record["overrides"] == {"config.data.path": other}


@pytest.mark.slow  # a second compile (another batch layout): ~35 s on a loaded machine
def test_uint16_token_file_trains(corpus, uninterrupted, tmp_path):
    folder, tokenizer = corpus
    provenance = json.load(open(os.path.join(uninterrupted, "summary.json")))["corpus"]
    cache = f"tokens-{cache_key(provenance, tokenizer, '')}.npz"
    with np.load(os.path.join(uninterrupted, "token_cache", cache)) as f:
        f["tokens"].astype(np.uint16).tofile(tmp_path / "train.bin")
    config = load_config("lm_tokens", "smoke")
    config.data.path = str(tmp_path / "train.bin")
    config.data.tokenizer = tokenizer.name
    base = _config(folder, tokenizer)
    config.data.seq_len, config.model, config.train = 16, base.model, base.train
    config.train.num_steps = 2
    summary = train(config, str(tmp_path / "run"), reporter=Reporter(2, stream=io.StringIO()))
    assert math.isfinite(summary["eval/bits_per_byte"]) and summary["step"] == 2
    assert summary["corpus"]["token_dtype"] == "uint16"


def test_bad_inputs_stop_before_training(corpus, tmp_path, capsys):
    folder, tokenizer = corpus
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "oops"\n')
    spec = "--config=configs/lm.py:smoke"
    common = [spec, f"--workdir={tmp_path / 'w'}", f"--config.data.tokenizer={tokenizer.name}"]
    common.append("--config.model.vocab_size=300")
    assert cli.main(["la-train", *common, f"--config.data.path={tmp_path / 'bad.jsonl'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("la-train: error: config.data: ") and "bad.jsonl, line 2: " in err
    np.array([1, 2, 300, 4] * 40, np.uint16).tofile(tmp_path / "t.bin")
    tokens = ["--config=configs/lm_tokens.py:smoke", f"--workdir={tmp_path / 'w2'}"]
    tokens += [f"--config.data.path={tmp_path / 't.bin'}", "--config.model.vocab_size=300"]
    assert cli.main(["la-train", *tokens]) == 2
    err = capsys.readouterr().err
    assert "t.bin: token 300 at index 2 is outside the vocabulary [0, 300)" in err
    assert cli.main(["la-train", spec, "--workdir=x", "--config.data.tokenizer=gpt2"]) == 2
    assert "config.data.tokenizer must be 'bytes', a tokenizer.json" in capsys.readouterr().err
    assert cli.main(["la-train", spec, "--workdir=x", "--config.data.loader=grain",
                     "--config.data.pack=False"]) == 2  # fmt: skip
    assert "config.data.loader = 'grain' packs documents" in capsys.readouterr().err
