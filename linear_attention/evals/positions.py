"""Perplexity by position: the mean loss at each position of long blocks, averaged over
buckets of positions (behind ``la-eval --position_buckets N``).

A block is ``block_len + 1`` consecutive tokens from the start of one document (a document long
enough gives several, one after the other); the model reads its first ``block_len`` tokens
and each position ``t`` is scored on token ``t + 1``, so position ``t`` has ``t`` tokens of the
same document before it. The loss at ``t`` is averaged over the blocks, then over the
positions ``[kN, (k + 1)N)`` of bucket ``k`` (the last may be shorter). For a run trained on
``seq_len`` tokens, the buckets past ``seq_len`` show how the model extrapolates.
"""

from __future__ import annotations

import numpy as np

from linear_attention.evals.figures import new_figure, save_png
from linear_attention.evals.packing import token_scores
from linear_attention.fields import check_int


def document_blocks(documents, tokenizer, block_len: int, num_blocks: int) -> np.ndarray:
    """``int32[n, block_len + 1]``: the first ``num_blocks`` blocks (module docstring) of
    ``documents`` (texts, in order); ValueError when no document is long enough."""
    width = block_len + 1
    blocks = []
    for text in documents:
        tokens = tokenizer.encode(text)
        for start in range(0, len(tokens) - width + 1, width):
            blocks.append(tokens[start : start + width])
            if len(blocks) == num_blocks:
                return np.stack(blocks).astype(np.int32)
    if not blocks:
        raise ValueError(
            f"no document holds block_len + 1 = {width} tokens: give a shorter --block_len or "
            "longer documents (--data)"
        )
    return np.stack(blocks).astype(np.int32)


def position_losses(model, blocks: np.ndarray, batch_size: int) -> np.ndarray:
    """``float64[block_len]``: the mean over ``blocks`` of the loss (nats) at each position,
    ``batch_size`` blocks per compiled pass (the last batch filled with copies, not counted)."""
    batch_size = check_int("batch_size", batch_size)
    n, width = blocks.shape
    total = np.zeros(width - 1, np.float64)
    for first in range(0, n, batch_size):
        part = blocks[first : first + batch_size]
        filled = np.concatenate([part, np.repeat(part[-1:], batch_size - len(part), 0)])
        arrays = {
            "tokens": filled[:, :-1],
            "segment_ids": np.zeros_like(filled[:, :-1]),  # one document a row
            "targets": filled[:, 1:],
        }
        picked, _ = token_scores(model, arrays)
        total -= picked[: len(part)].astype(np.float64).sum(0)
    return total / n


def bucket_means(losses: np.ndarray, bucket: int) -> list[dict]:
    """``[{"start", "stop", "loss"}]``: the mean of ``losses`` over positions ``[start, stop)``
    for consecutive buckets of ``bucket`` positions (the last may be shorter)."""
    bucket = check_int("position_buckets", bucket)
    starts = range(0, len(losses), bucket)
    stops = [min(s + bucket, len(losses)) for s in starts]
    return [
        {"start": a, "stop": b, "loss": float(losses[a:b].mean())}
        for a, b in zip(starts, stops, strict=True)
    ]


def plot_buckets(path: str, buckets: list[dict], *, trained_len: int | None, title: str) -> None:
    """The mean loss of each bucket against its positions, a line at the trained length."""
    fig, ax = new_figure((6, 3.5))
    mids = [(b["start"] + b["stop"] - 1) / 2 for b in buckets]
    ax.plot(mids, [b["loss"] for b in buckets], marker="o")
    if trained_len is not None:
        ax.axvline(trained_len, color="gray", linestyle="--", label=f"trained length {trained_len}")
        ax.legend()
    ax.set_xlabel("position in the block (bucket middle)")
    ax.set_ylabel("mean loss (nats)")
    ax.set_title(title)
    save_png(fig, path)
