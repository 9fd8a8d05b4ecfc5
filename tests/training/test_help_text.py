"""Plain --help text (issue 75): no reST/Markdown code quotes, and each config file's
description whole (its docstring's first paragraph, wrapped), in every la-* program's help."""

import pytest

from linear_attention.evals import cli as evals_cli
from linear_attention.training import cli, convert, tokenizer_cli
from linear_attention.training.cli_args import plain
from linear_attention.training.eval_cli import eval_main
from linear_attention.training.generate_cli import generate_main


def test_plain():
    assert plain('``la-train`` reads `configs/lm.py`\'s ``kind = "tokens"``') == (
        'la-train reads configs/lm.py\'s kind = "tokens"'
    )


@pytest.mark.parametrize(
    "main, argv",
    [
        (cli.main, ["la-train", "--help"]),
        (eval_main, ["la-eval", "--help"]),
        (evals_cli.main, ["la-eval", "--help"]),  # the entry point: the three ways, then fields
        (evals_cli.main, ["la-eval", "--tasks", "x", "--help"]),
        (generate_main, ["la-generate", "--help"]),
        (convert.main, ["--help"]),
        (tokenizer_cli.main, ["--help"]),
    ],
)
def test_help_has_no_code_quotes(main, argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "usage" in out.lower() and "`" not in out


def test_preset_descriptions_are_whole_sentences(capsys):
    cli.main(["la-train", "--help"])
    out = capsys.readouterr().out
    section = out.split("config files and presets")[1].split("\n\n")[0]
    # each file's description ends its sentence (the first docstring line of two did not)
    for block in section.split("\n  configs/")[1:]:
        assert block.rstrip().endswith((".", ")")), block
    assert "train on short sequences, evaluate on longer ones." in " ".join(section.split())
    assert all(len(line) <= 100 for line in section.splitlines())
