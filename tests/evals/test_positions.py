"""Perplexity by position (`evals.positions`, ``la-eval --position_buckets``): blocks cut from
documents, the loss at each position against the plain forward pass in float64 NumPy, and the
bucket means against a hand computation."""

import json

import numpy as np
import pytest

from linear_attention.data.tokenizers import ByteTokenizer
from linear_attention.evals import cli as eval_cli
from linear_attention.evals.positions import bucket_means, document_blocks, position_losses
from linear_attention.evals.runs import load_text_run
from tests.evals.conftest import reference_logp


def test_blocks_start_each_document_and_skip_short_ones():
    docs = ["abcdefg", "xy", "0123456789"]
    blocks = document_blocks(docs, ByteTokenizer(), block_len=3, num_blocks=10)
    assert [bytes(b.astype(np.uint8)).decode() for b in blocks] == ["abcd", "0123", "4567"]
    assert len(document_blocks(docs, ByteTokenizer(), block_len=3, num_blocks=2)) == 2
    with pytest.raises(ValueError, match="no document holds block_len \\+ 1 = 11 tokens"):
        document_blocks(docs, ByteTokenizer(), block_len=10, num_blocks=1)


def test_bucket_means_by_hand():
    losses = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert bucket_means(losses, 2) == [
        {"start": 0, "stop": 2, "loss": 1.5},
        {"start": 2, "stop": 4, "loss": 3.5},
        {"start": 4, "stop": 5, "loss": 5.0},
    ]
    assert bucket_means(losses, 5) == [{"start": 0, "stop": 5, "loss": 3.0}]


def test_position_losses_equal_the_plain_forward_pass(converted):
    run = load_text_run(converted)
    rng = np.random.default_rng(1)
    blocks = rng.integers(1, run.model.config.vocab_size, (3, 33)).astype(np.int32)
    got = position_losses(run.model, blocks, batch_size=2)  # a batch filled with a copy
    want = np.zeros(32)
    for block in blocks:
        logp = reference_logp(run.model, block[:-1])
        want -= logp[np.arange(32), block[1:]] / len(blocks)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_la_eval_position_buckets(converted, tmp_path, capsys):
    data = tmp_path / "docs.jsonl"
    texts = ["the quick brown fox jumps over the lazy dog " * 3, "short", "a b c d e f g h " * 4]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "pos.json"
    argv = ["la-eval", "--workdir", converted, "--position_buckets", "16", "--block_len", "40",
            "--data", str(data), "--num_blocks", "4", "--output", str(out)]  # fmt: skip
    assert eval_cli.main(argv) == 0
    record = json.loads(out.read_text())
    run = load_text_run(converted)
    blocks = document_blocks(texts, run.tokenizer, 40, 4)
    assert record["num_blocks"] == len(blocks) == 4  # 3 of the first text, 1 of the third
    losses = position_losses(run.model, blocks, batch_size=4)
    np.testing.assert_allclose(record["loss_by_position"], losses, rtol=1e-6)
    assert [b["stop"] for b in record["buckets"]] == [16, 32, 40]
    assert record["buckets"][2]["loss"] == pytest.approx(losses[32:].mean(), rel=1e-6)
    assert (tmp_path / "pos.png").stat().st_size > 0
    assert eval_cli.main([*argv[:-1], str(tmp_path / "p2.json"), "--block_len", "65"]) == 2
    assert "--block_len 65 exceeds the model's max_length 64" in capsys.readouterr().err
    assert not (tmp_path / "p2.json").exists()
    assert eval_cli.main(["la-eval", "--position_buckets", "8", "--help"]) == 0
    assert "--position_buckets N [--block_len L]" in capsys.readouterr().out
