"""The kernel families' descriptors (`primitives.family`) and their one front: the method
vocabulary (old words accepted with a `DeprecationWarning`, same numbers as the new ones),
the errors naming the supported methods, the Pallas checks, and the FLOPs per method."""

import warnings

import jax
import jax.numpy as jnp
import pytest

from linear_attention import kernels as K
from linear_attention.kernels.primitives.family import OLD_WORDS
from tests.kernels.reference import forgetting_attention_loop, mesa_net_loop, rel_err

B, T, H, D = 1, 6, 2, 4


def _inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(x, (B, T, H, D)) for x in keys[:3])
    a = jax.nn.log_sigmoid(jax.random.normal(keys[3], (B, T, H)) + 1.0)
    return q, k, v, a


def test_every_family_declares_its_methods_step_and_flops():
    """Each family: the default method first (its training path: "chunk", or "scan" for a
    diagonal recurrence, which has no chunk form), a FLOPs count and a kernel per method, a
    decode step and a state type; old words map to declared methods."""
    assert set(K.FAMILIES) == {f.name for f in K.FAMILIES.values()}
    for family in K.FAMILIES.values():
        default = "chunk" if "chunk" in family.supported else "scan"
        assert family.supported[0] == default, family.name
        assert callable(family.step) and family.state is not None, family.name
        sizes = dict(seq_len=12, heads=2, dk=8, dv=8, chunk_size=4, num_keys=2)
        sizes.update(num_levels=5, cg_steps=3, width=8, state_size=4)
        for method, entry in family.methods.items():
            assert callable(entry.kernel), (family.name, method)
            assert family.flops(method, **sizes) > 0, (family.name, method)
        for old in family.old_words:
            assert OLD_WORDS[old] in family.supported, (family.name, old)
    pallas = {n for n, f in K.FAMILIES.items() if any(f.backends(m) for m in f.supported)}
    assert pallas == {"causal_linear_attention", "delta_rule", "delta_product", "dplr_delta_rule"}
    assert K.LINEAR.backends("pallas") == ("tpu", "gpu") and K.LINEAR.backends("chunk") == ()
    # the delta rule's GPU walk runs DeltaProduct's sub-tokens too; DPLR has no GPU kernel
    gpu = {n for n, f in K.FAMILIES.items() if any("gpu" in f.backends(m) for m in f.supported)}
    assert gpu == {"causal_linear_attention", "delta_rule", "delta_product"}


@pytest.mark.parametrize(
    "family, old, new",
    [("forgetting_attention", "blockwise", "chunk"), ("mesa_net", "recurrent", "scan")],
)
def test_old_words_warn_and_run_the_new_method(family, old, new):
    q, k, v, a = _inputs()
    if family == "mesa_net":
        beta = jax.nn.sigmoid(v[..., 0])
        lam = jnp.full((H, D), 0.5)
        k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
        want = mesa_net_loop(q, k, v, a, beta, lam)[0]

        def run(m):  # (jitted: the warning is raised when traced)
            return jax.jit(K.mesa_net, static_argnames=("method", "cg_steps"))(
                q, k, v, a, beta, lam, method=m, cg_steps=D
            )
    else:
        want = forgetting_attention_loop(q, k, v, a)

        def run(m):  # (jitted: the warning is raised when traced)
            return jax.jit(K.forgetting_attention, static_argnames=("method", "block_size"))(
                q, k, v, a, method=m, block_size=4
            )

    with pytest.warns(DeprecationWarning, match=f"method '{old}' is now spelled '{new}'"):
        got = run(old)
    assert rel_err(got, want) < 1e-4  # (the new word's own numbers: its family's tests)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert K.FAMILIES[family].resolve(new) == new


def test_an_old_word_of_another_family_is_refused():
    """An alias is the family's own: "blockwise" never named a log-linear method."""
    q, k, v, a = _inputs()
    lam = jnp.ones((B, T, H, 4))
    with pytest.raises(ValueError, match="unknown method 'blockwise'; allowed: chunk, quadratic"):
        K.log_linear_attention(q, k, v, a, lam, method="blockwise")


def test_pallas_front_checks_backend_then_tile():
    q, k, v, a = _inputs()
    with pytest.raises(ValueError, match=r'delta_rule\(method="pallas"\): the Pallas kernels'):
        K.delta_rule(q, k, v, jnp.ones((B, T, H)), method="pallas", chunk_size=16)
    with K.pallas_interpret(), pytest.raises(ValueError, match="multiple of 16 .* got 20"):
        K.causal_linear_attention(q, k, v, method="pallas", chunk_size=20)
    assert K.DELTA_RULE.float32("chunk") and not K.DELTA_RULE.float32("pallas")


def test_flops_match_the_hand_counts():
    """Two counts by hand: the delta rule's chunk form at C = 4, dk = dv = 8, H = 2:
    2·2·(3·4·8 + 2·4·8 + 16/3 + 3·64); DeltaProduct (n = 2) is the delta rule on 2T
    sub-tokens with 2H heads."""
    chunk = K.DELTA_RULE.flops("chunk", seq_len=12, heads=2, dk=8, dv=8, chunk_size=4)
    assert chunk == pytest.approx(4 * (96 + 64 + 16 / 3 + 192))
    sizes = dict(seq_len=12, heads=2, dk=8, dv=8, chunk_size=4)
    product = K.DELTA_PRODUCT.flops("scan", num_keys=2, **sizes)
    assert product == K.DELTA_RULE.flops("scan", **{**sizes, "heads": 4, "seq_len": 24})
    assert K.DELTA_RULE.flops("scan", **sizes) == 6 * 2 * 64
