"""Multi-process training (`config.mesh.multi_host`): two processes on localhost with 2 CPU
devices each (joined by `jax.distributed.initialize`, time split over ``seq = 2`` across them)
give the same losses as one process with 4 devices, and only the lead process writes files;
two processes reading a token file through the Grain pipeline read disjoint shards whose union
is one process's batch. The cheap checks of the config plumbing run by default (the sharding
arithmetic in `tests/data/test_pipeline.py`); the two-process runs are slow."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from linear_attention.training import experiment_config
from linear_attention.training import mesh as mesh_lib
from tests.scripts import DEADLINE_S
from tests.training.conftest import ROOT, load_config, tiny_mqar

WORKER = """
import json, sys
import jax
from linear_attention.training import trainer
from tests.training.conftest import tiny_mqar
from tests.training.test_multidevice import summarize

workdir, port, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = tiny_mqar()
if port:
    config.mesh.multi_host = True
    config.mesh.coordinator_address = f"localhost:{port}"
    config.mesh.num_processes = 2
    config.mesh.process_id = pid
    config.mesh.seq = 2
summary = trainer.train(config, workdir)
out = {"process_count": jax.process_count(), "process_index": jax.process_index(),
       "local_devices": jax.local_device_count(), **summarize(summary)}
print("RESULT" + json.dumps(out))
"""


# Two processes reading a token file through the Grain pipeline (each its own shard), or one
# process reading it whole: the rows each process trained on, step by step, and the losses.
TOKENS_WORKER = """
import json, sys
import jax
from linear_attention.data.sources import GrainData
from linear_attention.training import trainer
from tests.training.test_multidevice import summarize
from tests.training.test_multiprocess import token_config

workdir, port, pid, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
config = token_config(path)
if port:
    config.mesh.multi_host = True
    config.mesh.coordinator_address = f"localhost:{port}"
    config.mesh.num_processes = 2
    config.mesh.process_id = pid
rows = []
original = GrainData.train_batch
def train_batch(self, step, batch_size):
    batch = original(self, step, batch_size)
    rows.append(batch["inputs"].tolist())
    return batch
GrainData.train_batch = train_batch
summary = trainer.train(config, workdir)
out = {"process_index": jax.process_index(), "rows": rows, **summarize(summary)}
print("RESULT" + json.dumps(out))
"""


def token_config(path: str):
    """`configs/lm_tokens.py:smoke` on ``path`` (ids < 64) with rows of 16 tokens, batch 4,
    3 steps: every training document is one window of 17 tokens, so it fills one row."""
    config = load_config("lm_tokens", "smoke")
    config.data.path, config.data.seq_len, config.data.num_val_windows = path, 16, 8
    config.model.vocab_size, config.model.d_model, config.model.max_length = 64, 16, 64
    config.train.batch_size, config.train.num_steps = 4, 3
    config.train.eval_every = config.train.checkpoint_every = 3
    return config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start(args, devices: int, script: str = WORKER):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    )
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc):
    stdout, stderr = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0, stderr[-4000:]
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


@pytest.mark.slow
def test_two_processes_equal_one_process_with_four_devices(tmp_path):
    port = _free_port()
    procs = [_start((tmp_path / "multi", port, pid), devices=2) for pid in (0, 1)]
    single = _start((tmp_path / "single", "", 0), devices=4)
    lead, other = (_result(p) for p in procs)
    one = _result(single)
    assert [lead["process_count"], lead["process_index"], other["process_index"]] == [2, 0, 1]
    assert [lead["local_devices"], lead["num_devices"], one["num_devices"]] == [2, 4, 4]
    for key in ("train_loss", "grad_norm", "eval_loss"):
        np.testing.assert_allclose(lead[key], one[key], rtol=1e-5, err_msg=key)
        np.testing.assert_allclose(other[key], lead[key], rtol=0, err_msg=key)  # same metrics
    # Only the lead wrote: one metrics line per step, one TensorBoard file.
    with open(tmp_path / "multi" / "metrics.jsonl") as f:
        assert len(f.readlines()) == len(one["train_loss"])
    events = [n for n in os.listdir(tmp_path / "multi") if n.startswith("events.out.tfevents")]
    assert len(events) == 1


@pytest.mark.slow
def test_two_processes_read_disjoint_shards_of_a_token_file(tmp_path):
    """Two processes (one CPU device each) train on a token file through the Grain pipeline:
    at every step they read disjoint rows whose union is the batch one process reads alone,
    and the losses are that process's (the same rows, in another order in the batch)."""
    path = str(tmp_path / "train.bin")
    np.random.default_rng(0).integers(0, 64, 3000).astype(np.uint16).tofile(path)
    port = _free_port()
    procs = [_start((tmp_path / "multi", port, pid, path), 1, TOKENS_WORKER) for pid in (0, 1)]
    single = _start((tmp_path / "single", "", 0, path), 1, TOKENS_WORKER)
    lead, other = (_result(p) for p in procs)
    one = _result(single)
    assert [lead["process_index"], other["process_index"], lead["num_devices"]] == [0, 1, 2]
    assert len(one["rows"]) == len(lead["rows"]) == 3
    steps = zip(lead["rows"], other["rows"], one["rows"], strict=True)
    for step, (a, b, whole) in enumerate(steps):
        assert len(a) == len(b) == 2 and len(whole) == 4, step
        assert not {tuple(r) for r in a} & {tuple(r) for r in b}, step
        assert sorted(a + b) == sorted(whole), step
    for key in ("train_loss", "eval_loss"):
        np.testing.assert_allclose(lead[key], one[key], rtol=1e-5, err_msg=key)
        np.testing.assert_allclose(other[key], lead[key], rtol=0, err_msg=key)


def test_initialize_distributed_passes_the_config(monkeypatch):
    calls = []
    monkeypatch.setattr(mesh_lib.jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(mesh_lib.jax.distributed, "initialize", lambda **kw: calls.append(kw))

    def mesh_config(**overrides):
        config = tiny_mqar()
        config.mesh.update(overrides)
        return experiment_config(config).mesh

    mesh_lib.initialize_distributed(mesh_config())  # single process: nothing to join
    mesh_lib.initialize_distributed(mesh_config(multi_host=True))  # all from the environment
    mesh_lib.initialize_distributed(
        mesh_config(
            multi_host=True, coordinator_address="10.0.0.1:1234", num_processes=4, process_id=0
        )
    )
    assert calls == [
        {},
        {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 0},
    ]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_processes": 2}, r"config\.mesh\.num_processes is set but multi_host is False"),
        ({"coordinator_address": "h:1"}, r"coordinator_address is set but multi_host is False"),
        ({"multi_host": True, "num_processes": 2, "process_id": 2}, r"process_id = 2 must be <"),
        ({"multi_host": True, "num_processes": -1}, r"num_processes must be an integer >= 0"),
    ],
)
def test_bad_multi_process_config(overrides, message):
    config = tiny_mqar()
    config.mesh.update(overrides)
    with pytest.raises(ValueError, match=message):
        experiment_config(config)
