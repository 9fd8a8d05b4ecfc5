"""Every shell command of a guide block that names a shipped fixture (`tests/fixtures/`) runs
and exits 0 (issue 75): the blocks are run in order, from a folder that stands for the
repository root (its `tests` is the checkout's), each `la-*` program through its entry point
in `pyproject.toml`, in this process."""

import importlib
import re
import shlex
import sys

import pytest

from tests.scripts import ROOT

FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
# pyproject's [project.scripts] (no tomllib: Python 3.10 is supported)
_SECTION = (ROOT / "pyproject.toml").read_text().split("[project.scripts]\n")[1].split("\n\n")[0]
SCRIPTS = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"$', _SECTION, re.MULTILINE))


def fixture_blocks():
    """``(page, [argv, ...])`` of each fenced block in docs/ that names a shipped fixture."""
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for block in FENCE.findall(page.read_text()):
            if "tests/fixtures/" not in block:
                continue
            text = re.sub(r"\\\n\s*", " ", block)  # backslash continuations
            commands = [shlex.split(line, comments=True) for line in text.splitlines()]
            yield str(page.relative_to(ROOT)), [argv for argv in commands if argv]


BLOCKS = list(fixture_blocks())


def test_the_guides_have_fixture_commands():
    assert any(page == "docs/hf.md" for page, _ in BLOCKS)
    assert {"la-train", "la-eval", "la-generate", "la-convert"} <= set(SCRIPTS)


def entry_point(program: str):
    module, function = SCRIPTS[program].split(":")
    return getattr(importlib.import_module(module), function)


@pytest.mark.parametrize("page, commands", BLOCKS, ids=[page for page, _ in BLOCKS])
def test_fixture_commands_run(page, commands, tmp_path, monkeypatch, capsys):
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        assert argv[0] in SCRIPTS, f"{page}: {shlex.join(argv)} is not an la-* program"
        monkeypatch.setattr(sys, "argv", argv)
        status = entry_point(argv[0])()
        out, err = capsys.readouterr()
        assert status == 0, f"{page}: {shlex.join(argv)} exited {status}:\n{out[-2000:]}\n{err}"
