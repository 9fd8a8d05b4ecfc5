"""Forgetting attention (FoX): both methods, the cached decoding path and the gradients against
the float64 token-by-token loop of `reference.py`, with resets, packed rows and strong gates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K
from linear_attention.kernels.softmax.gated_cache import empty_cache
from tests.kernels.reference import forgetting_attention_loop, rel_err

B, T, H, D, DV = 2, 11, 2, 4, 3


def inputs(seed=0, t=T, strong=False):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k = (jax.random.normal(x, (B, t, H, D)) for x in keys[:2])
    v = jax.random.normal(keys[2], (B, t, H, DV))
    a = jax.nn.log_sigmoid(jax.random.normal(keys[3], (B, t, H)) + 1.0)
    if strong:  # −30 per token on one head: only the newest keys count there
        a = a.at[:, :, 1].set(-30.0)
    return q, k, v, a


@pytest.mark.parametrize("method", K.FORGETTING.supported)
@pytest.mark.parametrize("case", ["plain", "strong", "reset", "segments", "no_gate"])
def test_matches_the_float64_loop(method, case):
    q, k, v, a = inputs(strong=case == "strong")
    seg = None
    if case == "reset":  # a reset mid-sequence on one head of one row
        a = a.at[0, 6, 1].set(-jnp.inf)
    if case == "segments":
        seg = jnp.asarray([[0] * 4 + [1] * 7, [5] * 9 + [2] * 2], jnp.int32)
    if case == "no_gate":
        a = None
    out = K.forgetting_attention(q, k, v, a, method=method, block_size=4, segment_ids=seg)
    want = forgetting_attention_loop(q, k, v, a, segment_ids=seg)
    assert out.shape == (B, T, H, DV) and out.dtype == jnp.float32
    assert rel_err(out, want) < 1e-5


def test_gradients_of_both_methods_agree_with_finite_differences():
    q, k, v, a = inputs(seed=3, t=7)
    w = jax.random.normal(jax.random.key(9), (B, 7, H, DV))

    def loss(method):
        def f(q, k, v, a):
            o = K.forgetting_attention(q, k, v, a, method=method, block_size=3)
            return jnp.sum(o * w)

        return f

    grads = jax.jit(jax.grad(loss("chunk"), argnums=(0, 1, 2, 3)))(q, k, v, a)
    ref = jax.jit(jax.grad(loss("quadratic"), argnums=(0, 1, 2, 3)))(q, k, v, a)
    for g, r in zip(grads, ref, strict=True):
        assert rel_err(g, r) < 1e-5
    # the gate's gradient against central differences of the float64 loop
    a64 = np.asarray(a, np.float64)
    eps = 1e-6
    for idx in [(0, 2, 0), (1, 5, 1), (0, 6, 1)]:
        up, down = a64.copy(), a64.copy()
        up[idx] += eps
        down[idx] -= eps
        fd = (
            np.sum(forgetting_attention_loop(q, k, v, up) * np.asarray(w))
            - np.sum(forgetting_attention_loop(q, k, v, down) * np.asarray(w))
        ) / (2 * eps)
        assert abs(float(grads[3][idx]) - fd) < 1e-4 * max(1.0, abs(fd))


def test_cached_prefill_and_steps_equal_the_full_pass():
    q, k, v, a = inputs(seed=4)
    a = a.at[1, 8, 0].set(-jnp.inf)  # a reset among the decoded tokens
    full = K.forgetting_attention(q, k, v, a, method="quadratic")
    cache = empty_cache(B, 16, H, D, DV, jnp.float32)
    head, cache = K.cached_forgetting_attention(cache, 0, q[:, :5], k[:, :5], v[:, :5], a[:, :5])
    outs = [head]
    step = jax.jit(K.forgetting_attention_step)
    for t in range(5, T):
        o, cache = step(cache, t, q[:, t], k[:, t], v[:, t], a[:, t])
        outs.append(o[:, None])
    assert rel_err(jnp.concatenate(outs, axis=1), full) < 1e-5


def test_bfloat16_inputs_and_bad_input():
    q, k, v, a = inputs()
    out = K.forgetting_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), a)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, forgetting_attention_loop(q, k, v, a)) < 3e-2
    with pytest.raises(ValueError, match="unknown method 'scan'; allowed: chunk, quadratic$"):
        K.forgetting_attention(q, k, v, a, method="scan")
    with pytest.raises(ValueError, match="log_decay must be <= 0"):
        K.forgetting_attention(q, k, v, jnp.abs(a))
    with pytest.raises(ValueError, match="no sequence-parallel form"):
        K.forgetting_attention(q, k, v, a, axis_name="seq")


def test_a_time_split_over_fox_is_refused_by_the_config():
    from linear_attention.training import experiment_config
    from tests.training.conftest import load_config

    config = load_config("mqar", "smoke")
    config.model.mixer = "fox"
    config.mesh.num_devices, config.mesh.seq = 2, 2
    with pytest.raises(ValueError, match=r"config.mesh.seq = 2 splits the time axis.*fox"):
        experiment_config(config)
