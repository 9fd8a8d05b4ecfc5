"""RULER-style needle prompts (`data.needles`) and the study over lengths × depths
(`evals.needle_study`, ``la-eval --needles``): prompt lengths, needle places and RULER's
string-match score against hand cases; the study scored with an oracle answering from the
prompt; the command line end to end on an imported Mamba-2 fixture."""

import json
import os
import re

import numpy as np
import pytest

from linear_attention.data.needles import NEEDLE_TASKS, NOISE, make_prompt, string_match_all
from linear_attention.data.tokenizers import ByteTokenizer
from linear_attention.evals import cli as eval_cli
from linear_attention.evals import needle_study as study
from linear_attention.training import convert
from tests.scripts import ROOT

SENTENCES = [f"Sentence number {i} of the corpus is here" for i in range(50)]
HEAD = "Some special magic values are hidden in the following text. Memorize them."


@pytest.mark.parametrize("task", sorted(NEEDLE_TASKS))
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prompts_fill_the_length_with_the_needles_at_the_depth(task, depth):
    tok, spec = ByteTokenizer(), NEEDLE_TASKS[task]
    prompt, expected = make_prompt(spec, np.random.default_rng(0), tok, 1200, depth, SENTENCES, 40)
    n = len(tok.encode(prompt))
    assert 1160 - 50 < n <= 1160  # within one sentence of the budget (1200 - 40)
    assert prompt.startswith(HEAD) and all(e in prompt for e in expected)
    hay = " ".join(NOISE if spec.haystack == "noise" else SENTENCES)
    marks = [m.start() for m in re.finditer(r"VAR \w+ = |One of the special magic", prompt)]
    assert len(marks) == max(spec.chain, spec.keys * spec.values)
    # haystack sentences (each ends with its one ".") before and after the needles
    last = prompt.index(".", marks[-1]) + 1
    question = re.search(r"What are all|Find all", prompt).start()
    before = prompt[len(HEAD) : marks[0]].count(".")
    after = prompt[last:question].count(".")
    assert before + after > 3 and before == round(depth * (before + after)), (before, after)
    assert hay.split(" ")[2] in prompt  # the chosen haystack
    if spec.chain:
        assert len(expected) == spec.chain and f"VAR {expected[1]} = VAR {expected[0]}." in prompt
    else:
        assert len(expected) == spec.queries * spec.values


def test_prompt_refuses_a_length_with_no_room():
    with pytest.raises(ValueError, match="context length 100 leaves no room for a haystack"):
        make_prompt(NEEDLE_TASKS["vt"], np.random.default_rng(0), ByteTokenizer(), 100, 0.5,
                    SENTENCES, 40)  # fmt: skip
    with pytest.raises(ValueError, match=r"depth must be in \[0, 1\], got 1.5"):
        make_prompt(NEEDLE_TASKS["vt"], np.random.default_rng(0), ByteTokenizer(), 900, 1.5,
                    SENTENCES, 40)  # fmt: skip


def test_string_match_all_by_hand():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("the number is 123", ["123", "789"]) == 0.5
    assert string_match_all("ABCDE", ["abcde"]) == 1.0 and string_match_all("", ["1"]) == 0.0


def test_every_preset_names_known_tasks_and_valid_depths():
    from tests.scripts import load_module

    presets = load_module("configs/needles.py", "configs_needles")
    for name in presets.PRESETS:
        config = presets.get_config(name)
        tasks = config.needles.split(",")
        study.check_grid(tasks, [int(n) for n in config.lengths.split(",")],
                         [float(d) for d in config.depths.split(",")], config.answer_len,
                         1 << 20)  # fmt: skip
    assert set(presets.get_config("ruler").needles.split(",")) == set(NEEDLE_TASKS)


class _Run:
    tokenizer = ByteTokenizer()
    model = None
    eot_token_id = None


def _oracle(first_only: bool):
    """Answers from the prompt: the values of the asked keys (or the chain's names)."""

    def answer(model, tokenizer, prompt, **kwargs):
        text = tokenizer.decode(prompt)
        asked = re.search(r"What are all the special magic \w+ for (.+?) mentioned", text)
        if asked is None:  # variable tracking: follow the chain
            value = re.search(r"assigned the value (\d+)", text).group(1)
            names = re.findall(rf"VAR (\w+) = {value}\.", text)
            while True:
                more = re.findall(rf"VAR (\w+) = VAR {names[-1]}\.", text)
                if not more:
                    break
                names.append(more[0])
        else:
            keys = asked.group(1).split(", ")
            names = [v for k in keys for v in re.findall(rf"for {k} is: ([\w-]+)\.", text)]
        return " ".join(names[:1] if first_only else names)

    return answer


def test_study_scores_the_answers_as_ruler_does(monkeypatch, tmp_path):
    tasks = ["niah_single_3", "niah_multivalue", "vt"]
    monkeypatch.setattr(study, "greedy_until", _oracle(first_only=False))
    cells = study.needle_study(_Run(), tasks, [800, 1000], [0.0, 1.0], samples=2,
                               sentences=SENTENCES, answer_len=20)  # fmt: skip
    assert len(cells) == 3 * 2 * 2 and all(c["score"] == 1.0 for c in cells)
    monkeypatch.setattr(study, "greedy_until", _oracle(first_only=True))
    cells = study.needle_study(_Run(), tasks, [800, 1000], [0.0, 1.0], samples=2,
                               sentences=SENTENCES, answer_len=20)  # fmt: skip
    by_task = {t: {c["score"] for c in cells if c["task"] == t} for t in tasks}
    assert by_task == {"niah_single_3": {1.0}, "niah_multivalue": {0.25}, "vt": {0.25}}
    assert study.table(cells, "vt") == (
        "| vt | depth 0 | depth 1 |\n|---:|---:|---:|\n| 800 | 25 | 25 |\n| 1000 | 25 | 25 |"
    )
    study.heat_map(str(tmp_path / "vt.png"), cells, "vt")
    assert (tmp_path / "vt.png").stat().st_size > 0


def test_la_eval_needles_end_to_end(tmp_path, capsys):
    workdir = str(tmp_path / "mamba2")
    convert.from_hf(os.path.join(ROOT, "tests", "fixtures", "hf", "mamba2"), workdir)
    data = tmp_path / "corpus.txt"
    data.write_text(" ".join(SENTENCES) + ".")
    out = tmp_path / "needles.json"
    argv = ["la-eval", "--workdir", workdir, "--needles", "niah_single_1,niah_single_2",
            "--lengths", "400", "--depths", "0,1", "--samples", "1", "--answer_len", "8",
            "--data", str(data), "--output", str(out)]  # fmt: skip
    assert eval_cli.main(argv) == 0
    record = json.loads(out.read_text())
    cells = record["cells"]
    assert [(c["task"], c["context_len"], c["depth"]) for c in cells] == [
        ("niah_single_1", 400, 0.0), ("niah_single_1", 400, 1.0),
        ("niah_single_2", 400, 0.0), ("niah_single_2", 400, 1.0),
    ]  # fmt: skip
    for c in cells:  # the score is RULER's of the answer written
        (a,) = c["answers"]
        assert c["score"] == string_match_all(a["answer"], a["expected"])
        assert len(a["answer"]) <= 8 * 6  # at most 8 tokens ("<unk>" and a space the longest)
    assert record["tables"]["niah_single_1"].startswith("| niah_single_1 | depth 0 | depth 1 |")
    assert (tmp_path / "needles_niah_single_1.png").exists()
    bad = [(["--needles", "niah_single_9", "--lengths", "160"], "unknown needle task"),
           (["--needles", "vt", "--lengths", "4096"], "must be in (8, 2048]"),
           (["--needles", "vt", "--lengths", "160", "--depths", "0,2"], "in [0, 1], got 2.0"),
           (["--needles", "vt"], "--needles needs --lengths"),
           (["--needles", "vt", "--lengths", "160", "--plot", "x.png"], "--plot goes")]  # fmt: skip
    preset = ["--needles", "configs/needles.py:smoke", "--lengths", "400", "--answer_len", "8"]
    out2 = str(tmp_path / "preset.json")
    assert eval_cli.main(["la-eval", "--workdir", workdir, *preset, "--output", out2]) == 0
    cells = json.loads(open(out2).read())["cells"]
    assert [(c["task"], c["context_len"], c["depth"], len(c["answers"])) for c in cells] == [
        ("niah_single_1", 400, d, 2) for d in (0.0, 0.5, 1.0)
    ]  # the preset's task, depths and samples; the command line's length
    bad.append((["--needles", "configs/needles.py:nope"], "unknown preset 'nope'"))
    for args, message in bad:
        o = str(tmp_path / "bad.json")
        assert eval_cli.main(["la-eval", "--workdir", workdir, *args, "--answer_len", "8",
                              "--output", o]) == 2  # fmt: skip
        assert message in capsys.readouterr().err, args
        assert not os.path.exists(o)
