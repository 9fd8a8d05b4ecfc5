"""Pure JAX attention kernels on `[batch, time, heads, dim]` arrays: no Flax, no configs, no I/O.

Example, with `from linear_attention import kernels as K` and `phi = K.feature_maps.elu_plus_one`:
`o = K.causal_linear_attention(phi(q), phi(k), v, method="chunk")`.
"""

from linear_attention.kernels import feature_maps
from linear_attention.kernels.comba.comba import COMBA, comba, comba_step
from linear_attention.kernels.delta.delta import DELTA_RULE, delta_rule, delta_rule_step
from linear_attention.kernels.delta.delta_product import (
    DELTA_PRODUCT,
    delta_product,
    delta_product_step,
)
from linear_attention.kernels.delta.dplr import DPLR, dplr_delta_rule, dplr_delta_rule_step
from linear_attention.kernels.forgetting.forgetting import (
    FORGETTING,
    ForgettingCache,
    cached_forgetting_attention,
    forgetting_attention,
    forgetting_attention_step,
)
from linear_attention.kernels.gated_oja_rule.gated_oja_rule import (
    GATED_OJA,
    gated_oja_rule,
    gated_oja_rule_step,
)
from linear_attention.kernels.linear.linear import (
    LINEAR,
    METHODS,
    PALLAS_METHODS,
    causal_linear_attention,
    linear_attention,
)
from linear_attention.kernels.linear.recurrent import recurrent_step
from linear_attention.kernels.log_linear.delta import (
    LOG_LINEAR_DELTA,
    log_linear_delta_rule,
    log_linear_delta_rule_step,
)
from linear_attention.kernels.log_linear.fenwick import LogLinearState
from linear_attention.kernels.log_linear.log_linear import (
    LOG_LINEAR,
    log_linear_attention,
    log_linear_attention_step,
)
from linear_attention.kernels.mesa_net.mesa_net import (
    MESA_NET,
    MesaNetState,
    mesa_net,
    mesa_net_residual,
    mesa_net_step,
)
from linear_attention.kernels.path.path import (
    PATH,
    cached_path_attention,
    path_attention,
    path_attention_step,
)
from linear_attention.kernels.primitives.family import Family, Method
from linear_attention.kernels.primitives.pallas import pallas_interpret, pallas_lowering
from linear_attention.kernels.rg_lru.rg_lru import RG_LRU, rg_lru, rg_lru_step
from linear_attention.kernels.selective_scan.selective_scan import (
    SELECTIVE_SCAN,
    selective_scan,
    selective_scan_step,
)
from linear_attention.kernels.softmax.sliding_window import sliding_window_attention
from linear_attention.kernels.softmax.softmax import (
    blockwise_softmax_attention,
    cached_softmax_attention,
    softmax_attention,
)
from linear_attention.kernels.state import LinearAttentionState

# Every kernel family with a `method`, by its entry point's name (`primitives.family`).
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        LINEAR,
        DELTA_RULE,
        DELTA_PRODUCT,
        DPLR,
        LOG_LINEAR,
        LOG_LINEAR_DELTA,
        MESA_NET,
        PATH,
        FORGETTING,
        RG_LRU,
        SELECTIVE_SCAN,
        COMBA,
        GATED_OJA,
    )
}
# The methods of a family that run on every backend (the old per-family lists).
DELTA_METHODS = tuple(m for m in DELTA_RULE.supported if not DELTA_RULE.backends(m))
LOG_LINEAR_METHODS = LOG_LINEAR.supported
LOG_LINEAR_DELTA_METHODS = LOG_LINEAR_DELTA.supported

__all__ = [
    "FAMILIES",
    "Family",
    "Method",
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
    "comba",
    "comba_step",
    "delta_product",
    "delta_product_step",
    "delta_rule",
    "delta_rule_step",
    "dplr_delta_rule",
    "dplr_delta_rule_step",
    "feature_maps",
    "forgetting_attention",
    "forgetting_attention_step",
    "gated_oja_rule",
    "gated_oja_rule_step",
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
    "rg_lru",
    "rg_lru_step",
    "selective_scan",
    "selective_scan_step",
    "sliding_window_attention",
    "softmax_attention",
]
