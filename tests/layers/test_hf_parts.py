"""The parts released hybrids need (Qwen3-Next / Qwen3.5, Kimi Linear), each against a float64
NumPy form, and decoding equal to the full pass: grouped KV heads, q/k RMSNorm, partial rotary
and a sigmoid output gate in `softmax`; a bias-free conv and a head-shared output norm in
`gated_deltanet`; the output norm's eps and a bias-free low-rank gate in `kda`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention.layers import get_mixer
from linear_attention.layers.rotary import apply_rotary
from tests.layers.numpy_reference import mixer_reference
from tests.layers.params import perturb_params

B, T, D = 2, 9, 32
SPLIT = 4
ATTENTION = dict(
    head_dim=8,
    num_kv_heads=2,
    qk_norm=True,
    rope=True,
    rotary_dim=4,
    out_gate=True,
    gate_activation="sigmoid",
)


def _rms64(x, scale):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _rope64(x, positions, r, base=10000.0):
    half = r // 2
    freq = base ** (-np.arange(half) / half)
    angle = positions[:, None] * freq  # [T, r/2]
    cos, sin = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]
    x1, x2, rest = x[..., :half], x[..., half:r], x[..., r:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def attention64(mixer, x):
    """The grouped, q/k-normed, partially rotated, sigmoid-gated attention in float64."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(mixer)))
    h, hk, hd, r = mixer.num_heads, 2, 8, 4
    x = np.asarray(x, np.float64)
    qkv = x @ p["inputs"]["qkv_proj"]["kernel"]
    q = qkv[..., : h * hd].reshape(B, T, h, hd)
    k = qkv[..., h * hd : (h + hk) * hd].reshape(B, T, hk, hd)
    v = qkv[..., (h + hk) * hd :].reshape(B, T, hk, hd)
    q = _rope64(_rms64(q, p["inputs"]["q_norm"]["scale"]), np.arange(T), r)
    k = _rope64(_rms64(k, p["inputs"]["k_norm"]["scale"]), np.arange(T), r)
    k, v = np.repeat(k, h // hk, axis=2), np.repeat(v, h // hk, axis=2)  # head j reads j // 2
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("bhqk,bkhd->bqhd", w / w.sum(-1, keepdims=True), v).reshape(B, T, h * hd)
    gate = 1 / (1 + np.exp(-(x @ p["output"]["gate_proj"]["kernel"])))
    return (o * gate) @ p["output"]["out_proj"]["kernel"]


# compiled once per mixer shape (eager NNX calls dispatch op by op: several times slower here)
_full = nnx.jit(lambda mixer, x: mixer(x))
_prefill = nnx.jit(lambda mixer, x, state: mixer.prefill(x, state))
_step = nnx.jit(lambda mixer, x, state: mixer.step(x, state))


def _paths(mixer, x):
    """(full pass, prefill SPLIT tokens then one step per token)."""
    full = _full(mixer, x)
    y, state = _prefill(mixer, x[:, :SPLIT], mixer.init_state(B, T))
    ys = [y]
    for t in range(SPLIT, T):
        y_t, state = _step(mixer, x[:, t], state)
        ys.append(y_t[:, None])
    return full, jnp.concatenate(ys, axis=1)


def test_grouped_gated_attention_matches_float64_and_decodes():
    mixer = get_mixer("softmax")(D, 4, **ATTENTION, rngs=nnx.Rngs(0))
    perturb_params(mixer, 1)
    x = jax.random.normal(jax.random.key(2), (B, T, D))
    # the cache holds the 2 KV heads, not the 4 query heads
    assert mixer.init_state(B, T).core.k.shape == (B, T, 2, 8)
    assert mixer.inputs.qkv_proj.kernel.shape == (D, (4 + 2 + 2) * 8)
    full, decoded = _paths(mixer, x)
    want = attention64(mixer, x)
    np.testing.assert_allclose(full, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-5)


def test_partial_rotary_leaves_the_other_channels_and_matches_float64():
    x = jax.random.normal(jax.random.key(3), (1, 5, 2, 12))
    positions = jnp.arange(5) + 7
    y = apply_rotary(x, positions, rotary_dim=8, base=500.0)
    want = _rope64(np.asarray(x, np.float64), np.asarray(positions, np.float64), 8, base=500.0)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y[..., 8:], x[..., 8:])
    with pytest.raises(ValueError, match="rotary_dim must be in"):
        apply_rotary(x, positions, rotary_dim=14)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(num_kv_heads=3), "num_kv_heads=3 must divide num_heads=4"),
        (dict(rotary_dim=4), "rotary_dim=4 needs rotary positions"),
        (dict(rope=True, rotary_dim=6, head_dim=4), "rotary_dim=6 must be <= the q/k head"),
        (dict(rope=True, rotary_dim=3), "rotary embedding needs an even rotary_dim"),
        (dict(gate_activation="sigmoid"), "needs out_gate=True"),
        (dict(gate_activation="tanh"), "unknown gate_activation 'tanh'"),
    ],
)
def test_attention_options_refused(options, message):
    with pytest.raises(ValueError, match=message):
        get_mixer("softmax").check_options(D, 4, **options)


def test_bias_free_conv_and_shared_norm_equal_their_general_forms():
    """conv_bias=False is the conv with a zero bias; out_norm_shared is the per-head norm with
    the one scale on every head; and the parts decode as the full pass."""
    common = dict(num_value_heads=4, chunk_size=4)
    lean = get_mixer("gated_deltanet")(
        D, 2, conv_bias=False, out_norm_shared=True, **common, rngs=nnx.Rngs(0)
    )
    general = get_mixer("gated_deltanet")(D, 2, **common, rngs=nnx.Rngs(0))
    perturb_params(lean, 4)
    assert lean.inputs.conv.bias is None and lean.output.norm.scale.shape == (16,)
    params = nnx.to_pure_dict(nnx.state(lean, nnx.Param))
    as_general = nnx.to_pure_dict(nnx.state(general, nnx.Param))
    for name in ("beta_proj", "decay"):
        as_general[name] = params[name]
    as_general["inputs"]["qkv_proj"] = params["inputs"]["qkv_proj"]
    as_general["inputs"]["conv"]["kernel"] = params["inputs"]["conv"]["kernel"]
    as_general["inputs"]["conv"]["bias"] = jnp.zeros_like(as_general["inputs"]["conv"]["bias"])
    as_general["output"]["gate_proj"] = params["output"]["gate_proj"]
    as_general["output"]["out_proj"] = params["output"]["out_proj"]
    as_general["output"]["norm"]["scale"] = jnp.tile(params["output"]["norm"]["scale"], (4, 1))
    state = nnx.state(general, nnx.Param)
    nnx.replace_by_pure_dict(state, as_general)
    nnx.update(general, state)
    x = jax.random.normal(jax.random.key(5), (B, T, D))
    full, decoded = _paths(lean, x)
    np.testing.assert_allclose(full, _full(general, x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(decoded, full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(conv_bias=False, conv=False), "conv_bias=False needs the short conv on"),
        (dict(out_norm_shared=True, out_norm=False), "out_norm_shared=True needs out_norm on"),
    ],
)
def test_delta_options_refused(options, message):
    with pytest.raises(ValueError, match=message):
        get_mixer("gated_deltanet").check_options(D, 2, **options)


def test_kimi_linear_kda_matches_float64_and_decodes():
    """Kimi Linear's KDA layer: a bias-free conv, one output-norm scale shared by the heads with
    eps 1e-5, a low-rank sigmoid output gate without its bias."""
    mixer = get_mixer("kda")(
        D, 2, conv_bias=False, out_norm_shared=True, out_norm_eps=1e-5, gate_bias=False,
        chunk_size=4, rngs=nnx.Rngs(0),
    )  # fmt: skip
    perturb_params(mixer, 6)
    assert mixer.output.gate_up.bias is None and mixer.output.norm.eps == 1e-5
    x = jax.random.normal(jax.random.key(7), (B, T, D))
    full, decoded = _paths(mixer, x)
    np.testing.assert_allclose(full, mixer_reference("kda", mixer, x), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(decoded, full, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="gate_bias=False needs out_gate on"):
        get_mixer("kda").check_options(D, 2, gate_bias=False, out_gate=False)
    with pytest.raises(ValueError, match="out_norm_eps"):
        get_mixer("kda").check_options(D, 2, out_norm_eps=0.0)
