"""`method="pallas"` as a mixer option with the Mosaic GPU kernel (`pallas_interpret("gpu")`, its
interpret mode on the CPU): a mixer and a small LanguageModel give the same outputs and
gradients as with `method="chunk"`. Each side is one jitted program (forward and gradient)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention import kernels as K
from linear_attention.layers import get_mixer
from linear_attention.models import LanguageModel, ModelConfig
from tests.kernels.reference import rel_err

V, B, T, D, H = 32, 2, 70, 16, 2  # T not a multiple of the GPU kernel's chunk (64)


@pytest.mark.parametrize("name", ["gated", "gla"])
def test_mixer_gpu_kernel_equals_chunk(name):
    """Mamba-2's scalar decay per head and token, and GLA's per key channel: outputs and
    parameter gradients."""
    x = jax.random.normal(jax.random.key(0), (B, T, D))

    def run(method):
        mixer = get_mixer(name)(D, H, method=method, chunk_size=64, rngs=nnx.Rngs(0))

        def loss(m):
            return jnp.sum(jnp.sin(m(x)))

        y, grads = nnx.jit(lambda m: (m(x), nnx.grad(loss)(m)))(mixer)
        return y, jax.tree.leaves(nnx.state(grads, nnx.Param))

    with K.pallas_interpret("gpu"):
        y, grads = run("pallas")
    y_c, grads_c = run("chunk")
    assert rel_err(y, y_c) < 1e-4
    assert len(grads) == len(grads_c) > 0
    for g, g_c in zip(grads, grads_c, strict=True):
        assert rel_err(g, g_c) < 1e-4


def test_language_model_gpu_kernel_equals_chunk():
    """Two layers (a per-token decay and normalised linear attention), packed rows with a
    document start mid-chunk: logits and the loss's gradient."""
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    segment_ids = jnp.asarray(np.repeat([[0] * 30 + [1] * 40], B, axis=0), jnp.int32)

    def run(method):
        config = ModelConfig(
            vocab_size=V,
            d_model=D,
            num_layers=2,
            num_heads=H,
            max_length=128,
            mixer=("gated", "linear"),
            method=method,
            chunk_size=64,
        )
        model = LanguageModel(config, rngs=nnx.Rngs(0))

        def loss(m):
            logits = m(tokens, segment_ids=segment_ids)
            return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

        def logits_and_grads(m):
            return m(tokens, segment_ids=segment_ids), nnx.grad(loss)(m)

        logits, grads = nnx.jit(logits_and_grads)(model)
        return logits, jax.tree.leaves(nnx.state(grads, nnx.Param))

    with K.pallas_interpret("gpu"):
        logits, grads = run("pallas")
    logits_c, grads_c = run("chunk")
    assert rel_err(logits, logits_c) < 1e-4
    for g, g_c in zip(grads, grads_c, strict=True):
        assert rel_err(g, g_c) < 1e-4
