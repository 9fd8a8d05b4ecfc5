"""The recurrent state of causal linear attention.

After token t the state holds

    kv_t    = exp(a_t) kv_{t-1} + k_t v_tᵀ      [B, H, M, Dv]
    k_sum_t = exp(a_t) k_sum_{t-1} + k_t        [B, H, M]

Its size is fixed by the widths, not by the context length: this is what makes decoding O(1).
k_sum is the kv state of a value that is always 1, which is how the kernels compute it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LinearAttentionState(NamedTuple):
    """`kv: [B, H, M, Dv]` and `k_sum: [B, H, M]` (or None: not tracked), float32. A pytree."""

    kv: jax.Array
    k_sum: jax.Array

    @classmethod
    def zeros(cls, batch_size: int, num_heads: int, feature_dim: int, value_dim: int):
        """An empty state (the state before the first token)."""
        return cls(
            kv=jnp.zeros((batch_size, num_heads, feature_dim, value_dim), jnp.float32),
            k_sum=jnp.zeros((batch_size, num_heads, feature_dim), jnp.float32),
        )

    @property
    def size_bytes(self) -> int:
        """Bytes held by the state, for all sequences in the batch."""
        arrays = [x for x in (self.kv, self.k_sum) if x is not None]
        return int(sum(x.size * x.dtype.itemsize for x in arrays))


def check_state(
    state,
    batch: int,
    heads: int,
    m: int,
    dv: int,
    name: str = "initial_state",
    need_k_sum: bool = True,
):
    """Raise a ValueError unless `state` is a LinearAttentionState of the expected shapes.

    `k_sum` may be None only when not `need_k_sum` (unnormalised attention)."""
    if not isinstance(state, LinearAttentionState):
        raise ValueError(f"{name} must be a LinearAttentionState, got {type(state).__name__}")
    if state.k_sum is None and need_k_sum:
        raise ValueError(
            f"{name}.k_sum is None, but normalize=True needs it (pass k_sum of shape [B, H, M])"
        )
    want_kv, want_sum = (batch, heads, m, dv), (batch, heads, m)
    sum_shape = want_sum if state.k_sum is None else tuple(jnp.shape(state.k_sum))
    if tuple(jnp.shape(state.kv)) != want_kv or sum_shape != want_sum:
        raise ValueError(
            f"{name} has kv {tuple(jnp.shape(state.kv))} and k_sum {sum_shape}; "
            f"expected kv {want_kv} [B, H, M, Dv] and k_sum {want_sum} [B, H, M]"
        )
