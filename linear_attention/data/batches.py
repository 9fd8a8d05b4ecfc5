"""What every data source shares: the ignore label and padded evaluation batches."""

from __future__ import annotations

import numpy as np

# Label of positions that carry no target (PyTorch's default, as in Zoology).
IGNORE_INDEX = -100


def padded_batches(inputs: np.ndarray, labels: np.ndarray, batch_size: int):
    """Yield ``{"inputs", "labels"}`` batches of ``batch_size`` rows in order; the last batch is
    padded with rows labelled ``IGNORE_INDEX`` so every example counts exactly once."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n = inputs.shape[0]
    for start in range(0, n, batch_size):
        x, y = inputs[start : start + batch_size], labels[start : start + batch_size]
        pad = batch_size - x.shape[0]
        if pad:
            x = np.concatenate([x, np.zeros((pad, x.shape[1]), x.dtype)])
            y = np.concatenate([y, np.full((pad, y.shape[1]), IGNORE_INDEX, y.dtype)])
        yield {"inputs": x, "labels": y}
