"""`method="pallas"` as a mixer option: a mixer and a small LanguageModel (Pallas interpret mode
on the CPU, the TPU kernels and the Mosaic GPU ones) give the same outputs and gradients as with
`method="chunk"`.

Each side runs its forward pass and gradient as one jitted program: eagerly, every operation
and every interpreted kernel is compiled on its own, which took twice the CPU time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention import kernels as K
from linear_attention.layers import get_mixer
from linear_attention.models import LanguageModel, ModelConfig
from tests.kernels.reference import rel_err

V, B, T, D, H = 32, 2, 21, 16, 2  # T not a multiple of the chunk (16)


# The GPU kernel's chunk is 64 (T = 21 is inside one chunk: padded, a reset mid-chunk).
CHUNK = {"tpu": 16, "gpu": 64}


@pytest.mark.parametrize(
    ("name", "options", "backend"),
    [
        ("gla", {}, "tpu"),
        ("gated_deltanet", dict(num_value_heads=4), "tpu"),
        ("gla", {}, "gpu"),
        ("gated", {}, "gpu"),
        pytest.param("gated_deltanet", dict(num_value_heads=4), "gpu", marks=pytest.mark.slow),
    ],
    ids=["gla", "gated_deltanet_grouped", "gla_gpu", "gated_gpu", "gated_deltanet_grouped_gpu"],
)
def test_mixer_pallas_equals_chunk(name, options, backend):
    """A decay per key channel (GLA), Gated DeltaNet with grouped value heads (TPU kernels), and
    GLA, Mamba-2's decay per head and token and Gated DeltaNet with grouped value heads (the
    GPU kernels): outputs and parameter gradients."""
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    chunk_size = CHUNK[backend]

    def run(method):
        mixer = get_mixer(name)(
            D, H, method=method, chunk_size=chunk_size, **options, rngs=nnx.Rngs(0)
        )

        def loss(m):
            return jnp.sum(jnp.sin(m(x)))

        y, grads = nnx.jit(lambda m: (m(x), nnx.grad(loss)(m)))(mixer)
        return y, jax.tree.leaves(nnx.state(grads, nnx.Param))

    with K.pallas_interpret(backend):
        y, grads = run("pallas")
    y_c, grads_c = run("chunk")
    assert rel_err(y, y_c) < 1e-4
    assert len(grads) == len(grads_c) > 0
    for g, g_c in zip(grads, grads_c, strict=True):
        assert rel_err(g, g_c) < 1e-4


@pytest.mark.parametrize(
    ("backend", "mixers"),
    [
        ("tpu", ("gated", "linear")),
        ("gpu", ("gated", "linear")),
        pytest.param("gpu", ("gated_deltanet", "kda"), marks=pytest.mark.slow),
    ],
    ids=["tpu", "gpu", "gpu_delta"],
)
def test_language_model_pallas_equals_chunk(backend, mixers):
    """Two layers (a per-token decay and plain linear attention; on GPU also Gated DeltaNet and
    KDA), packed rows: logits and the loss's gradient."""
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    segment_ids = jnp.asarray(np.repeat([[0] * 9 + [1] * 12], B, axis=0), jnp.int32)

    def run(method):
        config = ModelConfig(
            vocab_size=V,
            d_model=D,
            num_layers=2,
            num_heads=H,
            max_length=32,
            mixer=mixers,
            options=dict(method=method, chunk_size=CHUNK[backend]),
        )
        model = LanguageModel(config, rngs=nnx.Rngs(0))

        def loss(m):
            logits = m(tokens, segment_ids=segment_ids)
            return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

        def logits_and_grads(m):
            return m(tokens, segment_ids=segment_ids), nnx.grad(loss)(m)

        logits, grads = nnx.jit(logits_and_grads)(model)
        return logits, jax.tree.leaves(nnx.state(grads, nnx.Param))

    with K.pallas_interpret(backend):
        logits, grads = run("pallas")
    logits_c, grads_c = run("chunk")
    assert rel_err(logits, logits_c) < 1e-4
    for g, g_c in zip(grads, grads_c, strict=True):
        assert rel_err(g, g_c) < 1e-4


def test_uses_pallas_reads_the_model_and_each_layer_type():
    """`ModelConfig.uses_pallas` (what puts a multi-device step in `shard_map`): the model's
    method, or one layer type's through `layer_options`; not a method on no layer."""

    def uses(**fields):
        base = dict(vocab_size=V, d_model=D, num_layers=2, num_heads=H, mixer=("gated", "linear"))
        return ModelConfig(**(base | fields)).uses_pallas

    assert uses(options=dict(method="pallas")) and not uses()
    assert not uses(options=dict(method="chunk"))
    assert uses(layer_options={"gated": {"method": "pallas"}})
    assert not uses(layer_options={"gated": {"method": "scan"}})
    assert not uses(mixer="softmax")  # softmax has no method field
