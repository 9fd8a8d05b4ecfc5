"""The jitted steps of training: the loss sums of a model on a batch (`token_stats`,
`model_stats`, sequence-parallel over a ``seq`` mesh axis), the optimizer step (`train_step`,
with gradient accumulation by `summed_gradients`) and the favor redraw (`redraw_step`).

A model with experts and ``moe_aux_loss_coef`` c > 0 is trained on
``cross-entropy + c · load-balancing loss`` (`layers.moe.load_balancing_loss` of the routers of
every MoE layer over the batch); ``train/loss`` stays the cross-entropy (comparable with
``eval/loss`` and with models without experts) and ``train/moe_aux_loss`` is the auxiliary loss,
logged for every model with experts. With gradient accumulation the auxiliary loss is each
micro-batch's, averaged over the micro-batches (as transformers' Trainer, which runs a forward
pass per micro-batch): its load fractions are products of batch means, so no sum over
micro-batches gives the whole batch's, and the update differs from the unaccumulated one in
that term only.

With ``loss_chunks = (tokens, vocab)`` (`ExperimentConfig.loss_chunks`: config.train
``chunked_loss``, ``loss_chunk_tokens``, ``loss_chunk_vocab``) a `LanguageModel`'s loss and
accuracy come from `chunked_cross_entropy` on its last hidden states and output embedding: the
same sums, without the ``[B, T, V]`` float32 logits in the step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from linear_attention.data import IGNORE_INDEX
from linear_attention.layers import load_balancing_loss
from linear_attention.models import LanguageModel, redraw_features
from linear_attention.training.chunked_loss import chunked_cross_entropy
from linear_attention.training.mesh import (
    batch_axes,
    expert_dispatch,
    sequence_parallel_stats,
    state_shardings,
)


def token_stats(logits_BTV: jax.Array, labels_BT: jax.Array):
    """``(sum of cross-entropy, number correct, number labelled)`` over labelled positions
    (``labels != IGNORE_INDEX``), in float32."""
    mask_BT = labels_BT != IGNORE_INDEX
    safe_BT = jnp.where(mask_BT, labels_BT, 0)
    ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), safe_BT)
    return _labelled_sums(ce_BT, jnp.argmax(logits_BTV, axis=-1), labels_BT)


def chunked_token_stats(model: LanguageModel, x_BTD, valid_BT, labels_BT, chunks):
    """`token_stats` of ``model``'s logits from its last block's output ``x`` (and ``valid``,
    `LanguageModel.features_and_router_stats`), by `chunked_cross_entropy` over ``chunks =
    (tokens, vocab)``: the ``[B, T, V]`` logits are never held. Positions without defined
    logits give NaN as the plain path's NaN logits do (argmax 0, as ``jnp.argmax`` of NaNs)."""
    h_BTD = model.final_norm(x_BTD)
    mask_BT = labels_BT != IGNORE_INDEX
    ce_BT, argmax_BT = chunked_cross_entropy(
        h_BTD,
        model.output_embedding().astype(h_BTD.dtype),
        jnp.where(mask_BT, labels_BT, 0),
        token_chunk=chunks[0],
        vocab_chunk=chunks[1],
    )
    ce_BT = jnp.where(valid_BT, ce_BT, jnp.nan)
    return _labelled_sums(ce_BT, jnp.where(valid_BT, argmax_BT, 0), labels_BT)


def _labelled_sums(ce_BT, argmax_BT, labels_BT):
    mask_BT = labels_BT != IGNORE_INDEX
    correct_BT = (argmax_BT == labels_BT) & mask_BT
    return (
        jnp.sum(jnp.where(mask_BT, ce_BT, 0.0)),
        jnp.sum(correct_BT, dtype=jnp.float32),
        jnp.sum(mask_BT, dtype=jnp.float32),
    )


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "mesh", "fsdp", "accum", "loss_chunks"),
    donate_argnames=("state",),
)
def train_step(state, batch, *, graphdef, mesh, fsdp, accum: int = 1, loss_chunks=None):
    """One optimizer step: ``(state, batch) -> (state, metrics)``; loss = mean cross-entropy
    over the labelled positions of the whole (global) batch. A batch with ``segment_ids``
    (packed documents) is run with them. ``accum > 1``: the batch is run as that many
    micro-batches (`summed_gradients`), the same update to float32 rounding (but for the MoE
    auxiliary loss, taken per micro-batch: module docstring). ``loss_chunks = (tokens,
    vocab)``: the loss by `chunked_cross_entropy` (`model_stats`)."""
    model, optimizer = nnx.merge(graphdef, state)
    # (only a LanguageModel has experts; any other module trains on the cross-entropy alone)
    experts = isinstance(model, LanguageModel) and model.config.num_experts > 0
    coef = model.config.moe_aux_loss_coef if experts else 0.0
    # The gradient sum is divided by the labelled count below: the auxiliary loss's gradient
    # enters it scaled by that count, known from the labels before any micro-batch runs.
    labelled = jnp.maximum(jnp.sum(batch["labels"] != IGNORE_INDEX, dtype=jnp.float32), 1.0)
    aux_weight = coef * labelled / accum if coef else None
    loss_sum, correct, count, aux_sum, grads = summed_gradients(
        model, batch, mesh, accum, aux_weight, loss_chunks
    )
    count = jnp.maximum(count, 1.0)
    # (the mean gradient in the parameters' dtype: the optimizer state keeps that dtype)
    params = nnx.state(model, nnx.Param)
    grads = jax.tree.map(lambda g, p: (g / count).astype(p.dtype), grads, params)
    optimizer.update(model, grads)
    new_state = nnx.state((model, optimizer))
    new_state = jax.lax.with_sharding_constraint(new_state, state_shardings(new_state, mesh, fsdp))
    metrics = {
        "train/loss": loss_sum / count,
        "train/accuracy": correct / count,
        "grad_norm": optax.tree.norm(grads),
    }
    if experts:
        metrics["train/moe_aux_loss"] = aux_sum / accum
    return new_state, metrics


def micro_batches(batch: dict, accum: int, mesh) -> dict:
    """``batch`` entries ``[B, ...]`` as ``[accum, B / accum, ...]``: micro-batch i holds rows
    i, i + accum, i + 2·accum, ..., so with rows split over the ``data`` axis every micro-batch
    keeps that split (each device runs its own rows; nothing moves between devices); so do
    rows split over ``data`` × ``expert``."""

    def split(x):
        b = x.shape[0]
        x = jnp.swapaxes(x.reshape(b // accum, accum, *x.shape[1:]), 0, 1)
        spec = P(None, batch_axes(mesh)) if mesh is not None else None
        return x if spec is None else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return {k: split(v) for k, v in batch.items()}


def summed_gradients(model, batch, mesh, accum: int, aux_weight=None, loss_chunks=None):
    """``(loss_sum, correct, count, aux_sum, grads)``: the `token_stats` sums of ``model`` on
    ``batch``, the sum over micro-batches of each one's MoE load-balancing loss (0 without
    experts), and the gradient with respect to its `nnx.Param`s (float32, whatever the
    parameter dtype) of ``loss_sum``, plus ``aux_weight`` times each micro-batch's
    load-balancing loss when ``aux_weight`` is given. With ``accum > 1`` the batch is split by
    `micro_batches` and run by `jax.lax.scan`, one micro-batch's activations alive at a time;
    the sums (of losses, counts and gradients) are those of the whole batch, since all three
    are sums over positions."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_sum(params, batch):
        model_ = nnx.merge(graphdef, params, rest)
        loss, correct, count, router = model_stats(model_, batch, mesh, loss_chunks)
        aux = jnp.zeros((), jnp.float32) if router is None else load_balancing_loss(router)
        objective = loss if aux_weight is None else loss + aux_weight * aux
        return objective, (loss, correct, count, aux)

    grad_fn = jax.grad(loss_sum, has_aux=True)
    as_f32 = lambda tree: jax.tree.map(lambda g: g.astype(jnp.float32), tree)  # noqa: E731
    if accum == 1:
        grads, sums = grad_fn(params, batch)
        return (*sums, as_f32(grads))

    def add(carry, micro):
        grads, sums = grad_fn(params, micro)
        return jax.tree.map(jnp.add, carry, (*sums, as_f32(grads))), None

    zeros = (0.0,) * 4 + (jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),)
    zeros = jax.tree.map(jnp.float32, zeros)
    sums, _ = jax.lax.scan(add, zeros, micro_batches(batch, accum, mesh))
    return sums


def model_stats(model, batch, mesh=None, loss_chunks=None):
    """``(loss_sum, correct, count, router)``: `token_stats` of the model on ``batch`` (with its
    ``segment_ids`` if packed) and the `layers.RouterStats` of its MoE layers over the batch
    (None without experts, and for a model other than a `LanguageModel`: any module called as
    ``model(tokens, segment_ids) -> logits`` trains and evaluates); with a ``seq`` mesh axis
    over more than one device, time split over it (sequence parallelism); with an ``expert``
    axis, the MoE layers dispatch their tokens to the devices of their experts
    (`training.mesh.expert_dispatch`).
    A model with a Pallas layer (`ModelConfig.uses_pallas`) on more than one device runs in
    `jax.shard_map` too (with ``seq`` 1: rows split over ``data``): XLA cannot partition a
    Mosaic kernel itself. ``loss_chunks = (tokens, vocab)`` (a `LanguageModel` only): the
    loss and argmax by `chunked_token_stats`, never holding the ``[B, T, V]`` logits."""
    if loss_chunks is not None and not isinstance(model, LanguageModel):
        raise ValueError(
            f"loss_chunks needs a LanguageModel (its features and output embedding), got "
            f"{type(model).__name__}"
        )

    def stats(model, batch):
        inputs, segment_ids = batch["inputs"], batch.get("segment_ids")
        if loss_chunks is not None:
            x, valid, router = model.features_and_router_stats(inputs, segment_ids)
            return (*chunked_token_stats(model, x, valid, batch["labels"], loss_chunks), router)
        if isinstance(model, LanguageModel):
            logits, router = model.logits_and_router_stats(inputs, segment_ids)
        else:  # any model called as a LanguageModel is: it has no routers to balance
            logits, router = model(inputs, segment_ids), None
        return (*token_stats(logits, batch["labels"]), router)

    pallas = getattr(getattr(model, "config", None), "uses_pallas", False)
    if mesh is None or (mesh.shape.get("seq", 1) == 1 and not (pallas and mesh.size > 1)):
        with expert_dispatch(mesh):
            return stats(model, batch)
    return sequence_parallel_stats(stats, model, batch, mesh)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "mesh", "fsdp"), donate_argnames=("state",)
)
def redraw_step(state, key, *, graphdef, mesh, fsdp):
    """Redraw the random projections of every favor layer from ``key``."""
    model, optimizer = nnx.merge(graphdef, state)
    redraw_features(model, key)
    new_state = nnx.state((model, optimizer))
    return jax.lax.with_sharding_constraint(new_state, state_shardings(new_state, mesh, fsdp))
