"""Data-parallel (and FSDP) training, and training with time split over 4 devices
(``config.mesh.seq = 4``), on 4 forced CPU devices match 1 device: the three runs in one
subprocess, the one-device run in the test process meanwhile."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from linear_attention.training import trainer
from tests.scripts import DEADLINE_S
from tests.training.conftest import ROOT, tiny_mqar

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    import numpy as np
    from flax import nnx
    from linear_attention.training import experiment_config, make_optimizer, trainer
    from linear_attention.training.mesh import make_mesh, shard_batch, state_shardings
    from tests.training.test_multidevice import summarize
    from tests.training.conftest import tiny_mqar

    assert jax.device_count() == 4, jax.devices()
    out = {}
    for name, fsdp, seq in (("dp", False, 1), ("fsdp", True, 1), ("seq4", False, 4)):
        config = tiny_mqar()
        config.mesh.fsdp, config.mesh.seq = fsdp, seq
        out[name] = summarize(trainer.train(config, f"{sys.argv[1]}/{name}"))

    # Where one step leaves the state and how it splits a batch, on the FSDP mesh.
    config.mesh.fsdp, config.mesh.seq = True, 1
    cfg = experiment_config(config)
    mesh = make_mesh(4)
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.num_steps)
    graphdef, state = nnx.split(trainer.build_model(cfg, tx))
    state = jax.device_put(state, state_shardings(state, mesh, True))
    batch = shard_batch(trainer.build_data(cfg).train_batch(0, 8), mesh)
    state, _ = trainer.train_step(state, batch, graphdef=graphdef, mesh=mesh, fsdp=True)
    embed = state[0]["embed"]["embedding"]
    out["embed_shard_shape"] = list(embed.addressable_shards[0].data.shape)
    out["embed_shape"] = list(embed.shape)
    out["batch_shard_shape"] = list(batch["inputs"].addressable_shards[0].data.shape)
    print("RESULT" + json.dumps(out))
    """
)


def summarize(summary):
    """Per-step losses of a finished run (from its metrics.jsonl)."""
    with open(os.path.join(summary["workdir"], "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {
        "num_devices": summary["num_devices"],
        "train_loss": [r["train/loss"] for r in records],
        "grad_norm": [r["grad_norm"] for r in records],
        "eval_loss": [r["eval/loss"] for r in records if "eval/loss" in r],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The subprocess's runs and results, with the one-device run as ``"one"``."""
    tmp_path = tmp_path_factory.mktemp("multidevice")
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Meanwhile one device, here in the test process (which sees a single CPU device).
    one = summarize(trainer.train(tiny_mqar(), str(tmp_path / "one")))
    stdout, stderr = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0, stderr[-3000:]
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT"))
    return dict(json.loads(line[len("RESULT") :]), one=one)


def test_four_devices_match_one(runs):
    one = runs["one"]
    assert [one["num_devices"], runs["dp"]["num_devices"], runs["fsdp"]["num_devices"]] == [1, 4, 4]
    for name in ("dp", "fsdp"):
        for key in ("train_loss", "grad_norm", "eval_loss"):
            np.testing.assert_allclose(runs[name][key], one[key], rtol=1e-5, err_msg=key)
    # FSDP splits the [vocab, d_model] embedding's first axis over 4 devices; the batch of 8
    # rows is split into 4 x 2.
    vocab, d_model = runs["embed_shape"]
    assert runs["embed_shard_shape"] == [vocab // 4, d_model]
    assert runs["batch_shard_shape"] == [2, 32]


def test_training_run_with_seq_4_equals_one_device(runs):
    """A whole run of the favor + softmax hybrid (feature redraws, the conv's halo) on data 1 ×
    seq 4: the one-device run's losses and gradient norms."""
    one, seq4 = runs["one"], runs["seq4"]
    assert seq4["num_devices"] == 4
    for key in ("train_loss", "grad_norm", "eval_loss"):
        np.testing.assert_allclose(seq4[key], one[key], rtol=1e-5, err_msg=key)
