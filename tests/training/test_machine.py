"""training/machine.py: the processor a run records, read from /proc/cpuinfo text written here."""

import functools
import subprocess
from pathlib import Path

from linear_attention.training import machine
from linear_attention.training.machine import cpu_identity, machine_info

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_bf16 sha_ni

processor\t: 1
cpu family\t: 25
model\t\t: 1
model name\t: another
flags\t\t: avx2
"""

ARM = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes sve
CPU implementer\t: 0x41
"""


def test_cpu_identity_reads_the_first_processor():
    # two generations behind one name: the numbers and the AVX-512 flags tell them apart
    assert cpu_identity(X86) == dict(
        cpu_model="AMD EPYC",
        cpu_id="25/17/1",
        cpu_flags="sse4_2 avx avx2 fma avx512f avx512bw avx512_bf16",
    )
    zen3 = X86.replace("model\t\t: 17", "model\t\t: 1").replace(" avx512f avx512bw avx512_bf16", "")
    assert cpu_identity(zen3)["cpu_id"] == "25/1/1"
    assert cpu_identity(zen3)["cpu_flags"] == "sse4_2 avx avx2 fma"
    # ARM lists "Features" and no family numbers: the flags, and no made-up id
    assert cpu_identity(ARM) == dict(cpu_model="", cpu_id="", cpu_flags="asimd sve")
    assert cpu_identity("") == dict(cpu_model="", cpu_id="", cpu_flags="")


def test_machine_info_matches_proc_cpuinfo():
    info = machine_info()
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        assert info["cpu_id"] == "" and info["cpu_flags"] == ""
        return
    block = cpuinfo.read_text().split("\n\n")[0]
    fields = {}
    for line in block.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if "cpu family" in fields:
        expected = f"{fields['cpu family']}/{fields['model']}/{fields['stepping']}"
        assert info["cpu_id"] == expected
    flags = (fields.get("flags") or fields.get("Features") or "").split()
    assert set(info["cpu_flags"].split()) <= set(flags)
    assert ("avx2" in info["cpu_flags"].split()) == ("avx2" in flags)


def test_library_commit_is_the_checkouts_head():
    """Its hash names HEAD, and "+dirty" is there exactly when `git diff HEAD` finds changes to
    tracked files under linear_attention/; None outside a git checkout."""
    root = Path(machine.__file__).resolve().parents[1]
    git = functools.partial(subprocess.run, cwd=root, capture_output=True, text=True)
    head = git(["git", "rev-parse", "HEAD"])
    got = machine.library_commit()
    if head.returncode != 0:
        assert got is None
        return
    short, _, mark = got.partition("+")
    assert git(["git", "rev-parse", short]).stdout == head.stdout
    changed = git(["git", "diff", "--quiet", "HEAD", "--", "."]).returncode != 0
    assert mark == ("dirty" if changed else "")
