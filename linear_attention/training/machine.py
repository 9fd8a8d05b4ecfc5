"""What a measurement ran on, recorded next to its numbers: in every run's ``summary.json``
(and a sweep's results rows) and in the benchmark scripts' JSON. XLA's CPU code differs by
processor, so a rerun on another machine can differ in rounding; this says which machine."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import jax

# The vector extensions XLA's CPU backend compiles for when present: two processors that differ
# in these get different code, so different rounding.
SIMD_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "asimd",
    "sve",
)


def cpu_identity(cpuinfo_text: str) -> dict:
    """The first processor of a ``/proc/cpuinfo``: its model name, its family/model/stepping
    (``cpu_id``) and the `SIMD_FLAGS` it has (``cpu_flags``, space-separated).

    Why more than the name: virtual machines here report a bare "AMD EPYC", which names no
    generation. Two runs of one config on machines reporting it diverged from the first logged
    step, while reruns on one machine agree bit for bit (docs/studies/state_tracking.md,
    "How much one run says"); the family/model
    numbers and the flags say whether two such processors were the same.
    """
    first: dict[str, str] = {}
    for line in cpuinfo_text.splitlines():
        if not line.strip():
            if first:
                break  # one processor's block is enough: the others repeat it
            continue
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    flags = set((first.get("flags") or first.get("Features") or "").split())
    numbers = [first.get(k) for k in ("cpu family", "model", "stepping")]
    return dict(
        cpu_model=first.get("model name", ""),
        cpu_id="/".join(numbers) if all(numbers) else "",
        cpu_flags=" ".join(f for f in SIMD_FLAGS if f in flags),
    )


def machine_info() -> dict:
    """Platform, device kind, CPU model, identity and count, versions, and the load average at
    the start."""
    cpuinfo = Path("/proc/cpuinfo")
    cpu = cpu_identity(cpuinfo.read_text()) if cpuinfo.exists() else {}
    dev = jax.devices()[0]
    return dict(
        platform=dev.platform,
        device_kind=dev.device_kind,
        device_count=jax.device_count(),
        cpu_count=os.cpu_count(),
        cpu_model=cpu.get("cpu_model") or platform.processor(),
        cpu_id=cpu.get("cpu_id", ""),
        cpu_flags=cpu.get("cpu_flags", ""),
        jax_version=jax.__version__,
        python=platform.python_version(),
        load_avg_start=os.getloadavg(),
    )


def library_commit() -> str | None:
    """The commit of this library's checkout (short hash; "+dirty" with uncommitted changes
    under linear_attention/), or None outside a git checkout."""
    here = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
            cwd=here,
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
