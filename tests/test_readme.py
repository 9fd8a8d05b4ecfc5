"""README.md is the front door (issue 51): at most 300 lines, no prose line over 200 characters,
and the commands it gives are the ones CI runs (`.ci/run`: the docs build, then the tests)."""

import re

from tests.scripts import ROOT

README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def test_readme_is_short():
    lines = README.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines"
    in_code = False
    for number, line in enumerate(lines, start=1):
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and not line.startswith("|"):
            assert len(line) <= 200, f"README.md:{number} is {len(line)} characters"


def test_ci_runs_the_readme_commands():
    assert 'pip install -e ".[test]" && pytest' in README
    ci_lines = [line.strip() for line in CI.splitlines()]
    assert "pytest" in ci_lines, "CI runs the README's test command, pytest, as it stands"
    (build,) = [line for line in ci_lines if line.startswith("sphinx-build")]
    readme_build = re.sub(r" -q\b", "", build)
    assert readme_build in README, f"README.md does not give CI's docs build: {readme_build}"


def test_readme_names_no_commit():
    """The README says what is, not when it was measured (issue 74): no commit hash stamps a
    figure, so no commit exists only to re-record one."""
    hashes = [
        word
        for word in re.findall(r"\b[0-9a-f]{7,40}\b", README)
        if re.search(r"[0-9]", word) and re.search(r"[a-f]", word)
    ]
    assert not hashes, f"README.md names commits: {hashes}"
