"""experiments/length_gen.py: per-position-bucket loss of trained runs on longer windows."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from linear_attention.data.tokenizers import train_bpe
from linear_attention.training import sweep, trainer
from linear_attention.training.load import load_run, run_config
from tests.scripts import load_module
from tests.training.conftest import full_pass, load_config, np_stats

FILES, FILE_BYTES, BLOCK = 10, 2000, 200  # 20 kB: blocks of 200 bytes, 10 per file


def _train(tmp_path, corpus, name, **model):
    config = load_config("lm", "smoke")  # seq_len 32
    config.data.path, config.data.max_bytes = str(corpus), 0
    config.data.val_fraction, config.data.num_val_windows = 0.25, 4
    config.train.sample_tokens, config.train.num_steps = 0, 2
    for key, value in model.items():
        setattr(config.model, key, value)
    workdir = str(tmp_path / name)
    trainer.train(config, workdir)
    return workdir


def test_bucket_figures_match_per_token_loss(tmp_path, monkeypatch):
    lg = load_module("experiments/length_gen.py", "length_gen")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    texts = [rng.integers(97, 123, FILE_BYTES).astype(np.uint8).tobytes() for _ in range(FILES)]
    for i, text in enumerate(texts):
        (corpus / f"{i:02d}.txt").write_bytes(text)
    # gated (no positions) with max_length 64 < the 96 evaluated; softmax with a learned table
    gated = _train(tmp_path, corpus, "gated", max_length=64)
    learned = _train(
        tmp_path, corpus, "learned", mixer="softmax", position="learned", max_length=64
    )
    out = tmp_path / "out"
    args = [gated, f"sm={learned}", "--lengths", "96", "32", "--out", str(out)]
    assert lg.main(args) == 0
    result = json.loads((out / "length_gen.json").read_text())
    assert (out / "length_gen.png").stat().st_size > 0
    assert result["settings"]["edges"] == [0, 32, 64, 96]  # from the training length 32
    g, s = result["runs"]
    assert (g["label"], s["label"]) == ("gated", "sm")
    assert g["step"] == s["step"] == 2
    assert (g["eval_length"], g["windows"], s["eval_length"], s["windows"]) == (96, 50, 64, 50)
    assert "max_length" in s["bits_per_byte"]["96"] and len(s["buckets"]) == 2

    def no_evaluation(*args, **kwargs):
        raise AssertionError("a run in the JSON was evaluated again")

    (first,) = result["sessions"]
    assert first["evaluated"] == [gated, learned]
    assert first["wall_time_sec"] == result["wall_time_sec"] > 0
    # --reuse: the same runs (one relabelled) at the same steps and settings are not evaluated;
    # the first invocation's wall time is kept beside the second's
    with monkeypatch.context() as m:
        m.setattr(lg, "evaluate_run", no_evaluation)
        assert lg.main([f"g2={gated}", f"sm={learned}", *args[2:], "--reuse"]) == 0
    second = json.loads((out / "length_gen.json").read_text())
    again = second["runs"]
    assert again[0] == {**g, "label": "g2"} and again[1] == s
    assert second["sessions"][0] == first and second["sessions"][1]["evaluated"] == []
    assert second["wall_time_sec"] == second["sessions"][1]["wall_time_sec"]
    # a JSON written before `sessions` existed: its top level becomes the first session
    older = {k: v for k, v in second.items() if k != "sessions"}
    (out / "length_gen.json").write_text(json.dumps(older))
    with monkeypatch.context() as m:
        m.setattr(lg, "evaluate_run", no_evaluation)
        assert lg.main([f"g2={gated}", f"sm={learned}", *args[2:], "--reuse"]) == 0
    (carried, _) = json.loads((out / "length_gen.json").read_text())["sessions"]
    assert carried["wall_time_sec"] == second["wall_time_sec"] and carried["evaluated"] is None
    assert carried["load_avg_start"] == second["machine"]["load_avg_start"]
    # --replot: the figure again from the JSON, nothing evaluated, nothing else written
    with monkeypatch.context() as m:
        m.setattr(lg, "evaluate_run", no_evaluation)
        assert lg.main(["--replot", str(out / "length_gen.json"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "length_gen.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "length_gen.json").exists()

    # The windows: every validation block (every 4th, a whole 200-byte piece of one file) cut
    # into consecutive stretches of L + 1 bytes starting at its first byte.
    stream = b"".join(texts)
    cfg = trainer.experiment_config(run_config(gated))
    for length, per_block in ((96, 2), (32, 6)):
        want = [
            stream[b * BLOCK + k * length : b * BLOCK + k * length + length + 1]
            for b in range(3, FILES * FILE_BYTES // BLOCK, 4)
            for k in range(per_block)
        ]
        got = lg.validation_windows(cfg.data, length, max_tokens=10**6)
        assert [w.tobytes() for w in got] == want
    assert lg.validation_windows(cfg.data, 32, max_tokens=32 * 10).shape == (10, 33)

    # The figures against a float64 NumPy cross-entropy of the model's logits, token by token
    # (the gated model rebuilt with max_length 96; it has no position table).
    raw = run_config(gated)
    raw["model"]["max_length"] = 96
    model, _ = load_run(gated, config=raw)
    windows = lg.validation_windows(cfg.data, 96, max_tokens=10**6)

    def per_token_nll(model, windows):
        logits = np.asarray(full_pass(model, windows[:, :-1].astype(np.int32)), np.float64)
        labels = windows[:, 1:].astype(np.int64)
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        return logz - np.take_along_axis(logits, labels[..., None], -1)[..., 0]

    nll = per_token_nll(model, windows)  # [50, 96]
    assert g["bits_per_byte"]["96"] == pytest.approx(nll.mean() / math.log(2), rel=1e-5)
    assert g["bits_per_byte"]["32"] == pytest.approx(nll[:, :32].mean() / math.log(2), rel=1e-5)
    for bucket, (lo, hi) in zip(g["buckets"], [(0, 32), (32, 64), (64, 96)], strict=True):
        assert (bucket["start"], bucket["end"], bucket["tokens"]) == (lo, hi, 50 * (hi - lo))
        want = nll[:, lo:hi].mean() / math.log(2)
        assert bucket["bits_per_byte"] == pytest.approx(want, rel=1e-5)
    # the mean over [0, 32) is an evaluation at length 32 (causal model): the same windows cut
    # to 33 bytes, scored as training scores them
    logits = full_pass(model, windows[:, :32].astype(np.int32))
    ce = np_stats(logits, windows[:, 1:33].astype(np.int64))[0]
    assert g["bits_per_byte"]["32"] == pytest.approx(ce / math.log(2), rel=1e-5)
    # the learned table (64 rows): the same windows cut to 65 bytes
    model, _ = load_run(learned)
    nll = per_token_nll(model, windows[:, :65])
    for bucket, (lo, hi) in zip(s["buckets"], [(0, 32), (32, 64)], strict=True):
        want = nll[:, lo:hi].mean() / math.log(2)
        assert bucket["bits_per_byte"] == pytest.approx(want, rel=1e-5)


def test_bad_arguments(tmp_path):
    lg = load_module("experiments/length_gen.py", "length_gen")
    with pytest.raises(ValueError, match="--lengths"):
        lg.main(["x", "--lengths", "0", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="no run"):
        lg.main([str(tmp_path / "missing"), "--out", str(tmp_path)])
    for argv in (["--out", str(tmp_path)], ["x", "--replot", "r.json", "--out", str(tmp_path)]):
        with pytest.raises(SystemExit) as e:
            lg.main(argv)
        assert e.value.code == 2
    # a BPE run is refused before any work: the windows are bytes
    tokenizer = str(tmp_path / "tok.json")
    train_bpe(["def f(x):\n    return x\n"] * 4, vocab_size=260, output=tokenizer)
    config = load_config("lm", "smoke")
    config.data.tokenizer, config.model.vocab_size = tokenizer, 260
    (tmp_path / "bpe").mkdir()
    (tmp_path / "bpe" / "config.json").write_text(json.dumps(config.to_dict()))
    with pytest.raises(ValueError, match=r"tokenizer '.*tok\.json'; length_gen\.py evaluates"):
        lg.main([str(tmp_path / "bpe"), "--out", str(tmp_path)])
    assert lg.default_edges(128, 2048) == [0, 128, 256, 512, 1024, 2048]
    assert lg.default_edges(128, 128) == [0, 128]
    assert lg.default_edges(100, 300) == [0, 100, 200, 300]


def test_sweep_config_is_the_lm_sweep_but_mixer_and_position():
    root = "configs/sweeps"
    _, points = sweep.expand(sweep.load_sweep(f"{root}/length_gen.py:cpu"))
    _, lm_points = sweep.expand(sweep.load_sweep(f"{root}/lm.py:cpu"))
    (softmax,) = [p for p in lm_points if p.labels["mixer"] == "softmax"]
    base = trainer.experiment_config(softmax.config).to_dict()
    got = {}
    for p in points:
        cfg = trainer.experiment_config(p.config).to_dict()
        got[p.labels["mixer"]] = (cfg["model"]["mixer"], cfg["model"]["position"])
        for key in ("mixer", "position"):
            cfg["model"].pop(key)
            base["model"].pop(key, None)
        assert cfg == base, p.labels["mixer"]
    assert got == {
        "softmax-learned": ("softmax", "learned"),
        "softmax-rope": ("softmax", "rope"),
        "swa": ("swa", "none"),
    }
