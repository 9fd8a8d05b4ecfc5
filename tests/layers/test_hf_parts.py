"""The parts released hybrids need (Qwen3-Next / Qwen3.5, Kimi Linear, OLMo Hybrid), each
against a float64 NumPy form, and decoding equal to the full pass: grouped KV heads, q/k RMSNorm
(per head, or over all heads at once), partial rotary and a sigmoid output gate in `softmax`; a
bias-free conv, a head-shared output norm and its eps, and keys narrower than the values in
`gated_deltanet`; the output norm's eps and a bias-free low-rank gate in `kda`; the post-norm
block."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention.layers import Block, get_mixer
from linear_attention.layers.rotary import apply_rotary
from tests.layers.numpy_reference import mixer_reference, params64, silu
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


def _rms64(x, scale, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope64(x, positions, r, base=10000.0):
    half = r // 2
    freq = base ** (-np.arange(half) / half)
    angle = positions[:, None] * freq  # [T, r/2]
    cos, sin = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]
    x1, x2, rest = x[..., :half], x[..., half:r], x[..., r:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def attention64(mixer, x, r=4, all_heads=False):
    """The grouped, q/k-normed, rotated (the first `r` channels), sigmoid-gated attention in
    float64; `all_heads`: q and k normalised over all their heads' channels at once."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(mixer)))
    h, hk, hd = mixer.num_heads, 2, 8
    x = np.asarray(x, np.float64)
    qkv = x @ p["inputs"]["qkv_proj"]["kernel"]
    q, k = qkv[..., : h * hd], qkv[..., h * hd : (h + hk) * hd]
    v = qkv[..., (h + hk) * hd :].reshape(B, T, hk, hd)
    if all_heads:  # one norm over the h·hd (hk·hd) channels, then the heads
        q = _rms64(q, p["inputs"]["q_norm"]["scale"]).reshape(B, T, h, hd)
        k = _rms64(k, p["inputs"]["k_norm"]["scale"]).reshape(B, T, hk, hd)
    else:
        q = _rms64(q.reshape(B, T, h, hd), p["inputs"]["q_norm"]["scale"])
        k = _rms64(k.reshape(B, T, hk, hd), p["inputs"]["k_norm"]["scale"])
    q, k = _rope64(q, np.arange(T), r), _rope64(k, np.arange(T), r)
    k, v = np.repeat(k, h // hk, axis=2), np.repeat(v, h // hk, axis=2)  # head j reads j // 2
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("bhqk,bkhd->bqhd", w / w.sum(-1, keepdims=True), v).reshape(B, T, h * hd)
    if "gate_proj" in p["output"]:
        o = o / (1 + np.exp(-(x @ p["output"]["gate_proj"]["kernel"])))
    return o @ p["output"]["out_proj"]["kernel"]


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


def test_qk_norm_over_all_heads_matches_float64_and_decodes():
    """OLMo's q/k norm: one RMSNorm over q's 4·8 channels and one over k's 2·8, before rotary;
    no output gate."""
    options = dict(head_dim=8, num_kv_heads=2, qk_norm=True, qk_norm_all_heads=True, rope=True)
    mixer = get_mixer("softmax")(D, 4, **options, rngs=nnx.Rngs(0))
    perturb_params(mixer, 6)
    assert mixer.inputs.q_norm.scale.shape == (32,) and mixer.inputs.k_norm.scale.shape == (16,)
    x = jax.random.normal(jax.random.key(7), (B, T, D))
    full, decoded = _paths(mixer, x)
    np.testing.assert_allclose(
        full, attention64(mixer, x, r=8, all_heads=True), rtol=1e-4, atol=1e-5
    )
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
        (dict(qk_norm_all_heads=True), "qk_norm_all_heads=True needs qk_norm=True"),
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


def test_gated_deltanet_keys_narrower_than_values_match_float64_and_decode():
    """OLMo Hybrid's Gated DeltaNet: 2 key heads of 8 (`state_dim`), 4 value heads of 16, the
    state [4, 8, 16]; the output norm's eps (`out_norm_eps`, large here so that it shows)."""
    options = dict(head_dim=16, state_dim=8, num_value_heads=4, conv_bias=False)
    options.update(out_norm_shared=True, out_norm_eps=0.5, allow_neg_eigval=True, chunk_size=4)
    mixer = get_mixer("gated_deltanet")(D, 2, **options, rngs=nnx.Rngs(0))
    perturb_params(mixer, 8)
    assert mixer.inputs.qkv_proj.kernel.shape == (D, 2 * 2 * 8 + 4 * 16)
    assert mixer.init_state(B, T).core.kv.shape == (B, 4, 8, 16)
    x = jax.random.normal(jax.random.key(9), (B, T, D))
    full, decoded = _paths(mixer, x)
    want = mixer_reference("gated_deltanet", mixer, np.asarray(x))
    np.testing.assert_allclose(full, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(decoded, full, rtol=1e-4, atol=1e-5)


def test_post_norm_block_matches_float64_and_decodes():
    """norm_position="post": x + RMSNorm(mixer(x)), then h + RMSNorm(mlp(h)) (OLMo 2's order);
    the mixer reads the residual stream itself."""
    block = Block(
        D,
        4,
        "softmax",
        mixer_options=dict(rope=True),
        mlp_dim=24,
        norm_position="post",
        rngs=nnx.Rngs(0),
    )
    perturb_params(block, 10)
    x = jax.random.normal(jax.random.key(11), (B, T, D))
    p, x64 = params64(block), np.asarray(x, np.float64)
    h = x64 + _rms64(mixer_reference("softmax", block.mixer, x64), p["mixer_norm"]["scale"])
    mlp = p["mlp"]
    up = silu(h @ mlp["w_gate"]["kernel"]) * (h @ mlp["w_up"]["kernel"])
    want = h + _rms64(up @ mlp["w_down"]["kernel"], p["mlp_norm"]["scale"])
    full, decoded = _paths(block, x)
    np.testing.assert_allclose(full, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(block.mixer_input(x), x)
    with pytest.raises(ValueError, match="unknown norm_position 'middle'; allowed: pre, post"):
        Block(D, 4, "softmax", norm_position="middle", rngs=nnx.Rngs(0))
