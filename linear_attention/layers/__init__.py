"""Flax NNX modules: feature maps, attention mixers (one registry), norms, MLP, blocks."""

from linear_attention.layers.analysis import AttentionInputs, attention_inputs, delta_keys
from linear_attention.layers.base import Mixer, MixerState
from linear_attention.layers.block import Block
from linear_attention.layers.conv import ShortConv
from linear_attention.layers.decays import (
    ChannelDecay,
    FixedDecay,
    KeyDecay,
    RWKV7Decay,
    ScalarDecay,
)
from linear_attention.layers.feature_maps import (
    FIXED_FEATURE_MAPS,
    FavorFeatures,
    FeatureProjection,
    FixedFeatureMap,
    HedgehogFeatures,
)
from linear_attention.layers.lstm import LSTMState
from linear_attention.layers.mla import LatentProjection
from linear_attention.layers.mlp import SwiGLU
from linear_attention.layers.moe import (
    MoE,
    RouterStats,
    add_router_stats,
    load_balancing_loss,
    router_stats,
)
from linear_attention.layers.norm import LayerNorm, RMSNorm
from linear_attention.layers.options import COMMON_OPTIONS, MixerConfig, Option
from linear_attention.layers.output import OutputStage
from linear_attention.layers.projections import LowRank, QKVProjection, ShiftedInputs, TokenShift
from linear_attention.layers.registry import MIXERS, get_mixer
from linear_attention.layers.rotary import apply_rotary
from linear_attention.layers.segments import Segments, segments_of
from linear_attention.layers.sliding_window import RingBuffer
from linear_attention.layers.softmax import KVCache

# Every registered mixer's class, exported under its class name: the registry is the one list.
globals().update({cls.__name__: cls for cls in MIXERS.values()})

__all__ = [
    "MIXERS",
    "get_mixer",
    "AttentionInputs",
    "attention_inputs",
    "delta_keys",
    "COMMON_OPTIONS",
    "MixerConfig",
    "Option",
    "Segments",
    "segments_of",
    "QKVProjection",
    "TokenShift",
    "ShiftedInputs",
    "LowRank",
    "OutputStage",
    "FixedDecay",
    "ScalarDecay",
    "KeyDecay",
    "ChannelDecay",
    "RWKV7Decay",
    "Mixer",
    "MixerState",
    "KVCache",
    "RingBuffer",
    "Block",
    "ShortConv",
    "RMSNorm",
    "LayerNorm",
    "SwiGLU",
    "MoE",
    "RouterStats",
    "router_stats",
    "add_router_stats",
    "load_balancing_loss",
    "apply_rotary",
    "FIXED_FEATURE_MAPS",
    "FeatureProjection",
    "FixedFeatureMap",
    "FavorFeatures",
    "HedgehogFeatures",
    "LatentProjection",
    "LSTMState",
    *(cls.__name__ for cls in MIXERS.values()),
]
