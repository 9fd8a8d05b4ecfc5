"""experiments/ scripts import only the package (and libraries): none extends ``sys.path`` and
none imports another script, so that shared helpers live once in `linear_attention`."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "experiments").glob("*.py"))


def offences(source: str, name: str, siblings: set[str]) -> list[str]:
    """Every use of ``sys.path``, relative import and import of a sibling script in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        ):
            found.append(f"{name}:{node.lineno} uses sys.path")
        modules = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.append(f"{name}:{node.lineno} relative import")
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module]
        found += [
            f"{name}:{node.lineno} imports the script {m}"
            for m in modules
            if m.split(".")[0] in siblings
        ]
    return sorted(found, key=lambda text: int(text.split(":")[1].split()[0]))


def test_no_script_extends_sys_path_or_imports_a_sibling():
    siblings = {p.stem for p in SCRIPTS}
    assert {"sweep", "benchmark", "train"} <= siblings  # the folder was found
    found = [o for p in SCRIPTS for o in offences(p.read_text(), p.name, siblings)]
    assert found == []


def test_offences_finds_each_kind():
    source = (
        "import sys\nimport os.path\nsys.path.insert(0, 'x')\n"
        "from benchmark import compile_point\nimport machine\nfrom . import y\n"
        "from linear_attention.benchmarks import machine_info\n"
    )
    assert offences(source, "s.py", {"benchmark", "machine"}) == [
        "s.py:3 uses sys.path",
        "s.py:4 imports the script benchmark",
        "s.py:5 imports the script machine",
        "s.py:6 relative import",
    ]
