"""Shared chunk primitives of the delta-rule family: chunk layout, per-key decay factors of one
chunk, the unit-lower-triangular inverse.

Every chunkwise kernel pads time to whole chunks (padding tokens must leave the state alone:
zero keys/values/rates and a zero log decay), views `[B, T, H, ...]` as `[N, B, H, C, ...]`
(chunk-major, so a `lax.scan` walks the chunks), and maps the result back.
"""

from __future__ import annotations

import jax.numpy as jnp

from linear_attention.kernels.segments import cumulative_log_decay, masked_exp


def pad_time(x_BT, C: int):
    """Pad axis 1 (time) of `x [B, T, ...]` with zeros to a multiple of C (None stays None)."""
    if x_BT is None:
        return None
    pad = -x_BT.shape[1] % C
    if not pad:
        return x_BT
    return jnp.pad(x_BT, [(0, 0), (0, pad)] + [(0, 0)] * (x_BT.ndim - 2))


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


def invert_unit_lower(a_CC):
    """(I + A)⁻¹ for strictly lower-triangular A [..., C, C], by doubling the block size.

    With the inverses D₁, D₂ of two diagonal blocks of size b known, the block of size 2b is
    [[L₁₁, 0], [L₂₁, L₂₂]]⁻¹ = [[D₁, 0], [−D₂ L₂₁ D₁, D₂]]: log₂ C rounds of batched matmuls, as
    stable as forward substitution (no powers of A are formed). Measured on CPU: several times
    faster than `lax.linalg.triangular_solve` on these many small systems, and the product form
    (I − N)⁻¹ = Π(I + N^(2^j)) is unstable for β near 2 (its powers of A blow up).
    """
    C = a_CC.shape[-1]
    P = 1 << (C - 1).bit_length()  # pad to a power of two: (I + 0) on the padding
    if P != C:
        a_CC = jnp.pad(a_CC, [(0, 0)] * (a_CC.ndim - 2) + [(0, P - C), (0, P - C)])
    batch = a_CC.shape[:-2]
    d_nbb = jnp.ones((*batch, P, 1, 1), a_CC.dtype)  # inverses of the 1×1 diagonal blocks
    b = 1
    while b < P:
        n = P // b
        blocks = jnp.swapaxes(a_CC.reshape(*batch, n, b, n, b), -3, -2)  # [..., n, n, b, b]
        l21 = blocks[..., jnp.arange(1, n, 2), jnp.arange(0, n, 2), :, :]
        d1, d2 = d_nbb[..., 0::2, :, :], d_nbb[..., 1::2, :, :]
        x21 = -(d2 @ l21 @ d1)
        top = jnp.concatenate([d1, jnp.zeros_like(d1)], axis=-1)
        bottom = jnp.concatenate([x21, d2], axis=-1)
        d_nbb = jnp.concatenate([top, bottom], axis=-2)
        b *= 2
    return d_nbb[..., 0, :C, :C]


class KeyDecays:
    """Decay factors of one chunk for a log decay per key channel, a [.., C, K] (−inf: a reset).

    b = cumulative log decay inside the chunk (restarting at resets), n = resets counted up to t
    (`segments.cumulative_log_decay`); a factor exp(b_t − b_s) is kept only where n_t = n_s and
    is masked before exp, so −30 per token is exact (factors underflow to 0, never overflow):
      start [.., C, K]  exp(b_t) where no reset up to t: the entering state's weight on row t
      end   [.., C, K]  exp(b_C − b_s) where no reset after s: token s's weight in the leaving state
      total [.., K]     exp(b_C) where no reset in the chunk: the entering state's weight in it
    With `exclusive`, also the decay before each token's own (b_{t−1}, n_{t−1}) and its `start`:
      b_prev, n_prev, start_prev [.., C, K]   (for transitions that read the undecayed state)
    """

    def __init__(self, a, *, exclusive: bool = False):
        b, n = cumulative_log_decay(a, axis=-2, restart=True)
        self.b, self.n = b, n
        b_end, n_end = b[..., -1:, :], n[..., -1:, :]
        self.start = masked_exp(n == 0, b)
        self.end = masked_exp(n == n_end, b_end - b)
        self.total = masked_exp(n_end[..., 0, :] == 0, b_end[..., 0, :])
        if exclusive:
            self.b_prev = jnp.concatenate([jnp.zeros_like(b[..., :1, :]), b[..., :-1, :]], -2)
            self.n_prev = jnp.concatenate([jnp.zeros_like(n[..., :1, :]), n[..., :-1, :]], -2)
            self.start_prev = masked_exp(self.n_prev == 0, self.b_prev)
