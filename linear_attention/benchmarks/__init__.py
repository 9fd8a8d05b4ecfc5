"""What the benchmark and experiment scripts share: the machine a measurement ran on
(`machine_info`), the reference implementations the kernels are timed against (`baselines`),
and timing helpers (`timing`: inputs, compiled points, interleaved rounds). The scripts
themselves live in ``experiments/``; nothing else of the package imports this."""

from linear_attention.benchmarks.machine import machine_info

__all__ = ["machine_info"]
