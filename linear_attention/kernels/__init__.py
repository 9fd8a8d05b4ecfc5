"""Pure JAX attention kernels on `[batch, time, heads, dim]` arrays: no Flax, no configs, no I/O.

Example, with `from linear_attention import kernels as K` and `phi = K.feature_maps.elu_plus_one`:
`o = K.causal_linear_attention(phi(q), phi(k), v, method="chunk")`.
"""

from linear_attention.kernels import feature_maps
from linear_attention.kernels.delta.checks import METHODS as DELTA_METHODS
from linear_attention.kernels.delta.delta import delta_rule, delta_rule_step
from linear_attention.kernels.delta.delta_product import delta_product, delta_product_step
from linear_attention.kernels.delta.dplr import dplr_delta_rule, dplr_delta_rule_step
from linear_attention.kernels.forgetting.forgetting import (
    ForgettingCache,
    cached_forgetting_attention,
    forgetting_attention,
    forgetting_attention_step,
)
from linear_attention.kernels.linear.linear import (
    METHODS,
    PALLAS_METHODS,
    causal_linear_attention,
    linear_attention,
)
from linear_attention.kernels.linear.recurrent import recurrent_step
from linear_attention.kernels.log_linear.delta import METHODS as LOG_LINEAR_DELTA_METHODS
from linear_attention.kernels.log_linear.delta import (
    log_linear_delta_rule,
    log_linear_delta_rule_step,
)
from linear_attention.kernels.log_linear.fenwick import LogLinearState
from linear_attention.kernels.log_linear.log_linear import METHODS as LOG_LINEAR_METHODS
from linear_attention.kernels.log_linear.log_linear import (
    log_linear_attention,
    log_linear_attention_step,
)
from linear_attention.kernels.mesa_net.mesa_net import (
    MesaNetState,
    mesa_net,
    mesa_net_residual,
    mesa_net_step,
)
from linear_attention.kernels.path.path import (
    cached_path_attention,
    path_attention,
    path_attention_step,
)
from linear_attention.kernels.primitives.pallas import pallas_interpret, pallas_lowering
from linear_attention.kernels.softmax.sliding_window import sliding_window_attention
from linear_attention.kernels.softmax.softmax import (
    blockwise_softmax_attention,
    cached_softmax_attention,
    softmax_attention,
)
from linear_attention.kernels.state import LinearAttentionState

__all__ = [
    "DELTA_METHODS",
    "LOG_LINEAR_DELTA_METHODS",
    "LOG_LINEAR_METHODS",
    "ForgettingCache",
    "METHODS",
    "MesaNetState",
    "PALLAS_METHODS",
    "LinearAttentionState",
    "LogLinearState",
    "blockwise_softmax_attention",
    "cached_forgetting_attention",
    "cached_path_attention",
    "cached_softmax_attention",
    "causal_linear_attention",
    "delta_product",
    "delta_product_step",
    "delta_rule",
    "delta_rule_step",
    "dplr_delta_rule",
    "dplr_delta_rule_step",
    "feature_maps",
    "forgetting_attention",
    "forgetting_attention_step",
    "linear_attention",
    "log_linear_attention",
    "log_linear_attention_step",
    "log_linear_delta_rule",
    "log_linear_delta_rule_step",
    "mesa_net",
    "mesa_net_residual",
    "mesa_net_step",
    "pallas_interpret",
    "pallas_lowering",
    "path_attention",
    "path_attention_step",
    "recurrent_step",
    "sliding_window_attention",
    "softmax_attention",
]
