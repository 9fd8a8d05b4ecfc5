"""Mixers: the three paths agree, match a float64 NumPy reference, and reject bad options."""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention import kernels as K
from linear_attention.layers import (
    MIXERS,
    FeatureProjection,
    KVCache,
    MixerState,
    Segments,
    ShortConv,
    TokenShift,
    attention_inputs,
    delta_keys,
    get_mixer,
)
from linear_attention.layers.rotary import apply_rotary
from linear_attention.layers.sequence import split_sequence
from tests.layers.numpy_reference import mixer_reference, output_reference
from tests.mixer_cases import MIXER_CASES

B, T, D, H = 2, 12, 16, 2
SPLIT = 5  # prefill this many tokens, then step

# One case per mixer, each switching on different optional parts so that together they cover
# conv, rope, output norm / gate on every family, and every kernel method.
CASES = {
    "softmax": dict(conv=True, rope=True, out_norm=True, out_gate=True),
    "linear": dict(conv=True, feature_map="elu_plus_one"),
    "linear_taylor2": dict(feature_map="taylor2", rope=True, method="scan"),
    "favor": dict(feature_dim=16, chunk_size=5),
    "taylor": dict(feature_dim=4, conv=True, chunk_size=4, out_gate=True),
    "hedgehog": dict(conv=True, method="quadratic"),
    "retnet": dict(conv=True, rope=True),
    "gated": dict(conv=True),
    "deltanet": dict(chunk_size=5),  # conv, norm and gate on by default
    "deltanet_scan": dict(method="scan", conv=False, allow_neg_eigval=True),
    "gated_deltanet": dict(chunk_size=4, allow_neg_eigval=True, rope=True),
    "gla": dict(conv=True, rope=True, chunk_size=5),
    # window 4 < SPLIT: the prefill overflows the ring buffer and the steps wrap around it
    "swa": dict(window=4, conv=True, rope=True, out_gate=True),
    # grouped value heads (4 value heads read 2 q/k heads), a decay per key channel, rope
    "kda": dict(chunk_size=5, num_value_heads=4, rope=True),
    "gated_deltanet_grouped": dict(num_value_heads=4, conv=False, method="scan"),
    "gated_deltaproduct": dict(chunk_size=4, allow_neg_eigval=True),  # n = 2 (the default)
    "gated_deltaproduct_3": dict(num_householder=3, rope=True, method="scan"),
    # one step per token keeps the kernels' n axis (the parity grid's n = 1 point crashed)
    "gated_deltaproduct_1": dict(num_householder=1, allow_neg_eigval=True, chunk_size=4),
    "rwkv7": dict(chunk_size=5),  # token shift, GroupNorm, bonus and low-rank gate on
    # forgetting attention: the "chunk" kernel, and the reference form with the Pro parts
    "fox": dict(conv=True),
    "fox_quadratic": dict(method="quadratic", rope=True, out_norm=True, out_gate=True),
    # PaTH: the w conv (kernel 3) by default; the forget gate, rope, the Pro parts, kernel 2
    "path": dict(),
    "path_fox": dict(
        forget_gate=True, forget_bias=2.0, rope=True, out_norm=True, out_gate=True, conv=2
    ),
    "path_quadratic": dict(method="quadratic", forget_gate=True, conv=False),
    # the sequential positive control: one cell per head; and with the output norm and gate
    "lstm": dict(),
    "lstm_gated": dict(out_norm=True, out_gate=True),
    # MesaNet: the chunked CG (conv on q/k and the output norm by default, a partial last
    # chunk); the token-by-token CG with rope and the output gate; the exact solve, no conv
    "mesanet": dict(chunk_size=5),
    "mesanet_scan": dict(method="scan", rope=True, out_gate=True, cg_steps=20),
    "mesanet_exact": dict(method="exact", conv=False),
    # log-linear Mamba-2: chunks of 5 across 12 tokens (the prefill of 5 tokens leaves a state
    # at position 5), 5 levels (positions below 16); the quadratic form with rope; the scan
    # without the output gate
    "log_linear_mamba2": dict(conv=True, chunk_size=5, num_levels=5),
    "log_linear_mamba2_quadratic": dict(method="quadratic", rope=True),
    "log_linear_mamba2_scan": dict(method="scan", out_gate=False, num_levels=6),
    # log-linear Gated DeltaNet: the WY chunk form (conv, norm and gate on by default); the
    # chunk-rematerialised scan; the quadratic reference with rope and negative eigenvalues
    "log_linear_gated_deltanet": dict(chunk_size=5, num_levels=5),
    "log_linear_gated_deltanet_scan": dict(method="scan", chunk_size=4),
    "log_linear_gated_deltanet_quadratic": dict(
        method="quadratic", rope=True, allow_neg_eigval=True
    ),
    # Mamba-1: N = 4, expand 2, R = 3, the conv of 3 and its bias off; by the parallel prefix
    "mamba": dict(state_dim=4, dt_rank=3, conv=3, conv_bias=False),
    "mamba_associative": dict(method="associative_scan"),
    # Falcon-Mamba: weightless RMSNorms of δ, B and C (an eps large enough to matter)
    "mamba_bcdt": dict(bcdt_norm_eps=0.1),
    # Griffin's recurrent block: 24 channels in 2 blocks of gates; by the parallel prefix
    "rglru": dict(lru_width=24),
    "rglru_associative": dict(method="associative_scan"),
    # issue 69's families over existing kernels: rwkv6 on shifted k, v and decay, chunks of 5
    # (the prefill of 5 tokens, then steps that read before they write); the scan, no gate
    "rwkv6": dict(chunk_size=5),
    "rwkv6_scan": dict(method="scan", out_gate=False),
    # hgrn2: keys tied to the forget gate, norm over all channels; with the conv and the gate
    "hgrn2": dict(chunk_size=5),
    "hgrn2_gated": dict(conv=True, out_gate=True, method="quadratic"),
    # lightning: MiniMax's layer (norm over all heads, sigmoid gate); the scan without the gate
    "lightning": dict(chunk_size=5),
    "lightning_scan": dict(method="scan", out_gate=False),
    # mlstm: chunks of 5 (a state with its stabiliser after the prefill); the scan with a conv
    "mlstm": dict(chunk_size=5),
    "mlstm_scan": dict(method="scan", conv=True, state_dim=4),
    # gdn2: grouped value heads, chunks of 5; the scan without the conv, negative eigenvalues
    "gdn2": dict(num_value_heads=4, chunk_size=5),
    "gdn2_scan": dict(method="scan", conv=False, allow_neg_eigval=True),
    # comba: grouped value heads, chunks of 5; the scan without the conv or the correction,
    # a wider key (state_dim), negative eigenvalues
    "comba": dict(num_value_heads=4, chunk_size=5, correction_factor=0.5),
    "comba_scan": dict(
        method="scan", conv=False, output_correction=False, state_dim=6, allow_neg_eigval=True
    ),
}
DELTA = ("deltanet", "gated_deltanet", "kda", "gated_deltaproduct")


def mixer_name(case: str) -> str:
    """The registry name of a case: itself, or the part before its last `_` (a variant)."""
    return case if case in MIXERS else case.rsplit("_", 1)[0]


def make(case: str, seed: int = 0, **extra):
    return get_mixer(mixer_name(case))(D, H, **CASES[case], **extra, rngs=nnx.Rngs(seed))


def inputs(seed: int = 1, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), (B, T, D), dtype)


call = nnx.jit(lambda mixer, x: mixer(x))
prefill = nnx.jit(lambda mixer, x, state: mixer.prefill(x, state))
step = nnx.jit(lambda mixer, x, state: mixer.step(x, state))


@nnx.jit
def all_paths(mixer, x_BTD):
    """(__call__, prefill, step from empty, prefill of SPLIT tokens then steps) for one mixer."""

    def scan_steps(state, x_BTD):
        def body(state, x_BD):
            y_BD, state = mixer.step(x_BD, state)
            return state, y_BD

        state, y_TBD = jax.lax.scan(body, state, jnp.swapaxes(x_BTD, 0, 1))
        return jnp.swapaxes(y_TBD, 0, 1), state

    empty = mixer.init_state(B, T + 3)  # a KV cache longer than the sequence: slots stay masked
    full = mixer(x_BTD)
    prefilled, _ = mixer.prefill(x_BTD, empty)
    stepped, _ = scan_steps(empty, x_BTD)
    head, state = mixer.prefill(x_BTD[:, :SPLIT], empty)
    tail, _ = scan_steps(state, x_BTD[:, SPLIT:])
    return full, prefilled, stepped, jnp.concatenate([head, tail], axis=1)


@pytest.mark.parametrize("case", list(CASES))
def test_paths_agree_and_match_numpy_reference(case):
    mixer, x = make(case), inputs()
    full, prefilled, stepped, mixed = all_paths(mixer, x)
    assert full.shape == (B, T, D) and full.dtype == jnp.float32
    tol = MIXER_CASES[mixer_name(case)].tol
    for other in (prefilled, stepped, mixed):
        np.testing.assert_allclose(other, full, rtol=tol, atol=tol)
    reference = (
        mixer_reference(mixer_name(case), mixer, np.asarray(x))
        if case != ("linear_taylor2")
        else None
    )
    if reference is not None:
        np.testing.assert_allclose(full, reference, rtol=1e-4, atol=1e-4)
    assert float(jnp.std(full)) > 1e-3  # not a degenerate (all-zero) output


def test_linear_taylor2_matches_taylor_mixer_reference():
    """`linear` with taylor2 is the taylor kernel on unprojected heads: same NumPy formula."""
    mixer = get_mixer("linear")(D, H, feature_map="taylor2", rngs=nnx.Rngs(0))
    x = inputs()
    np.testing.assert_allclose(
        call(mixer, x), mixer_reference("taylor", mixer, np.asarray(x)), rtol=1e-4, atol=1e-4
    )


def test_linear_feature_scale_matches_numpy_reference():
    """feature_scale c: φ(c·q)·φ(c·k) in every path (after the conv's SiLU, before elu+1)."""
    mixer, x = make("linear", feature_scale=3.0), inputs()
    full, prefilled, stepped, mixed = all_paths(mixer, x)
    for other in (prefilled, stepped, mixed):
        np.testing.assert_allclose(other, full, rtol=1e-4, atol=1e-4)
    ref = mixer_reference("linear", mixer, np.asarray(x), feature_scale=3.0)
    np.testing.assert_allclose(full, ref, rtol=1e-4, atol=1e-4)
    # the same parameters without the scale give another output (elu+1 is not scale-invariant)
    unscaled = mixer_reference("linear", mixer, np.asarray(x))
    assert np.max(np.abs(unscaled - ref)) > 1e-2
    assert make("linear").feature_scale == 1.0


def test_taylor_state_is_the_upper_triangle_size():
    """Based's count: M = 1 + d + d(d+1)/2 = 153 for 16 projected dims (not 1 + d + d² = 273)."""
    mixer = get_mixer("taylor")(D, H, rngs=nnx.Rngs(0))
    core = jax.eval_shape(lambda: mixer.init_state(B, 10)).core
    assert mixer.state_feature_dim == 153
    assert core.kv.shape == (B, H, 153, D // H) and core.k_sum.shape == (B, H, 153)
    assert get_mixer("taylor")(D, H, feature_dim=8, rngs=nnx.Rngs(0)).state_feature_dim == 45


def test_states_have_fixed_size_and_float32():
    x = inputs()
    for name in ("linear", "gated", "gated_deltanet"):
        mixer = make(name)
        empty = mixer.init_state(B, 100)
        _, state = prefill(mixer, x, empty)
        assert isinstance(state, MixerState) and isinstance(state.core, K.LinearAttentionState)
        assert jax.tree.map(jnp.shape, state) == jax.tree.map(jnp.shape, empty)
        assert state.core.kv.dtype == jnp.float32 and state.conv.dtype == jnp.float32
        assert int(state.position) == T
    # the linear state does not depend on max_length; the KV cache does
    lin = make("linear")
    shapes = lambda n: jax.tree.map(jnp.shape, jax.eval_shape(lambda: lin.init_state(B, n)))  # noqa: E731
    assert shapes(10) == shapes(1000)
    cache = jax.eval_shape(lambda: make("softmax").init_state(B, 40)).core
    assert isinstance(cache, KVCache) and cache.k.shape == (B, 40, H, D // H)


def test_softmax_cache_overflow_gives_nan_not_wrong_numbers():
    mixer, x = make("softmax"), inputs()
    y, _ = nnx.jit(lambda m, x: m.step(x[:, 4], m.prefill(x[:, :4], m.init_state(B, 4))[1]))(
        mixer, x
    )
    assert bool(jnp.all(jnp.isnan(y)))
    with pytest.raises(ValueError, match="max_length 4"):
        mixer.prefill(x[:, :5], mixer.init_state(B, 4))


BFLOAT16 = ("gated", "softmax", "gated_deltanet", "swa")
BFLOAT16 += ("log_linear_mamba2", "log_linear_gated_deltanet", "mamba", "mamba_bcdt", "rglru")
BFLOAT16 += ("comba",)


@pytest.mark.parametrize("name", BFLOAT16)
def test_bfloat16_compute(name):
    mixer32 = make(name)
    mixer16 = make(name, dtype=jnp.bfloat16)
    x = inputs()
    y16 = call(mixer16, x.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16 and y16.shape == (B, T, D)
    assert bool(jnp.all(jnp.isfinite(y16)))
    params = nnx.state(mixer16, nnx.Param)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    # same parameters (same seed): bfloat16 is a rounding of the float32 result
    np.testing.assert_allclose(y16.astype(jnp.float32), call(mixer32, x), rtol=0.1, atol=0.05)
    y16_step, state = step(mixer16, x[:, 0].astype(jnp.bfloat16), mixer16.init_state(B, T))
    assert y16_step.dtype == jnp.bfloat16
    leaves = jax.tree.leaves(state.core)  # (log-linear's state also holds int32 positions)
    core_dtypes = {x.dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)}
    assert core_dtypes == (
        {jnp.dtype(jnp.bfloat16)} if name in ("softmax", "swa") else {jnp.dtype("float32")}
    )


def test_mesanet_bfloat16_compute():
    """bfloat16 compute, float32 statistics and solve. Compared before the output norm: the
    solve's error from bfloat16 q and k scales with |H_kv|, not with |o|, so the RMSNorm of a
    head whose o is small magnifies it (0.12 absolute at the default out_norm, measured here)."""
    mixer32, mixer16 = (
        make("mesanet", out_norm=False),
        make("mesanet", out_norm=False, dtype=jnp.bfloat16),
    )
    x = inputs()
    y16 = call(mixer16, x.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(y16)))
    np.testing.assert_allclose(y16.astype(jnp.float32), call(mixer32, x), rtol=0.1, atol=0.05)
    y16_step, state = step(mixer16, x[:, 0].astype(jnp.bfloat16), mixer16.init_state(B, T))
    assert y16_step.dtype == jnp.bfloat16
    assert {leaf.dtype for leaf in jax.tree.leaves(state.core)} == {jnp.dtype("float32")}


def test_favor_redraw_changes_projection_and_stays_finite():
    mixer, x = make("favor"), inputs()
    before = jnp.array(mixer.feature_map.projection[...])
    y_before = call(mixer, x)
    mixer.redraw(jax.random.key(7))
    after = mixer.feature_map.projection[...]
    assert after.shape == before.shape == (16, D // H)
    assert not np.allclose(after, before)
    y_after = call(mixer, x)
    assert bool(jnp.all(jnp.isfinite(y_after)))
    assert not np.allclose(y_after, y_before)
    # a redraw is not a trained parameter: optimizers (wrt=nnx.Param) and gradients skip it
    assert not jax.tree.leaves(nnx.state(mixer, nnx.Param).get("feature_map", {}))
    assert len(jax.tree.leaves(nnx.state(mixer, FeatureProjection))) == 1
    # redraw works under nnx.jit too (the variable update is propagated out)
    nnx.jit(lambda m, key: m.redraw(key))(mixer, jax.random.key(8))
    assert not np.allclose(mixer.feature_map.projection[...], after)


def test_hedgehog_feature_map_receives_gradients():
    mixer, x = make("hedgehog"), inputs()
    grads = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x) ** 2)))(mixer, x)
    g = grads["feature_map"]["weight"][...]
    assert g.shape == (H, D // H, D // H)
    assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).max()) > 1e-6


def test_rotary_is_relative():
    """rope(q, p)·rope(k, s) depends on p − s only."""
    q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, 8))
    pos = lambda p: jnp.array([p], jnp.int32)  # noqa: E731
    dot = lambda p, s: jnp.sum(apply_rotary(q, pos(p)) * apply_rotary(k, pos(s)))  # noqa: E731
    np.testing.assert_allclose(dot(3, 1), dot(10, 8), rtol=1e-5)
    assert not np.isclose(dot(3, 1), dot(3, 2))


BAD_OPTIONS = [
    (dict(name="hyena"), "unknown mixer 'hyena'"),
    (dict(d_model=15), "d_model=15 is not divisible by num_heads=2"),
    (dict(num_heads=0), "num_heads"),
    (dict(head_dim=0), "head_dim"),
    (dict(name="favor", feature_map="relu"), "does not use option feature_map"),
    (dict(name="linear", feature_map="favor_plus"), "unknown feature_map 'favor_plus'"),
    (dict(name="linear", feature_dim=8), "does not use option feature_dim"),
    (dict(name="taylor", feature_dim=0), "feature_dim must be an integer >= 1, got 0"),
    (dict(name="taylor", feature_scale=2.0), "does not use option feature_scale"),
    (dict(name="linear", feature_scale=0.0), "feature_scale must be a finite number > 0"),
    (dict(name="linear", feature_scale=True), "feature_scale must be a finite number > 0"),
    (dict(name="linear", feature_scale=float("inf")), "feature_scale must be"),
    (dict(name="softmax", method="chunk"), "does not use option method"),
    (dict(name="gated", method="fft"), "unknown method 'fft' for mixer 'gated'; allowed: "),
    (dict(name="retnet", chunk_size=0), "chunk_size"),
    (dict(name="retnet", eps=1e-3), "does not use option eps"),
    (dict(name="linear", eps=-1.0), "eps"),
    (dict(conv=1), "conv must be"),
    (dict(out_norm="yes"), "out_norm"),
    (dict(rope=True, head_dim=7), "even q/k head dimension"),
    (dict(name="taylor", rope=True, feature_dim=3), "even q/k head dimension"),
    (dict(rope_base=0.0), "rope_base"),
    (dict(name="deltanet", method="quadratic"), "unknown method 'quadratic' for mixer 'deltanet'"),
    (dict(name="gated_deltanet", eps=1e-3), "does not use option eps"),
    (dict(name="deltanet", allow_neg_eigval=1), "allow_neg_eigval must be a bool"),
    (dict(name="gated_deltanet", chunk_size=0), "chunk_size must be an integer >= 1, got 0"),
    (dict(reset_positions=1), "reset_positions must be a bool"),
    (dict(name="gla", feature_map="relu"), "does not use option feature_map"),
    (dict(name="gla", eps=1e-3), "does not use option eps"),
    (dict(name="swa", window=0), "window must be an integer >= 1, got 0"),
    (dict(name="swa", window=2.5), "window must be an integer >= 1, got 2.5"),
    (dict(name="swa", method="chunk"), "does not use option method"),
    (dict(name="softmax", bogus=1), "mixer 'softmax' does not use option bogus=1"),
    (dict(name="rwkv7", conv=True), "mixer 'rwkv7' does not use option conv=True"),
    (dict(name="rwkv7", rope=True), "mixer 'rwkv7' does not use option rope=True"),
    (dict(name="rwkv7", method="quadratic"), "unknown method 'quadratic' for mixer 'rwkv7'"),
    (dict(name="rwkv7", allow_neg_eigval=True), "does not use option allow_neg_eigval"),
    (dict(name="rwkv7", chunk_size=0), "chunk_size must be an integer >= 1, got 0"),
    (dict(name="lstm", conv=True), "mixer 'lstm' does not use option conv=True"),
    (dict(name="path", forget_bias=1.0), "forget_bias=1.0 only with its forget gate"),
    (dict(name="path", method="scan"), "unknown method 'scan' for mixer 'path'; allowed: chunk, q"),
    (dict(name="lstm", rope=True), "mixer 'lstm' does not use option rope=True"),
    (dict(name="lstm", method="scan"), "mixer 'lstm' does not use option method"),
    (dict(name="mesanet", cg_steps=0), "cg_steps must be an integer >= 1, got 0"),
    (dict(name="mesanet", method="quadratic"), "unknown method 'quadratic' for mixer 'mesanet'"),
    (dict(name="gated", cg_steps=4), "does not use option cg_steps"),
    (dict(name="log_linear_mamba2", num_levels=1), "num_levels must be an integer >= 2"),
    (dict(name="gated", num_levels=4), "does not use option num_levels"),
    (
        dict(name="log_linear_gated_deltanet", num_value_heads=4),
        "does not use option num_value_heads",
    ),
    (
        dict(name="comba", output_correction=False, correction_factor=0.02),
        "correction_factor=0.02 needs output_correction on",
    ),
    (dict(name="comba", method="pallas"), "unknown method 'pallas' for mixer 'comba'"),
]


@pytest.mark.parametrize("options,match", BAD_OPTIONS, ids=[m for _, m in BAD_OPTIONS])
def test_bad_options_raise(options, match):
    options = dict(options)
    name = options.pop("name", "linear")
    d_model = options.pop("d_model", D)
    num_heads = options.pop("num_heads", H)
    with pytest.raises(ValueError, match=match):
        get_mixer(name)(d_model, num_heads, **options, rngs=nnx.Rngs(0))


def test_bad_inputs_raise():
    mixer = make("linear")
    with pytest.raises(ValueError, match=r"\[B, T, D\] with d_model=16"):
        mixer(jnp.zeros((B, T, D + 1)))
    with pytest.raises(ValueError, match=r"\[B, D\]"):
        mixer.step(jnp.zeros((B, 1, D)), mixer.init_state(B, T))
    with pytest.raises(ValueError, match="batch_size"):
        mixer.init_state(0, T)


def test_registry_lists_every_family():
    """Every registered mixer has its row in `tests/mixer_cases.py` (which
    `tests/test_mixer_cases.py` holds against the registry) and its case here."""
    assert set(MIXERS) == set(MIXER_CASES)
    assert set(MIXERS) - {"mla"} <= set(CASES)  # (mla's paths: tests/layers/test_mla.py)
    # every option is declared once, with the same type wherever two mixers share it
    types = {}
    for cls in MIXERS.values():
        for option_name, hint in typing.get_type_hints(cls.Config).items():
            assert types.setdefault(option_name, hint) == hint, (cls.NAME, option_name)
    assert all(cls.NAME == name for name, cls in MIXERS.items())


def _attend64(inputs, *, softmax: bool, normalize: bool, eps: float) -> np.ndarray:
    """o [B, T, H, Dv] from `AttentionInputs` by the formula in its docstring, in float64."""
    q, k, v = (np.asarray(a, np.float64) for a in inputs[:3])
    t = q.shape[1]
    causal = np.tril(np.ones((t, t), bool))
    s_BHTS = np.einsum("bthm,bshm->bhts", q, k)
    if softmax:  # (with a decay: forgetting attention, exp(q·k + Σ log decay))
        logits = np.where(causal, s_BHTS, -np.inf)
        if inputs.log_decay is not None:
            c = np.cumsum(np.asarray(inputs.log_decay, np.float64), axis=1).transpose(0, 2, 1)
            logits = logits + np.where(causal, c[..., :, None] - c[..., None, :], 0.0)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        return np.einsum("bhts,bshd->bthd", w / w.sum(-1, keepdims=True), v)
    if inputs.log_decay is not None:
        c = np.cumsum(np.asarray(inputs.log_decay, np.float64), axis=1)  # [B, T, H(, M)]
        if c.ndim == 3:
            gap = c.transpose(0, 2, 1)[..., :, None] - c.transpose(0, 2, 1)[..., None, :]
            s_BHTS = s_BHTS * np.exp(np.where(causal, gap, 0.0))
        else:  # per key dimension: Σ_m q_tm k_sm exp(c_tm − c_sm)
            gap = c[:, :, None] - c[:, None, :]  # [B, T, S, H, M]
            gap = np.where(causal[None, :, :, None, None], gap, 0.0)
            s_BHTS = np.einsum("bthm,bshm,btshm->bhts", q, k, np.exp(gap))
    w = np.where(causal, s_BHTS, 0.0)
    o = np.einsum("bhts,bshd->bthd", w, v)
    if normalize:
        o = o / (w.sum(-1).transpose(0, 2, 1)[..., None] + eps)
    return o


@pytest.mark.parametrize("case", list(CASES))
def test_attention_inputs_reproduce_the_mixer(case):
    """q, k, v and the decay from `attention_inputs`, mixed by the formula of `AttentionInputs`
    and passed through the output layers, give the float64 reference output of the mixer."""
    name = mixer_name(case)
    mixer, x = make(case), inputs()
    # not AttentionInputs' weighted sum
    late = (
        "mesanet",
        "log_linear_mamba2",
        "log_linear_gated_deltanet",
        "path",
        "mamba",
        "rglru",
        "rwkv6",
        "mlstm",
        "gdn2",
        "comba",
    )
    if name in (*DELTA, "swa", "rwkv7", "lstm", *late):
        with pytest.raises(ValueError, match="has no attention_inputs"):
            attention_inputs(mixer, x)
        return
    a = attention_inputs(mixer, x)
    m = a.q.shape[-1]
    assert a.q.shape == a.k.shape == (B, T, H, m) and a.v.shape == (B, T, H, mixer.head_dim)
    decays = ("retnet", "gated", "gla", "fox", "hgrn2", "lightning")
    assert (a.log_decay is not None) == (name in decays)
    if a.log_decay is not None:  # gla, hgrn2: a decay per key dimension
        shape = (B, T, H, m) if name in ("gla", "hgrn2") else (B, T, H)
        assert a.log_decay.shape == shape and a.log_decay.dtype == jnp.float32
        assert bool(jnp.all(a.log_decay <= 0))
    softmax = name in ("softmax", "fox")
    normalize = softmax or mixer.NORMALIZE
    eps = 0.0 if softmax else mixer.eps
    o = _attend64(a, softmax=softmax, normalize=normalize, eps=eps)
    # linear + taylor2 is the taylor formula on unprojected heads (rope on as well)
    ref = mixer_reference("taylor" if case == "linear_taylor2" else name, mixer, x)
    np.testing.assert_allclose(output_reference(mixer, x, o), ref, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("name", DELTA)
def test_delta_keys_are_the_unit_keys_the_kernel_receives(name, monkeypatch):
    """`delta_keys` gives the k that the mixer's kernel is called with (captured from the
    call), unit vectors, with the n axis of gated_deltaproduct; other mixers raise."""
    mixer, x = get_mixer(name)(D, H, rngs=nnx.Rngs(0)), inputs()
    seen = []
    kernel = type(mixer).KERNEL

    def spy(q, k, v, beta, **kw):
        seen.append(np.asarray(k, np.float32))
        return kernel(q, k, v, beta, **kw)

    monkeypatch.setattr(type(mixer), "KERNEL", staticmethod(spy))
    mixer(x)  # eagerly, so the captured k is an array
    keys = np.asarray(delta_keys(mixer, x))
    shape = (B, T, H, 2, D // H) if name == "gated_deltaproduct" else (B, T, H, D // H)
    assert keys.shape == shape and keys.dtype == np.float32
    np.testing.assert_allclose(keys, seen[0], rtol=1e-6, atol=1e-7)
    # 1 up to L2_EPS = 1e-6 inside the norm's square root (1 − norm ≤ 1.3e-5 here)
    np.testing.assert_allclose(np.linalg.norm(keys, axis=-1), 1.0, atol=1e-4)
    with pytest.raises(ValueError, match="has no delta_keys"):
        delta_keys(get_mixer("gla")(D, H, rngs=nnx.Rngs(0)), x)


@pytest.mark.parametrize("name", DELTA)
def test_delta_mixer_defaults_and_state(name):
    mixer = get_mixer(name)(D, H, rngs=nnx.Rngs(0))
    assert mixer.inputs.conv is not None and mixer.inputs.conv.kernel_size == 4  # on by default
    assert mixer.output.norm is not None and mixer.output.gate_proj is not None
    assert mixer.method == "chunk" and not mixer.allow_neg_eigval
    assert get_mixer(name)(D, H, conv=False, rngs=nnx.Rngs(0)).inputs.conv is None
    core = mixer.init_state(B, 10).core
    assert core.k_sum is None and core.kv.shape == (B, H, D // H, D // H)
    assert (name != "deltanet") == (mixer.decay is not None)  # deltanet: no decay
    # β = sigmoid, or 2·sigmoid with allow_neg_eigval: the same projection, doubled
    neg = get_mixer(name)(D, H, allow_neg_eigval=True, rngs=nnx.Rngs(0))
    x = inputs()
    np.testing.assert_allclose(neg.beta(x), 2.0 * mixer.beta(x), rtol=1e-6)
    assert float(jnp.max(neg.beta(x))) > 1.0


# Packed rows: ids are compared with the previous token's, so row 0's id 5 coming back is a third
# document; row 1 has a one-token document.
SEGMENTS = np.array([[5, 5, 5, 2, 2, 2, 2, 5, 5, 5, 5, 5], [0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 2]])
DOCUMENTS = [[(0, 3), (3, 7), (7, 12)], [(0, 4), (4, 5), (5, 12)]]  # [start, end) per row

call_segments = nnx.jit(lambda mixer, x, seg: mixer(x, seg))


def test_one_householder_step_is_gated_deltanet():
    """gated_deltaproduct with n = 1 is Gated DeltaNet: the same parameter tree, drawn the same
    from one seed, and the same outputs and gradients (eagerly; under jit XLA may round them
    differently, docs/studies/state_tracking.md, "How much one run says")."""
    options = dict(allow_neg_eigval=True, chunk_size=4, rngs=nnx.Rngs(3))
    product = get_mixer("gated_deltaproduct")(D, H, num_householder=1, **options)
    options["rngs"] = nnx.Rngs(3)
    delta = get_mixer("gated_deltanet")(D, H, **options)
    assert jax.tree.map(jnp.shape, nnx.state(product)) == jax.tree.map(jnp.shape, nnx.state(delta))
    leaves = [jax.tree.leaves(nnx.state(m)) for m in (product, delta)]
    for a, b in zip(*leaves, strict=True):
        np.testing.assert_array_equal(a, b)
    x = inputs()
    w = jnp.cos(jnp.arange(B * T * D, dtype=jnp.float32)).reshape(B, T, D)
    grads = [
        nnx.grad(lambda m, x: jnp.sum(m(x) * w), argnums=(0, 1))(m, x) for m in (product, delta)
    ]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(product(x), delta(x), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", [c for c in CASES if MIXER_CASES[mixer_name(c)].segment_ids])
def test_packed_rows_match_each_document_alone(case):
    """mixer(x, segment_ids) equals the float64 reference run on each document alone (its own
    zero-padded conv, rotary positions from 0, an empty state)."""
    name = "taylor" if case == "linear_taylor2" else mixer_name(case)  # (see above)
    mixer, x = make(case), inputs()
    y = call_segments(mixer, x, jnp.asarray(SEGMENTS, jnp.int32))
    x64 = np.asarray(x, np.float64)
    for row, documents in enumerate(DOCUMENTS):
        for start, end in documents:
            alone = mixer_reference(name, mixer, x64[row : row + 1, start:end])
            np.testing.assert_allclose(y[row, start:end], alone[0], rtol=1e-4, atol=1e-4)
    # and the documents did matter: without segments the later documents differ
    assert not np.allclose(call(mixer, x)[:, 7:], y[:, 7:], atol=1e-3)


def test_conv_reads_no_other_document_by_gradients():
    """d y_t / d x_s of the segment-aware short conv is zero across a boundary, nonzero within
    the kernel's reach inside a document."""
    conv = ShortConv(3, 4, rngs=nnx.Rngs(0))
    docs = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2]], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (1, 10, 3))
    # one compiled gradient for every t (t traced)
    grad_at = nnx.jit(lambda conv, x, t: jax.grad(lambda x: jnp.sum(conv(x, docs)[:, t]))(x))
    for t in range(10):
        g = grad_at(conv, x, t)[0]  # [T, C]
        reach = jnp.abs(g).sum(-1) > 0
        doc = np.asarray(docs[0])
        want = (doc == doc[t]) & (np.arange(10) <= t) & (np.arange(10) > t - 4)
        np.testing.assert_array_equal(reach, want)
    # one document: the same numbers as the plain conv
    np.testing.assert_allclose(conv(x, jnp.zeros((1, 10), jnp.int32)), conv(x), rtol=1e-6)


def test_segment_helpers_hand_cases():
    seg = jnp.asarray([[7, 7, 3, 3, 3, 7], [1, 2, 3, 3, 3, 3]])
    segments = Segments.from_ids(seg, 2, 6)
    np.testing.assert_array_equal(segments.ids, [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]])
    np.testing.assert_array_equal(segments.positions, [[0, 1, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3]])
    np.testing.assert_array_equal(segments.starts, [[1, 0, 1, 0, 0, 1], [1, 1, 1, 0, 0, 0]])


def test_bad_segment_ids_raise():
    mixer, x = make("gated"), inputs()
    with pytest.raises(
        ValueError, match=r"segment_ids must be integers of shape \[B, T\] = \(2, 12\)"
    ):
        mixer(x, jnp.zeros((B, T + 1), jnp.int32))
    with pytest.raises(ValueError, match="dtype float32"):
        mixer(x, jnp.zeros((B, T), jnp.float32))
    with pytest.raises(ValueError, match=r"got shape \(12,\)"):
        mixer(x, jnp.zeros((T,), jnp.int32))


def test_swa_split_time_needs_shards_of_window_minus_one():
    """Under a split time axis each shard takes a halo of window − 1 keys from the one before:
    a shorter shard raises, naming the window and config.mesh.seq (trace time, one device)."""
    from jax.sharding import PartitionSpec as P

    mixer = get_mixer("swa")(D, H, window=T + 2, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(mixer)

    def split_call(state, x):
        with split_sequence("seq"):
            return nnx.merge(graphdef, state)(x)

    mesh = jax.make_mesh((1,), ("seq",))
    f = jax.shard_map(split_call, mesh=mesh, in_specs=(P(), P()), out_specs=P())
    with pytest.raises(ValueError, match=r"swa window=14 needs shards of at least .* = 13 tokens"):
        f(state, inputs())


def test_swa_prefills_in_pieces_wrap_the_ring_buffer():
    """Prefills of 3, 6, 1 and 2 tokens (each from the state the previous one left, the ring of
    window 4 overwritten several times) give the whole-sequence output; the state stays
    [B, window, H, D] whatever init_state's max_length."""
    mixer, x = make("swa"), inputs()

    @nnx.jit
    def pieces(mixer, x_BTD):
        state, ys = mixer.init_state(B, 1000), []
        for start, stop in ((0, 3), (3, 9), (9, 10), (10, 12)):
            y, state = mixer.prefill(x_BTD[:, start:stop], state)
            ys.append(y)
        return jnp.concatenate(ys, axis=1), state

    y, state = pieces(mixer, x)
    np.testing.assert_allclose(y, call(mixer, x), rtol=1e-4, atol=1e-4)
    assert state.core.k.shape == (B, 4, H, D // H) and int(state.position) == T


def test_token_shift_hand_case():
    """x_{t−1} per token: zeros before the first token and at a document start; the tail
    carries the last input into the next call."""
    shift = TokenShift(2)
    x = jnp.arange(1.0, 11.0).reshape(1, 5, 2)  # tokens (1, 2), (3, 4), …, (9, 10)
    prev, tail = shift(x, None)
    np.testing.assert_array_equal(prev[0], [[0, 0], [1, 2], [3, 4], [5, 6], [7, 8]])
    np.testing.assert_array_equal(tail, [[[9, 10]]])
    segments = Segments.from_ids(jnp.asarray([[0, 0, 1, 1, 1]], jnp.int32), 1, 5)
    prev, _ = shift(x, None, segments)
    np.testing.assert_array_equal(prev[0], [[0, 0], [1, 2], [0, 0], [5, 6], [7, 8]])
    step_prev, _ = shift(x[:, :1] + 100, tail)  # the next token reads the previous call's last
    np.testing.assert_array_equal(step_prev, [[[9, 10]]])


def test_rwkv7_with_random_parameters_matches_its_formulas():
    """Every parameter perturbed (RWKV-7 starts its LoRA first factors at zero, which would
    leave tanh(x W₁) and the in-context rate's projection untested): the sequence path, the
    scan method and prefill-then-steps equal the float64 loop written from RWKV-7's formulas
    (its own state orientation and decay form exp(−exp(ω)))."""
    mixer = make("rwkv7")
    params = nnx.state(mixer, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    noisy = [p + 0.3 * jax.random.normal(key, p.shape) for p, key in zip(leaves, keys, strict=True)]
    nnx.update(mixer, jax.tree.unflatten(treedef, noisy))
    x = inputs()
    full, _, _, mixed = all_paths(mixer, x)
    reference = mixer_reference("rwkv7", mixer, np.asarray(x))
    np.testing.assert_allclose(full, reference, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(mixed, reference, rtol=1e-4, atol=1e-4)
    # the decay per key channel lies in (−e^(−½), 0); the rate a in (0, 1) varies by token
    log_decay = mixer.decay(x)
    assert log_decay.shape == (B, T, H, D // H) and log_decay.dtype == jnp.float32
    assert bool(jnp.all((log_decay < 0) & (log_decay > -np.exp(-0.5))))
    assert float(jnp.std(log_decay)) > 1e-3


def test_path_parts_and_state():
    """FLA's layer defaults (w conv of kernel 3, no gate), the gate's initial bias, and the KV
    cache: keys float32 (rewritten by every token's H_t), values in the compute dtype."""
    mixer = get_mixer("path")(D, H, rngs=nnx.Rngs(0))
    assert mixer.inputs.conv.kernel_size == 3 and mixer.inputs.qkv.conv is None
    assert mixer.forget_gate is None and mixer.inputs.w_down.kernel.shape == (D, 32)
    gated = make("path_fox")
    np.testing.assert_array_equal(gated.forget_gate.bias[...], 2.0)
    mixer16 = get_mixer("path")(D, H, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    y16, state = step(mixer16, inputs()[:, 0].astype(jnp.bfloat16), mixer16.init_state(B, 7))
    assert y16.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(y16)))
    core = state.core
    assert core.k.shape == (B, 7, H, D // H) and core.k.dtype == jnp.float32
    assert core.v.dtype == jnp.bfloat16 and state.conv.shape == (B, 2, D)
    y32 = step(mixer, inputs()[:, 0], mixer.init_state(B, 7))[0]
    np.testing.assert_allclose(y16.astype(jnp.float32), y32, rtol=0.1, atol=0.05)


def test_rwkv7_parts_and_state():
    mixer = get_mixer("rwkv7")(D, H, rngs=nnx.Rngs(0))
    assert mixer.method == "chunk" and mixer.output.gate_inside
    assert mixer.output.norm is not None and mixer.output.gate_up.bias is None
    state = mixer.init_state(B, 10)
    assert state.core.k_sum is None and state.core.kv.shape == (B, H, D // H, D // H)
    assert state.conv.shape == (B, 1, D) and state.conv.dtype == jnp.float32  # the last input
    # at init (zero LoRA first factors) the decay is w₀'s: log γ in about [−0.11, −0.001]
    log_decay = mixer.decay(inputs())
    assert -0.12 < float(log_decay.min()) < float(log_decay.max()) < -5e-4
    bare = get_mixer("rwkv7")(D, H, out_norm=False, out_gate=False, rngs=nnx.Rngs(0))
    assert bare.output.norm is None and bare.output.gate_proj is None
    x = inputs()
    np.testing.assert_allclose(
        call(bare, x), mixer_reference("rwkv7", bare, np.asarray(x)), rtol=1e-4, atol=1e-4
    )
