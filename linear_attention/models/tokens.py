"""Token ids at the boundaries: checked where their values are known, confined where not.

Outside `jax.jit` (model calls on concrete arrays, `generate`, the training data) a token id
outside ``[0, vocab_size)`` raises `ValueError` with the id and where it is. Negative ids are
not wrapped: ``-100``, the ignore index of labels, is no input token. Under `jit` the values are
unknown, so the model embeds a bad token (or a learned position past ``max_length``) as a zero
vector and gives NaN logits at that position only: later positions see a finite input, so the
NaN does not spread through the sequence.
"""

from __future__ import annotations

import jax
import numpy as np


def is_concrete(x) -> bool:
    """Whether ``x``'s values can be read now (not a tracer under `jit`/`vmap`/`grad`)."""
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(x))


def check_token_ids(tokens, vocab_size: int, *, name: str = "tokens") -> None:
    """Raise `ValueError` if a concrete ``tokens`` holds an id outside ``[0, vocab_size)``
    (a no-op on tracers)."""
    if not is_concrete(tokens):
        return
    ids = np.asarray(tokens)
    if ids.size == 0:
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if not bad.any():
        return
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    value = int(ids[where])
    note = " (-100 is the ignore index of labels, not an input token)" if value == -100 else ""
    raise ValueError(
        f"{name} must be token ids in [0, vocab_size={vocab_size}), got {value} at index "
        f"{where}{note} ({int(bad.sum())} bad id(s) in shape {ids.shape})"
    )
