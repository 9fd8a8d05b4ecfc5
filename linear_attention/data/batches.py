"""What every data source shares: the ignore label and padded evaluation batches."""

from __future__ import annotations

import numpy as np

# Label of positions that carry no target (PyTorch's default, as in Zoology).
IGNORE_INDEX = -100


def padded_batches(
    inputs: np.ndarray,
    labels: np.ndarray,
    batch_size: int,
    *,
    segment_ids: np.ndarray | None = None,
):
    """Yield ``{"inputs", "labels"}`` batches (and ``"segment_ids"`` when given) of
    ``batch_size`` rows in order; the last batch is padded with rows labelled ``IGNORE_INDEX``
    (segment ids 0) so every example counts exactly once."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    arrays = {"inputs": (inputs, 0), "labels": (labels, IGNORE_INDEX)}
    if segment_ids is not None:
        arrays["segment_ids"] = (segment_ids, 0)
    n = inputs.shape[0]
    for start in range(0, n, batch_size):
        batch = {}
        for key, (array, fill) in arrays.items():
            part = array[start : start + batch_size]
            pad = batch_size - part.shape[0]
            if pad:
                part = np.concatenate([part, np.full((pad, *part.shape[1:]), fill, part.dtype)])
            batch[key] = part
        yield batch
