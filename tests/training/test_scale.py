"""Training at scale: gradient accumulation and rematerialisation give the unsplit step's
update; FSDP with a split time axis and bfloat16 parameters under a split match one device
(4 forced CPU devices, in one subprocess)."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

from linear_attention.training import experiment_config, make_optimizer, trainer
from linear_attention.training.mesh import make_mesh, shard_batch
from tests.scripts import DEADLINE_S
from tests.training.conftest import ROOT, load_config


def _config(**model):
    """The MQAR smoke preset with an MLP (so remat has a whole block to recompute)."""
    config = load_config("mqar", "smoke")
    config.model.mixer = "gla"
    config.model.mlp = True
    for k, v in model.items():
        config.model[k] = v
    return config


def _one_step(config, accum, mesh, batch):
    cfg = experiment_config(config)
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.num_steps)
    graphdef, state = nnx.split(trainer.build_model(cfg, tx))
    state, metrics = trainer.train_step(
        state, batch, graphdef=graphdef, mesh=mesh, fsdp=False, accum=accum
    )
    return jax.device_get(metrics), jax.device_get(state)


def test_accumulation_and_remat_equal_the_unsplit_step():
    """One update of batch 8: whole, as 4 micro-batches with each block rematerialised, and as
    2 micro-batches keeping only the matmuls: the same loss, accuracy, gradient norm and new
    parameters and optimizer state, to float32 rounding."""
    cfg = experiment_config(_config())
    mesh = make_mesh(1)
    batch = shard_batch(trainer.build_data(cfg).train_batch(0, cfg.train.batch_size), mesh)
    m1, s1 = _one_step(_config(), 1, mesh, batch)
    for accum, remat in ((4, "block"), (2, "dots")):
        m, s = _one_step(_config(remat=remat), accum, mesh, batch)
        for key in m1:
            np.testing.assert_allclose(m[key], m1[key], rtol=2e-6, err_msg=key)
        for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(s1), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert m1["train/loss"] > 0 and m1["grad_norm"] > 0


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("grad_accum_steps", 3, r"config\.train\.grad_accum_steps = 3 must divide .*= 8"),
        ("grad_accum_steps", 0, r"config\.train\.grad_accum_steps must be an integer >= 1"),
        ("peak_flops", -1.0, r"config\.train\.peak_flops must be in \[0\.0, inf\]"),
    ],
)
def test_bad_scale_settings_raise(field, value, message):
    config = _config()
    config.train[field] = value
    with pytest.raises(ValueError, match=message):
        experiment_config(config)


def test_bad_remat_raises():
    with pytest.raises(ValueError, match="unknown remat 'all'; allowed: none, block, dots"):
        experiment_config(_config(remat="all"))


SCRIPT = textwrap.dedent(
    """
    import json
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from linear_attention.training import experiment_config, make_optimizer, trainer
    from linear_attention.training.mesh import make_mesh, shard_batch, state_shardings
    from tests.training.test_scale import _config

    assert jax.device_count() == 4, jax.devices()
    one, split = make_mesh(1), make_mesh(4, seq=2)  # data 2 x seq 2

    def step(config, mesh, fsdp, accum):
        cfg = experiment_config(config)
        tx, _ = make_optimizer(cfg.optimizer, cfg.train.num_steps)
        graphdef, state = nnx.split(trainer.build_model(cfg, tx))
        state = jax.device_put(state, state_shardings(state, mesh, fsdp))
        batch = trainer.build_data(cfg).train_batch(0, cfg.train.batch_size)
        state, metrics = trainer.train_step(
            state, shard_batch(batch, mesh), graphdef=graphdef, mesh=mesh, fsdp=fsdp,
            accum=accum,
        )
        shard = state[0]["embed"]["embedding"].addressable_shards[0].data.shape
        leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(jax.device_get(state))]
        dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(nnx.state(state[0], nnx.Param))})
        return jax.device_get(metrics), leaves, list(shard), dtypes

    # One layer, three compilations: one device (float32), and the split FSDP step with 2
    # micro-batches in float32 and with bfloat16 parameters and compute.
    out = {}
    m1, s1, _, _ = step(_config(num_layers=1), one, False, 1)
    bf16 = dict(num_layers=1, dtype="bfloat16", param_dtype="bfloat16")
    for name, model in (("f32", dict(num_layers=1)), ("bf16", bf16)):
        m2, s2, shard, dtypes = step(_config(**model), split, True, 2)
        out[name] = {
            "metrics": [{k: float(v) for k, v in m.items()} for m in (m1, m2)],
            "max_state_err": max(float(np.max(np.abs(a - b))) for a, b in zip(s1, s2)),
            "embed_shard": shard,
            "param_dtypes": dtypes,
        }
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def split_result():
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def test_fsdp_with_split_time_and_accumulation_equals_one_device(split_result):
    """data 2 × seq 2, parameters FSDP-sharded, 2 micro-batches: one device's update (one
    layer of GLA with its MLP)."""
    r = split_result["f32"]
    one, split = r["metrics"]
    for key in one:
        np.testing.assert_allclose(split[key], one[key], rtol=1e-5, err_msg=key)
    assert r["max_state_err"] < 1e-6
    vocab, d_model = 64, 32  # the embedding's first axis split over the 2 data devices
    assert r["embed_shard"] == [vocab // 2, d_model] and r["param_dtypes"] == ["float32"]


def test_bfloat16_parameters_under_a_split_match_float32_on_one_device(split_result):
    """bfloat16 parameters (and compute) under data 2 × seq 2 with FSDP: they stay bfloat16
    through the update, and the loss, gradient norm and new state are the float32 one-device
    step's to bfloat16 rounding (8 bits of mantissa: ~0.4% per rounding)."""
    r = split_result["bf16"]
    one, split = r["metrics"]
    assert r["param_dtypes"] == ["bfloat16"]
    np.testing.assert_allclose(split["train/loss"], one["train/loss"], rtol=1e-2)
    np.testing.assert_allclose(split["grad_norm"], one["grad_norm"], rtol=5e-2)
    # parameters ~0.02 and Adam's first update ~lr = 1e-3: their bfloat16 rounding (~1e-4),
    # and the second moment's (squared gradients, up to ~1e-2 in absolute terms)
    assert r["max_state_err"] < 2e-2
