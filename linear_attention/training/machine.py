"""What a measurement ran on, recorded next to its numbers: in every run's ``summary.json``
(and a sweep's results rows) and in the benchmark scripts' JSON. XLA's CPU code differs by
processor, so a rerun on another machine can differ in rounding; this says which machine."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import jax


def machine_info() -> dict:
    """Platform, device kind, CPU model and count, versions, and the load average at the start."""
    cpuinfo = Path("/proc/cpuinfo")
    models = []
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        models = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
    dev = jax.devices()[0]
    return dict(
        platform=dev.platform,
        device_kind=dev.device_kind,
        device_count=jax.device_count(),
        cpu_count=os.cpu_count(),
        cpu_model=models[0] if models else platform.processor(),
        jax_version=jax.__version__,
        python=platform.python_version(),
        load_avg_start=os.getloadavg(),
    )
