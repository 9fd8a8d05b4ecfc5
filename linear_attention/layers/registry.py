"""Mixer registry: one dict from name to class, and the named hybrids of the sweeps."""

from __future__ import annotations

from linear_attention.fields import did_you_mean
from linear_attention.layers.base import Mixer
from linear_attention.layers.comba import CombaMixer
from linear_attention.layers.delta import DeltaNetMixer, GatedDeltaNetMixer
from linear_attention.layers.delta_product import GatedDeltaProductMixer
from linear_attention.layers.fox import FoxMixer
from linear_attention.layers.gdn2 import GDN2Mixer
from linear_attention.layers.kda import KDAMixer
from linear_attention.layers.lightning import LightningMixer
from linear_attention.layers.linear import (
    FavorMixer,
    GatedMixer,
    GLAMixer,
    HedgehogMixer,
    HGRN2Mixer,
    LinearMixer,
    RetNetMixer,
    TaylorMixer,
)
from linear_attention.layers.log_linear import LogLinearGatedDeltaNetMixer, LogLinearMamba2Mixer
from linear_attention.layers.lstm import LSTMMixer
from linear_attention.layers.mamba import MambaMixer
from linear_attention.layers.mesanet import MesaNetMixer
from linear_attention.layers.mla import MLAMixer
from linear_attention.layers.mlstm import MLSTMMixer
from linear_attention.layers.path import PathMixer
from linear_attention.layers.rglru import RGLRUMixer
from linear_attention.layers.rwkv6 import RWKV6Mixer
from linear_attention.layers.rwkv7 import RWKV7Mixer
from linear_attention.layers.sliding_window import SlidingWindowMixer
from linear_attention.layers.softmax import SoftmaxMixer

MIXERS: dict[str, type[Mixer]] = {
    cls.NAME: cls
    for cls in (
        SoftmaxMixer,
        MLAMixer,
        LinearMixer,
        FavorMixer,
        TaylorMixer,
        HedgehogMixer,
        RetNetMixer,
        GatedMixer,
        DeltaNetMixer,
        GatedDeltaNetMixer,
        GLAMixer,
        SlidingWindowMixer,
        KDAMixer,
        GatedDeltaProductMixer,
        RWKV7Mixer,
        FoxMixer,
        PathMixer,
        LSTMMixer,
        MesaNetMixer,
        LogLinearMamba2Mixer,
        LogLinearGatedDeltaNetMixer,
        MambaMixer,
        RGLRUMixer,
        RWKV6Mixer,
        HGRN2Mixer,
        LightningMixer,
        MLSTMMixer,
        GDN2Mixer,
        CombaMixer,
    )
}


# The mixer of a model or block that names none.
DEFAULT_MIXER = "linear"
# Hybrids the studies name (sweep labels): a pattern of registered mixers.
HYBRIDS: dict[str, tuple[str, ...]] = {"based": ("taylor", "swa")}


def get_mixer(name: str) -> type[Mixer]:
    """The mixer class registered under `name`; ValueError listing the known names otherwise."""
    if name not in MIXERS:
        hint = did_you_mean(name, MIXERS)
        raise ValueError(f"unknown mixer {name!r}{hint}; known mixers: {', '.join(MIXERS)}")
    return MIXERS[name]
