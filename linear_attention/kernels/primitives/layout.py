"""Chunk layout: pad time to whole chunks, view `[B, T, H, ...]` chunk-major and back.

Every chunkwise kernel pads time to whole chunks (padding tokens must leave the state alone:
zero keys/values/rates and a zero log decay), views `[B, T, H, ...]` as `[N, B, H, C, ...]`
(chunk-major, so a `lax.scan` walks the chunks), and maps the result back.
"""

from __future__ import annotations

import jax.numpy as jnp


def pad_time(x_BT, C: int):
    """Pad axis 1 (time) of `x [B, T, ...]` with zeros to a multiple of C (None stays None)."""
    if x_BT is None:
        return None
    pad = -x_BT.shape[1] % C
    if not pad:
        return x_BT
    return jnp.pad(x_BT, [(0, 0), (0, pad)] + [(0, 0)] * (x_BT.ndim - 2))


def pad_last(x, size: int):
    """x with its last axis zero-padded to `size` (channels padded to a kernel's tile)."""
    pad = size - x.shape[-1]
    return x if not pad else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def to_chunks(x_BT, C: int):
    """`[B, T, H, ...]` (T a multiple of C) -> chunk-major `[N, B, H, C, ...]` (None stays None)."""
    if x_BT is None:
        return None
    B, T, H = x_BT.shape[:3]
    x = x_BT.reshape(B, T // C, C, H, *x_BT.shape[3:])
    return jnp.moveaxis(jnp.moveaxis(x, 3, 2), 1, 0)


def from_chunks(x_NBHC, T: int):
    """Chunk-major `[N, B, H, C, ...]` -> `[B, T, H, ...]`, cut to the first T tokens."""
    N, B, H, C = x_NBHC.shape[:4]
    x = jnp.moveaxis(jnp.moveaxis(x_NBHC, 0, 1), 2, 3)  # [B, N, C, H, ...]
    return x.reshape(B, N * C, H, *x_NBHC.shape[4:])[:, :T]
