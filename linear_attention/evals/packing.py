"""Scoring requests packed into rows: many short token sequences share a row, each its own
document (``segment_ids``), so a batch holds tokens and no padding but the rows' tails.

A request is ``(inputs, targets, num_scored)``: the model reads ``inputs`` and the last
``num_scored`` of ``targets`` (``targets[t]`` is the token after ``inputs[t]``) are scored.
`causal_request` makes one from a context and a continuation as lm-evaluation-harness does: the
whole sequence is cut on the left to the model's maximum length ``L`` (``(context +
continuation)[-(L + 1):]``), so a continuation is always scored in full, after as much context
as fits. Requests are sorted by length, longest first, and placed best-fit into rows of one
width (the smallest power of two that holds the longest, at most ``L``); a batch is as many
rows as ``batch_tokens`` allows (at least one), the last one filled with empty rows so that
every batch of a call has one shape (one compilation).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention.fields import check_int


class Request(NamedTuple):
    inputs: np.ndarray  # int32[n]
    targets: np.ndarray  # int32[n]
    num_scored: int


class Placed(NamedTuple):
    """Where a request lies in a batch: row, and its scored positions ``[start, stop)``."""

    row: int
    start: int
    stop: int


def causal_request(context: Sequence[int], continuation: Sequence[int], max_length: int):
    """The `Request` scoring ``continuation`` after ``context`` with at most ``max_length``
    input tokens, cut on the left; ValueError for an empty part or a continuation longer than
    ``max_length`` (it could not be scored in full)."""
    if len(context) == 0 or len(continuation) == 0:
        raise ValueError(
            f"a request needs a context and a continuation of at least one token, got "
            f"{len(context)} and {len(continuation)}"
        )
    if len(continuation) > max_length:
        raise ValueError(
            f"a continuation of {len(continuation)} tokens is longer than the model's maximum "
            f"length {max_length}: it cannot be scored in one pass"
        )
    whole = np.asarray([*context, *continuation], np.int32)[-(max_length + 1) :]
    return Request(whole[:-1], whole[1:], len(continuation))


def row_width(lengths: Sequence[int], max_length: int) -> int:
    """The rows' width: the smallest power of two holding the longest input, at most
    ``max_length`` (few widths, so few compilations)."""
    longest = max(lengths)
    return min(max_length, 1 << max(0, (longest - 1).bit_length()))


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Request indices per row: longest first, each into the fullest row that still has room
    (best fit decreasing), a new row when none has."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in order:
        n = lengths[i]
        if n > width:
            raise ValueError(f"an input of {n} tokens does not fit a row of {width}")
        k = bisect.bisect_left(free, (n, -1))
        if k == len(free):
            rows.append([i])
            room, row = width - n, len(rows) - 1
        else:
            room, row = free.pop(k)
            rows[row].append(i)
            room -= n
        if room > 0:
            bisect.insort(free, (room, row))
    return rows


def batches(
    requests: Sequence[Request], max_length: int, batch_tokens: int
) -> Iterator[tuple[dict, dict[int, Placed]]]:
    """Yield ``(arrays, placed)``: ``arrays`` the ``tokens``, ``segment_ids`` and ``targets``
    of one batch ``[B, W]`` (int32), ``placed`` request index -> `Placed`. Every batch of one
    call has the same shape; the unused tail of a row is a document of its own (token 0)."""
    batch_tokens = check_int("batch_tokens", batch_tokens)
    if not requests:
        return
    lengths = [len(r.inputs) for r in requests]
    width = row_width(lengths, max_length)
    rows = pack_rows(lengths, width)
    per_batch = max(1, batch_tokens // width)
    for first in range(0, len(rows), per_batch):
        tokens = np.zeros((per_batch, width), np.int32)
        targets = np.zeros((per_batch, width), np.int32)
        segments = np.zeros((per_batch, width), np.int32)
        placed = {}
        for b, row in enumerate(rows[first : first + per_batch]):
            at = 0
            for doc, i in enumerate(row):
                r = requests[i]
                n = len(r.inputs)
                tokens[b, at : at + n] = r.inputs
                targets[b, at : at + n] = r.targets
                segments[b, at : at + n] = doc
                placed[i] = Placed(b, at + n - r.num_scored, at + n)
                at += n
            segments[b, at:] = len(row)  # the tail: a document of its own
        yield {"tokens": tokens, "segment_ids": segments, "targets": targets}, placed


@functools.partial(jax.jit, static_argnums=0)
def _token_scores(graphdef, params, tokens, segment_ids, targets):
    logits = nnx.merge(graphdef, params)(tokens, segment_ids)  # float32
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logits, axis=-1) == targets


def token_scores(model, arrays: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(log p(target) float32[B, W], target is the argmax bool[B, W])`` of one batch of
    `batches`, in one compiled forward pass of the packed rows."""
    graphdef, params = nnx.split(model)
    picked, greedy = _token_scores(
        graphdef, params, arrays["tokens"], arrays["segment_ids"], arrays["targets"]
    )
    return np.asarray(picked), np.asarray(greedy)


def score_requests(
    model, requests: Sequence[Request], max_length: int, batch_tokens: int
) -> list[tuple[float, bool]]:
    """``(sum of log p over the scored targets, every scored target is the argmax)`` of each
    request, in its order, the requests packed (`batches`)."""
    out: list[tuple[float, bool] | None] = [None] * len(requests)
    for arrays, placed in batches(requests, max_length, batch_tokens):
        picked, greedy = token_scores(model, arrays)
        for i, (row, start, stop) in placed.items():
            out[i] = (float(picked[row, start:stop].sum()), bool(greedy[row, start:stop].all()))
    return out
