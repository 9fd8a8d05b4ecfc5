"""Short causal depthwise convolution (kernel 4 by default) with a decoding state.

    y_t = act(b + Σ_{j=0}^{K-1} w_j ⊙ x_{t-K+1+j})        (x_s = tail for s < 0)

The decoding state is the tail: the last `K − 1` inputs `[B, K−1, C]`, kept in float32. With a
zero tail the layer is the usual zero-padded causal convolution, so `__call__`, `prefill` and
`step` give the same numbers. For packed rows, `__call__(x, document_ids)` treats the inputs of
other documents as zeros (each document is convolved as if it were alone). `sequence` is what a
mixer's input part calls: a whole sequence (packed rows or not, time split or not) or a prefill.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention.fields import check_int
from linear_attention.layers.sequence import previous_tail, sequence_axis

ACTIVATIONS = {"silu": jax.nn.silu, "identity": lambda x: x}


class ShortConv(nnx.Module):
    """Causal depthwise conv over time on `[B, T, C]` with kernel `[K, C]` and bias `[C]`
    (`use_bias=False`: no bias, as Qwen3-Next's and Qwen3.5's Gated DeltaNet). The kernel starts
    U(±1/√K) (torch's default), or N(0, `kernel_std`²) where given (Griffin's)."""

    def __init__(
        self,
        channels: int,
        kernel_size: int = 4,
        *,
        activation: str = "silu",
        use_bias: bool = True,
        kernel_std: float | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        check_int("conv kernel_size", kernel_size, minimum=2)
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"unknown conv activation {activation!r}; allowed: {sorted(ACTIVATIONS)}"
            )
        self.channels = channels
        self.kernel_size = kernel_size
        self.activation = activation
        self.dtype = dtype
        shape, key = (kernel_size, channels), rngs.params()
        if kernel_std is None:
            bound = 1.0 / kernel_size**0.5  # fan-in of a depthwise filter is K
            kernel = jax.random.uniform(key, shape, param_dtype, -bound, bound)
        else:
            kernel = kernel_std * jax.random.normal(key, shape, param_dtype)
        self.kernel = nnx.Param(kernel)
        self.bias = nnx.Param(jnp.zeros((channels,), param_dtype)) if use_bias else None

    def init_state(self, batch_size: int) -> jax.Array:
        """The empty tail `[B, K−1, C]` float32 (zeros = zero padding)."""
        return jnp.zeros((batch_size, self.kernel_size - 1, self.channels), jnp.float32)

    def _weights(self, x):
        dtype = self.dtype or jnp.result_type(x.dtype, self.kernel.dtype)
        bias = 0.0 if self.bias is None else self.bias[...].astype(dtype)
        return self.kernel[...].astype(dtype), bias, dtype

    def prefill(self, x_BTC: jax.Array, tail_BKC: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Convolve `x[B, T, C]` after `tail`; returns `(y[B, T, C], new tail)`."""
        w_KC, b_C, dtype = self._weights(x_BTC)
        t = x_BTC.shape[1]
        xp_BSC = jnp.concatenate([tail_BKC.astype(dtype), x_BTC.astype(dtype)], axis=1)
        y_BTC = b_C + sum(w_KC[j] * xp_BSC[:, j : j + t] for j in range(self.kernel_size))
        new_tail = xp_BSC[:, t:].astype(jnp.float32)
        return ACTIVATIONS[self.activation](y_BTC), new_tail

    def __call__(self, x_BTC: jax.Array, document_ids_BT: jax.Array | None = None) -> jax.Array:
        """Zero-padded causal convolution of a whole sequence; with `document_ids[B, T]`
        (packed rows, see `layers.segments`) an input from another document counts as zero,
        so no output mixes two documents."""
        if document_ids_BT is None:
            return self.prefill(x_BTC, self.init_state(x_BTC.shape[0]))[0]
        w_KC, b_C, dtype = self._weights(x_BTC)
        k, t = self.kernel_size, x_BTC.shape[1]
        xp_BSC = jnp.concatenate(
            [jnp.zeros((x_BTC.shape[0], k - 1, x_BTC.shape[2]), dtype), x_BTC.astype(dtype)], 1
        )
        # the zero padding belongs to the first document (its value is zero anyway)
        dp_BS = jnp.concatenate([jnp.repeat(document_ids_BT[:, :1], k - 1, 1), document_ids_BT], 1)
        y_BTC = b_C + sum(
            w_KC[j]
            * jnp.where(
                (dp_BS[:, j : j + t] == document_ids_BT)[..., None], xp_BSC[:, j : j + t], 0
            )
            for j in range(k)
        )
        return ACTIVATIONS[self.activation](y_BTC)

    def sequence(self, x_BTC, tail_BKC=None, document_ids_BT=None):
        """`(y [B, T, C], new tail)`: a prefill after `tail`, or with `tail=None` a whole
        sequence: zero-padded, or after the previous shard's last K − 1 inputs when time is
        split (`layers.sequence`); `document_ids` (packed rows, whole sequence only): no output
        reads another document, across a shard boundary too (the tail returned is then None)."""
        axis, k_1 = sequence_axis(), self.kernel_size - 1
        if document_ids_BT is None:
            if tail_BKC is None:
                tail_BKC = self.init_state(x_BTC.shape[0]) if axis is None else None
                tail_BKC = previous_tail(x_BTC, k_1) if tail_BKC is None else tail_BKC
            return self.prefill(x_BTC, tail_BKC)
        if axis is None:
            return self(x_BTC, document_ids_BT), None
        # time split: after the previous shard's last K − 1 inputs and their ids
        tail = previous_tail(x_BTC, k_1).astype(x_BTC.dtype)
        ids = previous_tail(document_ids_BT[..., None].astype(jnp.float32), k_1)[..., 0]
        y_BSC = self(
            jnp.concatenate([tail, x_BTC], axis=1),
            jnp.concatenate([ids.astype(document_ids_BT.dtype), document_ids_BT], axis=1),
        )
        return y_BSC[:, k_1:], None

    def step(self, x_BC: jax.Array, tail_BKC: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One token `x[B, C]`; returns `(y[B, C], new tail)`."""
        y_B1C, tail = self.prefill(x_BC[:, None], tail_BKC)
        return y_B1C[:, 0], tail
