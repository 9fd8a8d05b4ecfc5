"""Expert parallelism (``config.mesh.expert``) on 8 forced CPU devices: a small hybrid
`LanguageModel` with MoE blocks (Qwen3-Next's softmax router and gated shared expert; and
DeepSeek-V3 / Kimi Linear's grouped sigmoid router, ungated shared expert) with its experts
split over an ``expert`` axis of 4 (data 2), and of 2 with FSDP and gradient accumulation
(data 4), gives the unsplit model's logits, cross-entropy, auxiliary load-balancing loss and
parameter gradients (with the auxiliary loss in the objective) to float32 rounding. The
compiled step holds E / ``expert`` experts per device and moves the dispatched tokens by
all-to-all; a `trainer.train` run with ``expert`` 2 equals one device's, and the trainer's dry
run counts the split in its per-device bytes. One subprocess (a mesh needs its devices before
JAX starts); the config's refusals run here."""

import json

import numpy as np
import pytest

from linear_attention.training import experiment_config, trainer
from linear_attention.training.mesh import expert_split_dim
from tests.scripts import run_on_cpu_devices
from tests.training.conftest import tiny_mqar, tiny_mqar_with
from tests.training.test_multidevice import summarize

SCRIPT = """
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from linear_attention.models import LanguageModel
from linear_attention.models.config import ModelConfig
from linear_attention.training.mesh import (
    batch_sharding, expert_split_dim, make_mesh, path_names, state_shardings
)
from linear_attention.training.steps import summed_gradients

assert jax.device_count() == 8, jax.devices()
rng = np.random.default_rng(0)
tokens = rng.integers(0, 32, (2, 16, 12)).astype(np.int32)
BATCH = {"inputs": tokens[0], "labels": tokens[1]}
AUX = 0.5  # the auxiliary loss's weight in the objective: its gradient is compared too


def run_model(model, mesh, fsdp=False, accum=1):
    graphdef, state = nnx.split(model)

    def run(state, batch):
        model = nnx.merge(graphdef, state)
        loss, _, _, aux, grads = summed_gradients(model, batch, mesh, accum, AUX)
        return model(batch["inputs"]), loss, aux, grads

    if mesh is None:
        return jax.jit(run)(state, BATCH), None, None
    shardings = state_shardings(state, mesh, fsdp)
    step = jax.jit(run, in_shardings=(shardings, batch_sharding(mesh)))
    args = (jax.device_put(state, shardings), jax.device_put(BATCH, batch_sharding(mesh)))
    compiled = step.lower(*args).compile()
    return compiled(*args), compiled, args[0]


def relative(a, b):
    return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))


def compare(name, expert, data, fsdp=False, accum=1, **options):
    config = ModelConfig(
        vocab_size=32, d_model=16, num_layers=2, num_heads=2, mixer=("gated_deltanet", "softmax"),
        mlp_ratio=2.0, num_experts=8, experts_per_token=2, moe_dim=8, shared_expert_dim=8,
        **options
    )
    model = LanguageModel(config, rngs=nnx.Rngs(0))
    # (with accumulation the auxiliary loss is each micro-batch's: the reference's too)
    (ref_logits, ref_loss, ref_aux, ref_grads), _, _ = run_model(model, None, accum=accum)
    mesh = make_mesh(0, expert=expert)
    assert dict(mesh.shape) == {"data": data, "expert": expert, "seq": 1, "model": 1}, mesh.shape
    (logits, loss, aux, grads), compiled, state = run_model(model, mesh, fsdp, accum)
    errors = {
        "/".join(path_names(p)): relative(g, r)
        for (p, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads))
    }
    placed = {}
    in_shardings = jax.tree.leaves(compiled.input_shardings[0][0])
    for (p, x), s in zip(jax.tree_util.tree_leaves_with_path(state), in_shardings):
        names = path_names(p)
        placed["/".join(names)] = {
            "expected": expert_split_dim(names, x.shape, expert),
            "compiled_spec": [str(a) for a in s.spec],
            "shape": list(x.shape),
            "local": list(x.addressable_shards[0].data.shape),
        }
    hlo = compiled.as_text()
    print("RESULT " + json.dumps({
        "name": name,
        "all_to_all": hlo.count(" all-to-all("),
        "expert": expert,
        "logit_error": relative(logits, ref_logits),
        "loss": [float(loss), float(ref_loss)],
        "aux": [float(aux), float(ref_aux)],
        "grad_errors": errors,
        "placed": placed,
    }), flush=True)


compare("softmax", 4, 2)
# the trainer's loop (train step, evaluation, checkpoints) with expert = 2 (data 4)
import sys
from linear_attention.training import sizing, trainer
from tests.training.conftest import load_config
from tests.training.test_expert_parallel import moe_mqar
from tests.training.test_multidevice import summarize
config = moe_mqar()
config.mesh.expert = 2
run = summarize(trainer.train(config, sys.argv[1]))
print("RESULT " + json.dumps({"name": "trainer", **run}), flush=True)
# the trainer's dry run (its real train step, compiled for the 8 devices): per-device bytes
config = load_config("mqar", "smoke")
config.model.mlp, config.model.num_experts, config.model.experts_per_token = True, 8, 2
config.model.moe_dim = 128
dry = {}
for expert in (1, 4):
    config.mesh.expert = expert
    dry[expert] = sizing.dry_run(config)["train_step_bytes_per_device"]
experts = 4 * config.model.num_layers * 3 * 8 * config.model.d_model * 128
print("RESULT " + json.dumps({"name": "dry_run", "bytes": dry, "expert_bytes": experts}))
compare(
    "grouped_sigmoid_fsdp_accum", 2, 4, fsdp=True, accum=2, moe_router="sigmoid",
    moe_score_bias=True, moe_groups=4, moe_topk_groups=2, moe_routed_scale=2.5,
    moe_shared_gate=False,
)
"""

RUNS = {"softmax": 4, "grouped_sigmoid_fsdp_accum": 2}


def moe_mqar():
    """The trainer tests' MQAR model with MoE MLPs and their auxiliary loss in the objective."""
    config = tiny_mqar()
    config.model.mlp, config.model.num_experts, config.model.experts_per_token = True, 4, 2
    config.model.moe_aux_loss_coef = 0.01
    return config


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = run_on_cpu_devices(SCRIPT, 8, str(tmp_path_factory.mktemp("expert_parallel")))
    found = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    return {r["name"]: r for r in found}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_expert_parallel_equals_one_device(results, name):
    r = results[name]
    assert r["expert"] == RUNS[name]
    assert r["logit_error"] < 1e-5, r["logit_error"]
    for got, want in (r["loss"], r["aux"]):
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    assert r["aux"][1] > 0
    worst = max(r["grad_errors"].items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-4, worst
    # every expert weight split along E, a device holding E / expert experts; nothing else
    split = 0
    for path, p in r["placed"].items():
        if p["expected"] is None:
            assert "expert" not in p["compiled_spec"], (path, p)
            continue
        split += 1
        assert p["compiled_spec"][0] == "expert", (path, p)
        assert p["local"][0] == p["shape"][0] // RUNS[name], (path, p)
    assert split == 2 * 3, r["placed"].keys()  # two MoE layers, three expert weights each
    # the dispatch and the return: an all-to-all over ``expert`` each way, per MoE layer
    assert r["all_to_all"] >= 2, r["all_to_all"]


def test_trainer_equals_one_device(results, tmp_path):
    """`trainer.train` of the MoE MQAR model with mesh.expert = 2 (data 4): the per-step
    losses, gradient norms and evaluations of one device."""
    one = summarize(trainer.train(moe_mqar(), str(tmp_path / "one")))
    split = results["trainer"]
    assert split["num_devices"] == 8 and one["num_devices"] == 1
    for key in ("train_loss", "grad_norm", "eval_loss"):
        np.testing.assert_allclose(split[key], one[key], rtol=1e-5, err_msg=key)


def test_expert_split_dim():
    w = ("blocks", "1", "mlp", "w_gate")
    assert expert_split_dim(w, (8, 16, 4), 4) == 0
    assert expert_split_dim(("blocks", "1", "mlp", "w_down"), (8, 4, 16), 2) == 0
    assert expert_split_dim(w, (8, 16, 4), 1) is None
    assert expert_split_dim(w, (6, 16, 4), 4) is None  # (the config refuses it first)
    # the dense MLP's and the shared expert's SwiGLU kernels, the router: not experts
    assert expert_split_dim(("blocks", "1", "mlp", "w_gate", "kernel"), (16, 4), 2) is None
    assert expert_split_dim(("blocks", "1", "mlp", "shared", "w_up", "kernel"), (16, 4), 2) is None
    assert expert_split_dim(("blocks", "1", "mlp", "router", "kernel"), (16, 8), 2) is None
    # optimizer state leaves follow their parameter
    assert expert_split_dim(("1", "opt_state", "0", "mu", *w), (8, 16, 4), 2) == 0


MOE = {"model.mlp": True, "model.num_experts": 4, "model.experts_per_token": 2}


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {**MOE, "mesh.expert": 3},
            r"config.mesh.expert = 3 splits the experts .* model.num_experts = 4 is not "
            r"divisible by it \(allowed: 1, 2, 4\)",
        ),
        ({"mesh.expert": 2}, r"model.num_experts = 0 \(use mesh.expert = 1\)"),
        (
            {**MOE, "mesh.expert": 4, "mesh.num_devices": 6},
            r"config.mesh.expert = 4 times mesh.seq × mesh.model = 1 × 1 must divide "
            r"num_devices = 6 \(allowed: 1, 2, 3, 6\)",
        ),
        ({**MOE, "mesh.expert": 2, "mesh.seq": 2}, "does not combine with mesh.seq = 2"),
        (
            {**MOE, "mesh.expert": 2, "model.options.method": "pallas"},
            "Pallas kernels run in a shard_map",
        ),
        ({**MOE, "mesh.expert": 0}, "config.mesh.expert"),
    ],
)
def test_config_refuses(changes, message):
    with pytest.raises(ValueError, match=message):
        experiment_config(tiny_mqar_with(**changes))


def test_mesh_refuses_an_expert_axis_the_devices_do_not_hold():
    from linear_attention.training.mesh import make_mesh

    with pytest.raises(
        ValueError, match=r"config.mesh.expert = 4 .* 6 devices \(allowed: 1, 2, 3, 6\)"
    ):
        make_mesh(0, 1, devices=np.arange(6), expert=4)


def test_cli_refuses_an_expert_axis_without_experts(capsys, monkeypatch, tmp_path):
    from linear_attention.training import cli
    from tests.training.conftest import ROOT

    monkeypatch.chdir(ROOT)
    argv = ["la-train", "--config=configs/mqar.py:smoke", f"--workdir={tmp_path / 'run'}"]
    assert cli.main([*argv, "--config.mesh.expert=2"]) == 2
    assert capsys.readouterr().err == (
        "la-train: error: config.mesh.expert = 2 splits the experts over 2 devices but "
        "model.num_experts = 0 (use mesh.expert = 1)\n"
    )
    assert not (tmp_path / "run").exists()


def test_dry_run_counts_the_expert_axis(results):
    """Splitting the experts over 4 devices (the batch over all 8 either way) takes at least
    3/4 of the experts' weights and their two Adam moments off each device."""
    r = results["dry_run"]
    one, four = r["bytes"]["1"], r["bytes"]["4"]
    assert one - four >= 3 * 3 / 4 * r["expert_bytes"], (one, four, r["expert_bytes"])
