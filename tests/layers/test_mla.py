"""Multi-head latent attention (`mla`) against a float64 NumPy form written from its equations
(low-rank query with its norm or a full one, the normed key/value latent, the key part shared by
the heads, rotary on it or none), decoding equal to the full pass, bad options refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention.layers import get_mixer
from linear_attention.models import LanguageModel, ModelConfig
from tests.layers.numpy_reference import params64, rms_norm, rotate
from tests.layers.params import perturb_params

B, T, D, H = 2, 9, 32, 2
LATENT = dict(head_dim=8, nope_dim=6, rope_dim=4, kv_rank=12)


def mla64(mixer, x, *, q_rank, rope):
    """o W_o with q = x W_q (or RMSNorm(x W_q↓) W_q↑), [c, r] = x W_kv↓, [k_n, v] =
    RMSNorm(c) W_kv↑ per head, k = [k_n, r], softmax over q·k / √(Dn + Dr), in float64."""
    p = params64(mixer)
    inp, dn, dr, dv, r = p["inputs"], 6, 4, 8, 12
    x = np.asarray(x, np.float64)
    if q_rank:
        q = rms_norm(x @ inp["q_down"]["kernel"], inp["q_norm"]["scale"]) @ inp["q_proj"]["kernel"]
    else:
        q = x @ inp["q_proj"]["kernel"]
    q = q.reshape(B, T, H, dn + dr)
    latent = x @ inp["kv_down"]["kernel"]
    c, shared = latent[..., :r], latent[..., r:]
    kv = (rms_norm(c, inp["kv_norm"]["scale"]) @ inp["kv_up"]["kernel"]).reshape(B, T, H, dn + dv)
    shared = shared[:, :, None, :]
    if rope:
        q[..., dn:] = rotate(q[..., dn:], np.arange(T))
        shared = rotate(shared, np.arange(T))
    k = np.concatenate([kv[..., :dn], np.repeat(shared, H, axis=2)], axis=-1)
    v = kv[..., dn:]
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dn + dr)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("bhqk,bkhd->bqhd", w / w.sum(-1, keepdims=True), v).reshape(B, T, H * dv)
    return o @ p["output"]["out_proj"]["kernel"]


@pytest.mark.parametrize(("q_rank", "rope"), [(None, False), (10, True)])
def test_mla_matches_float64_and_decodes(q_rank, rope):
    mixer = get_mixer("mla")(D, H, **LATENT, q_rank=q_rank, rope=rope, rngs=nnx.Rngs(0))
    perturb_params(mixer, 1)
    assert mixer.inputs.kv_down.kernel.shape == (D, 12 + 4)
    assert mixer.inputs.kv_up.kernel.shape == (12, H * (6 + 8))
    assert mixer.init_state(B, T).core.k.shape == (B, T, H, 10)
    x = jax.random.normal(jax.random.key(2), (B, T, D))
    full = nnx.jit(lambda m, x: m(x))(mixer, x)
    ys, state = nnx.jit(lambda m, x, s: m.prefill(x, s))(mixer, x[:, :4], mixer.init_state(B, T))
    ys, step = [ys], nnx.jit(lambda m, x, s: m.step(x, s))
    for t in range(4, T):  # then one token at a time
        y, state = step(mixer, x[:, t], state)
        ys.append(y[:, None])
    decoded = jnp.concatenate(ys, axis=1)
    want = mla64(mixer, x, q_rank=q_rank, rope=rope)
    np.testing.assert_allclose(full, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-5)


def test_mla_model_decodes_in_bfloat16():
    config = ModelConfig(
        vocab_size=30, d_model=D, num_layers=1, num_heads=H, mixer="mla", dtype="bfloat16",
        position="rope", head_dim=LATENT["head_dim"],
        options={k: v for k, v in LATENT.items() if k != "head_dim"},
    )  # fmt: skip
    model = LanguageModel(config, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(3), (B, 5), 0, 30)
    full = nnx.jit(lambda m, t: m(t))(model, tokens)
    assert full.dtype == jnp.float32 and np.isfinite(np.asarray(full)).all()
    prefill = nnx.jit(lambda m, t, s: m.prefill(t, s))
    logits, _ = prefill(model, tokens, model.init_state(B, 5))
    np.testing.assert_allclose(logits, full, rtol=0.05, atol=0.05)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(rope=True, rope_dim=0), "rope needs rope_dim > 0"),
        (dict(rope=True, rope_dim=3), "rotary embedding needs an even rope_dim"),
        (dict(conv=True), "does not use option conv=True"),
        (dict(kv_rank=0), "kv_rank"),
        (dict(num_kv_heads=1), "num_kv_heads"),
    ],
)
def test_mla_options_refused(options, message):
    with pytest.raises(ValueError, match=message):
        get_mixer("mla").check_options(D, H, **options)
