"""Pure JAX attention kernels on `[batch, time, heads, dim]` arrays: no Flax, no configs, no I/O."""

from linear_attention.kernels import feature_maps
from linear_attention.kernels.softmax import blockwise_softmax_attention, softmax_attention

__all__ = [
    "feature_maps",
    "softmax_attention",
    "blockwise_softmax_attention",
]
