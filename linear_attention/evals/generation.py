"""Greedy generation until a stop sequence: the prompt is prefilled, then each token costs one
O(1) `LanguageModel.step` (a linear mixer's state does not grow with the text).

The prompt is prefilled in pieces whose lengths are powers of two (its binary digits, longest
first), so prompts of any length compile at most ``log2(max_length)`` prefill programs; the
step is compiled once. The state is made for the model's whole ``max_length`` (a softmax
cache), so one shape serves every request.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from linear_attention.models import step_fn


@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef, params, tokens, state):
    logits, state = nnx.merge(graphdef, params).prefill(tokens, state)
    return logits[:, -1], state


def power_of_two_pieces(n: int) -> list[int]:
    """``n`` as a sum of distinct powers of two, largest first (``13 -> [8, 4, 1]``)."""
    return [1 << b for b in reversed(range(n.bit_length())) if n >> b & 1]


def prefill(model, prompt: np.ndarray):
    """``(logits of the last prompt token float32[V], state after the prompt)`` for one prompt
    ``int[T0]``, prefilled in power-of-two pieces."""
    graphdef, params = nnx.split(model)
    state = model.init_state(1)
    at = 0
    for n in power_of_two_pieces(len(prompt)):
        logits, state = _prefill(graphdef, params, prompt[None, at : at + n], state)
        at += n
    return np.asarray(logits[0]), state


def cut_at_stop(text: str, until: list[str]) -> tuple[str, bool]:
    """``(text before the first stop sequence, whether one occurs)``."""
    cuts = [text.index(s) for s in until if s and s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


def greedy_until(
    model,
    tokenizer,
    prompt: np.ndarray,
    *,
    until: list[str],
    max_new_tokens: int,
    stop_token: int | None = None,
) -> str:
    """The text greedily generated after ``prompt`` (token ids), cut before the first of
    ``until``; at most ``max_new_tokens`` tokens, ending early at ``stop_token`` (not part of
    the text) or once a stop sequence appears."""
    logits, state = prefill(model, np.asarray(prompt, np.int32))
    step = step_fn(model)
    drawn: list[int] = []
    for i in range(max_new_tokens):
        token = int(np.argmax(logits))
        if token == stop_token:
            break
        drawn.append(token)
        text, stopped = cut_at_stop(tokenizer.decode(drawn), until)
        if stopped:
            return text
        if i + 1 < max_new_tokens:
            logits, state = step(np.asarray([token], np.int32), state)
            logits = np.asarray(logits[0])
    return cut_at_stop(tokenizer.decode(drawn), until)[0]
