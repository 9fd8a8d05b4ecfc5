"""The log_linear_mamba2 mixer beyond the shared suites: its state size, FLOPs count and
capacity, each against a count by hand."""

import dataclasses

import jax.numpy as jnp
import pytest
from flax import nnx

from linear_attention.layers import get_mixer
from linear_attention.models import ModelConfig, state_size_bytes

D, H = 16, 2  # head width 8


def make(**options):
    return get_mixer("log_linear_mamba2")(D, H, **options, rngs=nnx.Rngs(0))


def test_state_is_the_level_states_and_their_positions():
    """Per layer: L level states H·Dk·Dv float32 and a position per head (int32)."""
    config = ModelConfig(
        vocab_size=32, d_model=D, num_layers=2, num_heads=H, max_length=16,
        mixer="log_linear_mamba2", options=dict(num_levels=5),
    )  # fmt: skip
    assert state_size_bytes(config) == 2 * (4 * 5 * H * 8 * 8 + 4 * H)
    state = make(num_levels=5).init_state(3, 16)
    assert state.core.levels.shape == (3, H, 5, 8, 8) and state.core.position.shape == (3, H)
    # the delta variant: the same level states, and the conv tail (3 × q, k, v channels)
    config = dataclasses.replace(config, mixer="log_linear_gated_deltanet")
    assert state_size_bytes(config) == 2 * (4 * 5 * H * 8 * 8 + 4 * H + 4 * 3 * 48)


def test_mixing_flops_hand_count():
    """chunk: 2·H·(C·(dk + dv) + 2·L·dk·dv); scan: 2·H·(L + 1)·dk·dv; quadratic 2·H·T·(dk + dv),
    L the levels positions below T reach (at most num_levels)."""
    mixer = make(num_levels=6, chunk_size=8)
    assert mixer.mixing_flops(32) == 2 * H * (8 * 16 + 2 * 6 * 64)  # T = 32 reaches level 5
    assert mixer.mixing_flops(4) == 2 * H * (4 * 16 + 2 * 3 * 64)  # C ≤ T; levels 0..2
    assert mixer.mixing_flops(1000, method="scan") == 2 * H * 7 * 64  # capped at num_levels
    assert mixer.mixing_flops(32, method="quadratic") == 2 * H * 32 * 16


def test_capacity_is_refused_clearly():
    mixer = make(num_levels=4)  # positions below 8
    with pytest.raises(ValueError, match=r"max_length=9 exceeds what num_levels=4 covers"):
        mixer.init_state(1, 9)
    with pytest.raises(ValueError, match=r"L=4 levels, which cover positions below 2\^\(L-1\) = 8"):
        mixer(jnp.zeros((1, 9, D)))
    delta = get_mixer("log_linear_gated_deltanet")(D, H, num_levels=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"max_length=9 exceeds what num_levels=4 covers"):
        delta.init_state(1, 9)


def test_delta_mixing_flops_hand_count():
    """chunk: 2·H·(3·C·dk + 2·C·dv + C²/3 + 2·dk·dv + 2·L·dk·dv + L·dk²·dv/C); scan:
    2·H·(3·L + 1)·dk·dv; quadratic: 2·H·T·(3·dk + dv)."""
    mixer = get_mixer("log_linear_gated_deltanet")(D, H, num_levels=6, rngs=nnx.Rngs(0))
    chunk = 3 * 32 * 8 + 2 * 32 * 8 + 32 * 32 / 3 + 2 * 64 + 2 * 6 * 64 + 6 * 8 * 64 / 32
    assert mixer.mixing_flops(32) == pytest.approx(2 * H * chunk)  # C = min(64, T) = 32
    assert mixer.mixing_flops(32, method="scan") == 2 * H * (3 * 6 + 1) * 64
    assert mixer.mixing_flops(32, method="quadratic") == 2 * H * 32 * (3 * 8 + 8)
