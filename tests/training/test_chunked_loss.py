"""The chunked cross-entropy (`training.chunked_loss`) against a float64 NumPy log-softmax: its
loss, argmax and gradient (hidden states and output embedding) with ignore labels, a vocabulary
and a token count that are no multiple of their chunks, bfloat16 inputs; a `LanguageModel`'s
loss and parameter gradient (tied and untied, packed rows, an unlabelled position); one real
train step equal to the plain loss's; the compiled train step holds no ``[B, T, V]`` array;
the config's checks and the "auto" threshold."""

import functools
import json
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from linear_attention.data import IGNORE_INDEX
from linear_attention.models import LanguageModel, ModelConfig
from linear_attention.training import evaluation, experiment_config, steps
from linear_attention.training.chunked_loss import (
    CHUNKED_LOSS_MIN_VOCAB,
    chunked_cross_entropy,
    loss_chunks,
)
from linear_attention.training.mesh import make_mesh, shard_batch, state_shardings
from tests.scripts import run_on_cpu_devices
from tests.training.conftest import tiny_mqar

V = 37  # (no multiple of the vocabulary chunks below)


def np_loss(h, w, labels, g):
    """float64: per-token cross-entropy, argmax, and the gradients of ``Σ g · ce`` in h and w."""
    h, w = np.asarray(h, np.float64), np.asarray(w, np.float64)
    logits = h @ w
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1, keepdims=True)) + top
    p = np.exp(logits - lse)
    onehot = np.eye(w.shape[1])[labels]
    ce = lse[..., 0] - np.sum(logits * onehot, -1)
    dl = (p - onehot) * np.asarray(g, np.float64)[..., None]
    dh = dl @ w.T
    dw = h.reshape(-1, h.shape[-1]).T @ dl.reshape(-1, dl.shape[-1])
    return ce, logits.argmax(-1), dh, dw


@jax.jit
def _loss_and_grads(h, w, labels, g):
    def f(h, w):
        ce, arg = chunked_cross_entropy(h, w, labels, token_chunk=4, vocab_chunk=8)
        return jnp.sum(ce * g), (ce, arg)

    (_, (ce, arg)), (dh, dw) = jax.value_and_grad(f, (0, 1), has_aux=True)(h, w)
    return ce, arg, dh, dw


def inputs(dtype):
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(2, 7, 6)), dtype)  # 14 tokens: no multiple of 4
    w = jnp.asarray(rng.normal(size=(6, V)) * 0.7, dtype)
    labels = rng.integers(0, V, (2, 7)).astype(np.int32)
    g = rng.normal(size=(2, 7)).astype(np.float32)
    g[0, 2] = 0.0  # an ignored position: its cotangent is 0
    return h, w, labels, g


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_loss_argmax_and_gradients_against_float64(dtype):
    h, w, labels, g = inputs(dtype)
    ce, arg, dh, dw = _loss_and_grads(h, w, labels, g)
    # the reference sees the inputs as rounded to `dtype`
    want_ce, want_arg, want_dh, want_dw = np_loss(
        np.asarray(h.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)), labels, g
    )
    assert ce.dtype == jnp.float32 and arg.dtype == jnp.int32
    assert dh.dtype == dtype and dw.dtype == dtype
    # bfloat16 products are exact in float32: the loss keeps float32 accuracy; the gradients
    # are rounded to bfloat16 (and the matmuls of the backward take bfloat16 inputs)
    np.testing.assert_allclose(ce, want_ce, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(arg, want_arg)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(dh, np.float32), want_dh, **tol)
    np.testing.assert_allclose(np.asarray(dw, np.float32), want_dw, **tol)


def test_chunks_larger_than_the_input_and_bad_arguments():
    h, w, labels, _ = inputs(jnp.float32)
    ce, arg = chunked_cross_entropy(h, w, labels, token_chunk=1000, vocab_chunk=1000)
    want_ce, want_arg, _, _ = np_loss(h, w, labels, np.ones(labels.shape))
    np.testing.assert_allclose(ce, want_ce, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(arg, want_arg)
    with pytest.raises(ValueError, match="vocab_chunk must be an integer >= 1, got 0"):
        chunked_cross_entropy(h, w, labels, token_chunk=4, vocab_chunk=0)
    with pytest.raises(ValueError, match="share a dtype"):
        chunked_cross_entropy(h, w.astype(jnp.bfloat16), labels, token_chunk=4, vocab_chunk=8)
    with pytest.raises(ValueError, match=r"labels must have shape \(2, 7\)"):
        chunked_cross_entropy(h, w, labels[:, :3], token_chunk=4, vocab_chunk=8)


MODEL = dict(vocab_size=V, d_model=8, num_layers=2, num_heads=2, mixer=("gla", "softmax"))


def lm_batch():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, V, (2, 9)).astype(np.int32)
    labels[rng.random((2, 9)) < 0.3] = IGNORE_INDEX
    segment_ids = np.array([[1] * 4 + [2] * 5, [1] * 9], np.int32)  # a packed row
    return {
        "inputs": rng.integers(0, V, (2, 9)).astype(np.int32),
        "labels": labels,
        "segment_ids": segment_ids,
    }


@pytest.mark.parametrize("tie", [True, False])
def test_language_model_loss_and_gradient(tie):
    """`model_stats`'s sums and their parameter gradient, chunked (3 tokens, 8 columns) against
    the float64 loss of the model's own logits and against the plain loss's gradient; the
    gradient reaching the output embedding and the hidden states is checked in float64."""
    model = LanguageModel(ModelConfig(**MODEL, tie_embeddings=tie), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = jax.tree.map(jnp.asarray, lm_batch())

    @jax.jit
    def run(params):
        def loss(params, chunks):
            sums = steps.model_stats(nnx.merge(graphdef, params, rest), batch, None, chunks)
            return sums[0], sums[:3]

        return [jax.grad(loss, has_aux=True)(params, c) for c in ((3, 8), None)]

    (grads, sums), (plain_grads, plain_sums) = run(params)
    labels = np.asarray(batch["labels"])
    mask = labels != IGNORE_INDEX
    logits = np.asarray(model(batch["inputs"], batch["segment_ids"]), np.float64)
    x, _, _ = model.features_and_router_stats(batch["inputs"], batch["segment_ids"])
    h = np.asarray(model.final_norm(x), np.float64)
    w = np.asarray(model.output_embedding(), np.float64)
    ce, arg, _, dw = np_loss(h, w, np.where(mask, labels, 0), mask.astype(np.float64))
    np.testing.assert_allclose(h @ w, logits, rtol=1e-5, atol=1e-5)  # (the projection)
    np.testing.assert_allclose(sums[0], ce[mask].sum(), rtol=1e-5)
    assert sums[1] == np.sum((arg == labels) & mask) and sums[2] == mask.sum()
    np.testing.assert_allclose(np.asarray(sums), np.asarray(plain_sums), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    if not tie:  # the head kernel's gradient is the loss's own dW alone
        np.testing.assert_allclose(grads["head"]["kernel"][...], dw, rtol=1e-4, atol=1e-6)


def test_an_undefined_position_gives_nan_as_the_plain_loss():
    """A token id past the vocabulary (under jit) gives NaN logits at its position: a labelled
    one makes the loss NaN on both paths, an unlabelled one leaves it and the gradient finite."""
    model = LanguageModel(ModelConfig(**MODEL), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = jax.tree.map(jnp.asarray, lm_batch())
    inputs = batch["inputs"].at[0, 8].set(V + 3)

    @functools.partial(jax.jit, static_argnums=3)
    def run(params, inputs, labels, chunks):
        b = dict(batch, inputs=inputs, labels=labels)
        return jax.value_and_grad(
            lambda p: steps.model_stats(nnx.merge(graphdef, p, rest), b, None, chunks)[0]
        )(params)

    for chunks in ((3, 8), None):
        unlabelled = batch["labels"].at[0, 8].set(IGNORE_INDEX)
        loss, grads = run(params, inputs, unlabelled, chunks)
        assert np.isfinite(loss) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
        loss, _ = run(params, inputs, batch["labels"].at[0, 8].set(1), chunks)
        assert np.isnan(loss)


def _step(chunks, remat="none", mesh=None, host=None, accum=2):
    model = LanguageModel(ModelConfig(**MODEL, remat=remat), rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    mesh = mesh or make_mesh(1)
    fsdp = mesh.size > 1
    state = jax.device_put(state, state_shardings(state, mesh, fsdp))
    batch = shard_batch(lm_batch() if host is None else host, mesh)
    kwargs = dict(graphdef=graphdef, mesh=mesh, fsdp=fsdp, accum=accum, loss_chunks=chunks)
    return state, batch, kwargs


def test_one_train_step_equals_the_plain_one():
    """The real train step (with accumulation over 2 micro-batches), chunked and plain: the
    same metrics and the same parameters after the step, to float32 rounding."""
    results = []
    for chunks in ((4, 16), None):
        state, batch, kwargs = _step(chunks)
        state, metrics = steps.train_step(state, batch, **kwargs)
        results.append((jax.device_get(metrics), nnx.to_pure_dict(jax.device_get(state)[0])))
    (metrics, params), (plain_metrics, plain_params) = results
    for key in plain_metrics:
        np.testing.assert_allclose(metrics[key], plain_metrics[key], rtol=1e-5)
    # (SGD at rate 1: the parameters' change is the mean gradient itself)
    initial = jax.tree.leaves(nnx.to_pure_dict(jax.device_get(_step(None)[0])[0]))
    for got, want, start in zip(
        jax.tree.leaves(params), jax.tree.leaves(plain_params), initial, strict=True
    ):
        assert np.max(np.abs(want - start)) > 0  # the step moved every parameter
        np.testing.assert_allclose(got - start, want - start, rtol=1e-4, atol=1e-7)


def test_the_eval_step_equals_the_plain_one():
    """`evaluation.eval_step` with the train step's chunks: the plain step's sums (loss to
    float32 rounding; the same correct and labelled counts)."""
    state, batch, kwargs = _step(None)
    graphdef, mesh = kwargs["graphdef"], kwargs["mesh"]
    chunked, plain = (
        np.asarray(evaluation.eval_step(state, batch, graphdef=graphdef, mesh=mesh, loss_chunks=c))
        for c in ((4, 16), None)
    )
    np.testing.assert_allclose(chunked[0], plain[0], rtol=1e-5)
    np.testing.assert_array_equal(chunked[1:], plain[1:])
    assert plain[2] == np.sum(lm_batch()["labels"] != IGNORE_INDEX)


def _logit_shaped(hlo: str, rows: int, vocab: int) -> list[str]:
    """The shapes in ``hlo`` with the vocabulary as a dimension and at least ``rows`` rows
    (``[B, T, V]``, ``[B·T, V]`` or a micro-batch's ``[B/accum, T, V]``... whatever the
    compiler made of them)."""
    found = []
    for dims in re.findall(r"[a-z]+\d*\[([\d,]+)\]", hlo):
        shape = [int(d) for d in dims.split(",")]
        if vocab in shape and np.prod(shape) >= rows * vocab:
            found.append(dims)
    return found


@pytest.mark.parametrize("remat", ["none", "block"])
def test_the_compiled_train_step_holds_no_logits(remat):
    """Every instruction of the compiled chunked train step (with accumulation; with and
    without remat): no array of ``rows · V`` elements with ``V`` as a dimension, where rows
    are a micro-batch's tokens (9); the plain step holds several (the check can fail)."""
    rows = 9  # (one micro-batch: 1 row of 9 tokens; > d_model, so dW [D, V] is no match)
    for chunks in ((4, 16), None):
        state, batch, kwargs = _step(chunks, remat)
        hlo = steps.train_step.lower(state, batch, **kwargs).compile().as_text()
        found = _logit_shaped(hlo, rows, V)
        if chunks is None:
            assert found, "the plain step's logits were not found: the check is blind"
        else:
            assert not found, found


def test_config_fields_and_the_auto_threshold():
    config = tiny_mqar()
    cfg = experiment_config(config)
    assert cfg.model.vocab_size < CHUNKED_LOSS_MIN_VOCAB and cfg.loss_chunks is None
    config.train.chunked_loss = "on"
    config.train.loss_chunk_tokens = 5
    config.train.loss_chunk_vocab = 7
    assert experiment_config(config).loss_chunks == (5, 7)
    assert loss_chunks("auto", CHUNKED_LOSS_MIN_VOCAB, 5, 7) == (5, 7)
    assert loss_chunks("auto", CHUNKED_LOSS_MIN_VOCAB - 1, 5, 7) is None
    assert loss_chunks("off", 10**6, 5, 7) is None
    for name, value, message in [
        ("loss_chunk_tokens", 0, "config.train.loss_chunk_tokens must be"),
        ("loss_chunk_vocab", -3, "config.train.loss_chunk_vocab must be"),
        ("chunked_loss", "yes", "unknown config.train.chunked_loss .yes.; allowed: auto, on, off"),
    ]:
        bad = ml_collections.ConfigDict(config.to_dict())
        bad.train[name] = value
        with pytest.raises(ValueError, match=message):
            experiment_config(bad)


def sharded_main():
    """On 4 CPU devices: one chunked train step with FSDP over ``data = 4`` (XLA partitions the
    loss) and over ``data = 2`` with time split over ``seq = 2`` (the loss runs per shard in
    `jax.shard_map`), and the plain step on one device; prints the largest difference of each
    sharded step's update from the plain one's, relative to its largest entry, per parameter."""
    rng = np.random.default_rng(2)
    labels = rng.integers(0, V, (4, 8)).astype(np.int32)
    labels[rng.random((4, 8)) < 0.3] = IGNORE_INDEX
    host = {"inputs": rng.integers(0, V, (4, 8)).astype(np.int32), "labels": labels}
    results = []
    for chunks, mesh in (
        (None, make_mesh(1)),
        ((3, 16), make_mesh(4)),
        ((3, 16), make_mesh(4, seq=2)),
    ):
        state, batch, kwargs = _step(chunks, mesh=mesh, host=host, accum=1)
        state, metrics = steps.train_step(state, batch, **kwargs)
        results.append((jax.device_get(metrics), nnx.to_pure_dict(jax.device_get(state)[0])))
    (plain_metrics, plain_params), *sharded = results
    # (SGD at rate 1: the parameters' change is the mean gradient itself)
    initial = jax.tree.leaves(nnx.to_pure_dict(jax.device_get(_step(None)[0])[0]))
    out = {}
    for name, (metrics, params) in zip(("fsdp", "fsdp_seq"), sharded, strict=True):
        out[name] = {
            "loss_diff": abs(float(metrics["train/loss"]) - float(plain_metrics["train/loss"])),
            "update_rel_diff": max(
                float(np.max(np.abs(a - b)) / np.max(np.abs(b - p)))
                for a, b, p in zip(
                    jax.tree.leaves(params), jax.tree.leaves(plain_params), initial, strict=True
                )
            ),
        }
    print("RESULT", json.dumps(out))


def test_sharded_chunked_step_equals_one_device():
    code = "from tests.training.test_chunked_loss import sharded_main; sharded_main()"
    out = run_on_cpu_devices(code, 4)
    line = next(x for x in out.splitlines() if x.startswith("RESULT"))
    result = json.loads(line[len("RESULT") :])
    assert set(result) == {"fsdp", "fsdp_seq"}
    for case in result.values():
        assert case["loss_diff"] < 1e-5 and case["update_rel_diff"] < 1e-4, result
