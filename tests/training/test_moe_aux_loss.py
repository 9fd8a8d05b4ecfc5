"""The MoE load-balancing loss in training (`steps`): its gradient (against a float64 central
difference of the loss through the last layer's router) enters the update with the weight
`moe_aux_loss_coef`, and the train step logs it as ``train/moe_aux_loss`` (with accumulation,
each micro-batch's averaged) beside a ``train/loss`` that stays the cross-entropy; a model
without experts logs none."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from linear_attention.models import LanguageModel, ModelConfig
from linear_attention.training import steps
from linear_attention.training.mesh import make_mesh, shard_batch
from tests.layers.test_moe import aux64, router_inputs
from tests.training.conftest import np_stats

MOE = dict(vocab_size=30, d_model=16, num_layers=2, num_heads=2, mixer="softmax")
MOE.update(num_experts=4, experts_per_token=2, moe_dim=8)


def make_batch():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 30, (4, 6)).astype(np.int32)
    labels[rng.random((4, 6)) < 0.3] = -100
    return {"inputs": rng.integers(0, 30, (4, 6)).astype(np.int32), "labels": labels}


def router_logits(model, tokens):
    """Each MoE layer's router logits on `tokens`, float64."""
    inputs = router_inputs(model, jnp.asarray(tokens))
    return [
        np.asarray(b.mlp.router(x), np.float64) for b, x in zip(model.blocks, inputs, strict=True)
    ]


@pytest.fixture(scope="module")
def gradients():
    """The gradients of the cross-entropy's sum and of the aux loss, for `MOE`'s model (seed 0)
    on `make_batch()`, from `steps.summed_gradients` with aux weights 0 and 1."""
    model = LanguageModel(ModelConfig(**MOE), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    batch = jax.tree.map(jnp.asarray, make_batch())
    # (the weight a traced argument: one compilation for both)
    run = jax.jit(lambda s, w: steps.summed_gradients(nnx.merge(graphdef, s), batch, None, 1, w))
    cross_entropy, with_aux = (nnx.to_pure_dict(run(state, w)[-1]) for w in (0.0, 1.0))
    aux = jax.tree.map(lambda a, b: np.asarray(a - b), with_aux, cross_entropy)
    return jax.tree.map(np.asarray, cross_entropy), aux


def router_kernel(tree, layer: int):
    return tree["blocks"][layer]["mlp"]["router"]["kernel"]


def test_the_aux_loss_enters_the_gradient(gradients):
    model = LanguageModel(ModelConfig(**MOE), rngs=nnx.Rngs(0))
    batch = make_batch()
    _, aux = gradients
    assert np.max(np.abs(router_kernel(aux, 0))) > 1e-4  # the first router's gradient moves
    # The aux loss's gradient for the last router kernel W, along a direction V, against a
    # central difference in float64 (the last router's input does not depend on W).
    inputs = np.asarray(router_inputs(model, jnp.asarray(batch["inputs"]))[1], np.float64)
    first = router_logits(model, batch["inputs"])[0]
    kernel = np.asarray(model.blocks[1].mlp.router.kernel, np.float64)
    direction = np.random.default_rng(1).normal(size=kernel.shape)
    eps = 1e-5
    moved = [aux64([first, inputs @ (kernel + s * eps * direction)], 2) for s in (1, -1)]
    want = (moved[0] - moved[1]) / (2 * eps)
    np.testing.assert_allclose(np.sum(router_kernel(aux, 1) * direction), want, rtol=1e-3)


def test_train_step_trains_on_and_logs_the_aux_loss(gradients):
    """The update of one SGD step is `-lr · (∇ cross-entropy mean + coef · ∇ aux)`; the metrics
    are the cross-entropy and the aux loss apart."""
    lr, coef = 0.1, 0.5
    mesh = make_mesh(1)
    host = make_batch()
    batch = shard_batch(host, mesh)

    def one_step(accum, **fields):
        model = LanguageModel(ModelConfig(**MOE, **fields), rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)
        graphdef, state = nnx.split((model, optimizer))
        kwargs = dict(graphdef=graphdef, mesh=mesh, fsdp=False, accum=accum)
        state, metrics = steps.train_step(state, batch, **kwargs)  # (donates the model)
        return jax.device_get(metrics), nnx.to_pure_dict(jax.device_get(state)[0])

    model = LanguageModel(ModelConfig(**MOE), rngs=nnx.Rngs(0))  # the steps' initial model
    initial = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    trained, params = one_step(1, moe_aux_loss_coef=coef)
    grad_ce, grad_aux = gradients
    count = np.sum(host["labels"] != -100)
    for layer in (0, 1):
        want = -lr * (router_kernel(grad_ce, layer) / count + coef * router_kernel(grad_aux, layer))
        got = router_kernel(params, layer) - router_kernel(initial, layer)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)  # (parameters rounded)
    np.testing.assert_allclose(
        trained["train/moe_aux_loss"], aux64(router_logits(model, host["inputs"]), 2), rtol=1e-5
    )
    cross_entropy, _ = np_stats(np.asarray(model(host["inputs"])), host["labels"])
    np.testing.assert_allclose(trained["train/loss"], cross_entropy, rtol=1e-5)
    # accumulation: micro-batch i holds rows i, i + 2 (`steps.micro_batches`)
    accumulated, _ = one_step(2, moe_aux_loss_coef=coef)
    micro = [aux64(router_logits(model, host["inputs"][i::2]), 2) for i in (0, 1)]
    np.testing.assert_allclose(accumulated["train/moe_aux_loss"], np.mean(micro), rtol=1e-5)
    # a model without experts: no aux metric (traced, not compiled)
    dense_config = dict(MOE, num_experts=0, experts_per_token=None, moe_dim=None)
    dense = LanguageModel(ModelConfig(**dense_config), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split((dense, nnx.Optimizer(dense, optax.sgd(0.1), wrt=nnx.Param)))
    shapes = jax.eval_shape(
        lambda s: steps.train_step(s, batch, graphdef=graphdef, mesh=mesh, fsdp=False), state
    )
    assert set(shapes[1]) == {"train/loss", "train/accuracy", "grad_norm"}


class Bigram(nnx.Module):
    """A module that is not a `LanguageModel`: logits = a table's row per token."""

    def __init__(self, table):
        self.table = nnx.Param(jnp.asarray(table, jnp.float32))

    def __call__(self, tokens_BT, segment_ids=None):
        del segment_ids
        return self.table[...][tokens_BT]


def test_train_step_trains_any_module_called_as_a_language_model():
    """A module without `config` or experts trains on the cross-entropy alone: its loss and
    SGD update equal a float64 NumPy softmax cross-entropy and its gradient."""
    table = np.random.default_rng(1).normal(size=(30, 30))
    batch = make_batch()
    model = Bigram(table)
    lr = 0.5
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)))
    state, metrics = steps.train_step(
        state, jax.tree.map(jnp.asarray, batch), graphdef=graphdef, mesh=make_mesh(1), fsdp=False
    )
    keep = batch["labels"] != -100
    logits = table[batch["inputs"][keep]]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    labels = batch["labels"][keep]
    loss = -np.mean(np.log(p[np.arange(len(labels)), labels]))
    grad_logits = p.copy()
    grad_logits[np.arange(len(labels)), labels] -= 1.0
    grad = np.zeros_like(table)
    np.add.at(grad, batch["inputs"][keep], grad_logits / len(labels))
    assert "train/moe_aux_loss" not in metrics
    np.testing.assert_allclose(float(metrics["train/loss"]), loss, rtol=1e-5)
    trained, _ = nnx.merge(graphdef, state)
    np.testing.assert_allclose(np.asarray(trained.table[...]), table - lr * grad, atol=1e-5)
