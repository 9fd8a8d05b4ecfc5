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
    """`kv: [B, H, M, Dv]` and `k_sum: [B, H, M]`, both float32. A pytree."""

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
        return int(
            self.kv.size * self.kv.dtype.itemsize + self.k_sum.size * self.k_sum.dtype.itemsize
        )


def check_state(state, batch: int, heads: int, m: int, dv: int, name: str = "initial_state"):
    """Raise a ValueError unless `state` is a LinearAttentionState of the expected shapes."""
    if not isinstance(state, LinearAttentionState):
        raise ValueError(f"{name} must be a LinearAttentionState, got {type(state).__name__}")
    want_kv, want_sum = (batch, heads, m, dv), (batch, heads, m)
    if tuple(state.kv.shape) != want_kv or tuple(state.k_sum.shape) != want_sum:
        raise ValueError(
            f"{name} has kv {tuple(state.kv.shape)} and k_sum {tuple(state.k_sum.shape)}; "
            f"expected kv {want_kv} [B, H, M, Dv] and k_sum {want_sum} [B, H, M]"
        )
