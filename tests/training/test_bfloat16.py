"""bfloat16 parameters for every mixer: the model is initialised in float32 and cast (so its
parameters are the float32 model's, rounded), and one hybrid of every registered mixer trains a
step in bfloat16 with the loss of the float32 model to bfloat16 rounding; ``--dry_run`` lowers
the real initialisation, so what it sizes is what the run builds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention.layers import MIXERS
from linear_attention.models import LanguageModel, ModelConfig
from linear_attention.training import experiment_config, make_optimizer, trainer
from linear_attention.training.mesh import make_mesh, shard_batch
from linear_attention.training.sizing import abstract_model, dry_run
from tests.training.conftest import load_config


def _config(param_dtype):
    config = load_config("mqar", "smoke")
    config.model.mixer = ",".join(MIXERS)  # one layer of each
    config.model.num_layers = len(MIXERS)
    config.model.d_model = 32
    config.model.param_dtype = param_dtype
    config.data.seq_len = 16
    config.train.batch_size = 2
    config.optimizer.warmup_steps = 0  # (the first step's learning rate is not 0)
    config.optimizer.learning_rate = 1e-2
    return config


def _params(model):
    return jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]


@pytest.mark.parametrize("name", list(MIXERS))
def test_bfloat16_parameters_are_the_float32_ones_rounded(name):
    models = [
        LanguageModel(
            ModelConfig(
                vocab_size=32,
                d_model=32,
                num_layers=1,
                num_heads=2,
                mixer=name,
                param_dtype=dtype,
                max_length=16,
            ),
            rngs=nnx.Rngs(0),
        )  # fmt: skip
        for dtype in ("float32", "bfloat16")
    ]
    f32, bf16 = (_params(m) for m in models)
    assert [p for p, _ in f32] == [p for p, _ in bf16]
    for (path, a), (_, b) in zip(f32, bf16, strict=True):
        assert b.dtype == jnp.bfloat16, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(
            np.asarray(a.astype(jnp.bfloat16), np.float32), np.asarray(b, np.float32)
        )


def _train_step(dtype):
    """``(state before, state after, metrics, graphdef)`` of one step of the hybrid."""
    mesh = make_mesh(1)
    cfg = experiment_config(_config(dtype))
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.num_steps)
    graphdef, state = nnx.split(trainer.build_model(cfg, tx))
    batch = shard_batch(trainer.build_data(cfg).train_batch(0, cfg.train.batch_size), mesh)
    before = jax.device_get(state)
    state, metrics = trainer.train_step(
        state, batch, graphdef=graphdef, mesh=mesh, fsdp=False, accum=1
    )
    return before, jax.device_get(state), jax.device_get(metrics), graphdef


@pytest.mark.slow  # one compile of a 14-layer hybrid: 30-75 s on the 2-core machine
def test_every_mixer_trains_a_step_with_bfloat16_parameters():
    before, after, metrics, graphdef = _train_step("bfloat16")
    old, new = nnx.merge(graphdef, before)[0], nnx.merge(graphdef, after)[0]
    assert {str(p.dtype) for p in jax.tree.leaves(nnx.state(new, nnx.Param))} == {"bfloat16"}
    assert np.isfinite(metrics["train/loss"]) and metrics["grad_norm"] > 0
    # Adam's first step moves every parameter with a gradient by about the learning rate
    # (1e-2), far above bfloat16's rounding at these magnitudes: every mixer's own move
    for i, name in enumerate(MIXERS):
        moved = jax.tree.map(
            lambda a, b: bool(np.any(np.asarray(a, np.float32) != np.asarray(b, np.float32))),
            nnx.state(old.blocks[i].mixer, nnx.Param),
            nnx.state(new.blocks[i].mixer, nnx.Param),
        )
        assert any(jax.tree.leaves(moved)), name


@pytest.mark.slow  # two compiles of the 14-layer hybrid
def test_the_bfloat16_step_has_the_float32_loss():
    """The first step's loss with bfloat16 parameters is the float32 model's, to bfloat16
    rounding (the parameters are the float32 ones, rounded)."""
    f32 = _train_step("float32")[2]
    bf16 = _train_step("bfloat16")[2]
    np.testing.assert_allclose(bf16["train/loss"], f32["train/loss"], rtol=2e-2)


def test_the_dry_run_builds_what_the_run_builds(monkeypatch):
    """The dry run lowers the real initialisation: an initialiser that cannot run in the
    parameter dtype fails there, as a ValueError naming it, not only in the real run."""
    from linear_attention.layers import projections

    config = load_config("mqar", "smoke")
    config.model.mixer = "rwkv7"
    config.model.conv = 0
    config.model.param_dtype = "bfloat16"
    cfg = experiment_config(config)
    model = abstract_model(cfg)  # (what dry_run sizes)
    assert {str(p.dtype) for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {"bfloat16"}
    # an initialiser computed in bfloat16 (as before the fix): QR has no bfloat16 kernel
    monkeypatch.setattr(
        projections,
        "float32_init",
        lambda init: lambda key, shape, dtype=jnp.float32: init(key, shape, jnp.bfloat16),
    )
    with pytest.raises(ValueError, match="the model cannot be built with config.model.param_dtype"):
        dry_run(config)
