"""Sizing a run before launching it: parameters, FLOPs per token and the compiled train step's
memory per device, from abstract shapes only (nothing is allocated, no data is read).

`dry_run(config)` builds the model and optimizer with `nnx.eval_shape`, lowers the real
`train_step` (the same function the loop runs: accumulation, remat, sharding, donation) on
`jax.ShapeDtypeStruct`s placed on the configured mesh, compiles it, and reads XLA's
`memory_analysis()`. The bytes per device are what the compiled step holds at its peak:
arguments + outputs − the outputs that reuse donated arguments (the state) + temporaries.

The mesh is that of `config.mesh` over the visible devices; to size an N-device job on a
laptop, make N host devices visible: ``XLA_FLAGS=--xla_force_host_platform_device_count=N``.
The figures are XLA's for this machine's backend: another backend (GPU, TPU) fuses and
schedules differently, so its figure differs somewhat (the same order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention.training.config import experiment_config
from linear_attention.training.flops import flops_per_token
from linear_attention.training.mesh import batch_sharding, make_mesh, state_shardings
from linear_attention.training.optim import make_optimizer
from linear_attention.training.trainer import build_model, train_step


def abstract_batch(cfg, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes and dtypes of a training batch (int32 ``inputs``, ``labels`` and, for packed
    text and token files, ``segment_ids``), rows split over the mesh's ``data`` axis."""
    shape, sharding = (cfg.train.batch_size, cfg.data.seq_len), batch_sharding(mesh)
    names = ["inputs", "labels"]
    if (cfg.data.kind == "text" and cfg.data.pack) or cfg.data.kind == "tokens":
        names.append("segment_ids")
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding) for k in names}


def train_step_bytes(cfg, mesh) -> int:
    """Bytes per device of the compiled train step (see the module docstring)."""
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.num_steps)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg, tx)))
    shardings = state_shardings(state, mesh, cfg.mesh.fsdp)
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )
    lowered = train_step.lower(
        state,
        abstract_batch(cfg, mesh),
        graphdef=graphdef,
        mesh=mesh,
        fsdp=cfg.mesh.fsdp,
        accum=cfg.train.grad_accum_steps,
    )
    m = lowered.compile().memory_analysis()
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


def abstract_model(cfg):
    """The `LanguageModel` of an `ExperimentConfig` as abstract shapes (nothing allocated)."""
    return nnx.eval_shape(lambda: build_model(cfg, make_optimizer(cfg.optimizer, 1)[0])[0])


def dry_run(config) -> dict:
    """``{"parameters", "flops_per_token", "train_step_bytes_per_device"}`` of the run that
    ``config`` (a ConfigDict or `ExperimentConfig`) describes."""
    cfg = experiment_config(config)
    mesh = make_mesh(cfg.mesh.num_devices, cfg.mesh.seq)
    model = abstract_model(cfg)
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {
        "parameters": params,
        "flops_per_token": flops_per_token(model, cfg.data.seq_len)["total"],
        "train_step_bytes_per_device": train_step_bytes(cfg, mesh),
    }
