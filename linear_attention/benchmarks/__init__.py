"""What the benchmark and experiment scripts share: the machine a measurement ran on
(`machine_info`), the reference implementations the kernels are timed against (`baselines`),
and timing helpers (`timing`: inputs, compiled points, interleaved rounds). `machine_info`
lives in `training.machine` (every run's summary records it) and is re-exported here. The
scripts themselves live in ``experiments/``; nothing else of the package imports this."""

from linear_attention.training.machine import machine_info

__all__ = ["machine_info"]
