"""Progress of long work: on a terminal one line redrawn in place, in a log a plain line at each
tenth; quick work says nothing; tokenizing a large corpus for a run shows it."""

import io

from linear_attention.data.tokenizers import train_bpe
from linear_attention.training import build_data, data_kinds, experiment_config, tokenizer_cli
from linear_attention.training.metrics import Progress
from tests.training.conftest import load_config


def test_a_log_gets_a_line_per_tenth():
    out = io.StringIO()
    progress = Progress("tokenizing", unit="characters", stream=out, tty=False)
    for done in range(0, 1001, 7):
        progress.update(done, 1000)
    progress.update(1000, 1000)
    progress.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        f"tokenizing: {n:,}/1,000 characters" for n in (0, 105, 203, 301, 406, 504, 602, 700,
                                                        805, 903, 1000)
    ]  # fmt: skip
    assert lines[-1].startswith("tokenizing: 1,000/1,000 characters (100%, ")


def test_a_terminal_gets_one_line_redrawn():
    out = io.StringIO()
    progress = Progress("training the tokenizer", stream=out, tty=True, interval=0.0)
    for done in (1, 2, 3):
        progress.update(done, 3)
    progress.close()
    text = out.getvalue()
    assert text.count("\r") == 3 and text.count("\n") == 1 and text.endswith("\n")
    assert "\rtraining the tokenizer: 3/3 (100%, " in text


def test_quick_work_says_nothing():
    out = io.StringIO()
    progress = Progress("x", stream=out, tty=False, min_total=100)
    progress.update(50, 99)
    progress.close()
    assert out.getvalue() == ""


def test_a_run_tokenizing_its_corpus_shows_progress(tmp_path, monkeypatch, capsys):
    text = "def f(x):\n    return x + 1\n" * 50
    (tmp_path / "c.txt").write_text(text)
    train_bpe([text], vocab_size=260, output=str(tmp_path / "tok.json"))
    config = load_config("lm", "smoke")
    config.data.path = str(tmp_path / "c.txt")
    config.data.tokenizer = str(tmp_path / "tok.json")
    config.data.seq_len, config.data.num_val_windows = 8, 2
    config.model.vocab_size = 260
    monkeypatch.setattr(data_kinds, "_PROGRESS_CHARACTERS", 0)
    build_data(experiment_config(config), cache_dir=str(tmp_path / "cache"))
    err = capsys.readouterr().err  # (not a terminal under pytest: plain lines)
    assert f"tokenizing the corpus: {len(text):,}/{len(text):,} characters (100%" in err
    monkeypatch.setattr(data_kinds, "_PROGRESS_CHARACTERS", 1 << 26)
    build_data(experiment_config(config), cache_dir=str(tmp_path / "cache2"))
    assert "tokenizing the corpus" not in capsys.readouterr().err


def test_la_tokenizer_train_says_each_phase_in_a_log(tmp_path, capsys):
    text = "def f(x):\n    return x + 1\n" * 50
    (tmp_path / "c.txt").write_text(text)
    argv = ["train", f"--input={tmp_path / 'c.txt'}", "--vocab_size=260"]
    assert tokenizer_cli.main([*argv, f"--output={tmp_path / 't.json'}"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"reading the corpus: {len(text):,}/{len(text):,} characters (100%")
    assert lines[1:] == ["merging pairs up to 260 tokens"]
