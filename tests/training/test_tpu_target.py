"""``config.mesh.target``: the train step compiled by XLA:TPU for a TPU slice on this machine
(libtpu's compile-only devices), its memory per device, whether it fits, the exit status and
the errors of ``la-train --dry_run``, and the ``--fit`` search.

Compiling for a TPU needs libtpu (``jax[tpu]``, in the ``test`` extras); where it is absent the
tests that compile skip with the reason. Shapes are tiny (sequence 32, chunks of 16): the
cost is XLA:TPU's compile time, ~5 to 40 s per step here."""

import functools
import json
import os

import jax
import pytest

from linear_attention.models.config import REMAT
from linear_attention.training import cli, sizing, target_base, tpu_target
from linear_attention.training.targets import TARGET_FORMS, parse_target
from linear_attention.training.tpu_target import oom_bytes
from tests.scripts import load_module
from tests.training.conftest import (
    FAMILY_CASES,
    RECURRENT_FAMILIES,
    ROOT,
    dry_run_cli,
    families_dry_run,
    load_config,
)

GiB = 2**30
MISSING = tpu_target.libtpu_missing()
needs_libtpu = pytest.mark.skipif(MISSING is not None, reason=f"compiling for TPU: {MISSING}")
V5E = "--config.mesh.target=tpu:v5e:2x2"


def _check_sizing(sizing: dict, devices: int):
    """What every target sizing holds: the compiler's HBM figure for v5e (16 GiB less what
    the runtime reserves: 15.75 GiB), the parts adding up to the total, and every device
    holding at least the replicated float32 parameters and AdamW's two moments."""
    assert sizing["target"] == {
        "name": "tpu:v5e:2x2",
        "compiler": "XLA:TPU",
        "device_kind": "TPU v5 lite",
        "devices": 4,
        "chips": 4,
        "mesh": {"data": devices, "seq": 1, "model": 1},
    }
    assert sizing["hbm_bytes_per_device"] == round(15.75 * GiB)
    assert "XLA:TPU compiler" in sizing["hbm_source"]
    assert sizing["versions"]["jax"] == jax.__version__
    m = sizing["memory"]
    assert sizing["train_step_bytes_per_device"] == (
        m["arguments"] + m["outputs"] - m["aliases"] + m["temporaries"]
    )
    assert m["arguments"] >= 3 * 4 * sizing["parameters"]
    assert m["aliases"] >= 3 * 4 * sizing["parameters"]  # the donated state is reused
    assert sizing["fits"] is True
    assert 0 < sizing["train_step_bytes_per_device"] <= sizing["hbm_bytes_per_device"]


@pytest.mark.parametrize(
    "target",
    [
        "tpu:v9:1x1",
        "gpu:v5e:2x2",
        "garbage",
        "tpu:v5e:",
        "tpu:v5e:0x2",
        "tpu:v5e:2x2x2x2",
        "v5e:2x2",
    ],
)
def test_a_bad_target_is_a_usage_error_naming_the_accepted_forms(capsys, monkeypatch, target):
    monkeypatch.chdir(ROOT)
    status, sizing, err = dry_run_cli(
        capsys, "--config=configs/mqar.py:smoke", f"--config.mesh.target={target}"
    )
    assert status == 2 and sizing is None
    assert err.startswith(f"la-train: error: config.mesh.target = {target!r}")
    assert TARGET_FORMS in err and "Traceback" not in err
    with pytest.raises(ValueError, match="accepted: '' \\(the visible devices\\)"):
        parse_target(target)


def test_targets_parse():
    assert parse_target("") is None
    t = parse_target("tpu:v5p:2x2x2")
    assert (t.generation, t.topology, t.device_kind) == ("v5p", "2x2x2", "TPU v5")
    assert parse_target("tpu:v4:2x2x1").device_kind == "TPU v4"
    assert parse_target("tpu:v6e:16x16").topology == "16x16"


def test_the_compilers_out_of_memory_messages_are_read():
    total = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (302.99G) exceeds available HBM (15.75G)."
    )
    assert oom_bytes(total) == (round(302.99 * GiB), round(15.75 * GiB))
    used = (
        "Ran out of memory in memory space hbm. Used 8.00G of 8.00G hbm. Exceeded hbm "
        "capacity by 110.0K."
    )
    assert oom_bytes(used) == (8 * GiB + 110 * 1024, 8 * GiB)
    assert oom_bytes("INVALID_ARGUMENT: something else") is None


def test_without_libtpu_a_target_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(tpu_target, "libtpu_missing", lambda: "libtpu is not installed: pip ...")
    tpu_target.topology_devices.cache_clear()
    try:
        status, _, err = dry_run_cli(capsys, "--config=configs/mqar.py:smoke", V5E)
    finally:
        tpu_target.topology_devices.cache_clear()
    assert status == 2
    assert err == (
        "la-train: error: config.mesh.target = 'tpu:v5e:2x2' needs libtpu: libtpu is not "
        "installed: pip ...\n"
    )


def test_fit_needs_a_target_and_adry_run_cli(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    status, _, err = dry_run_cli(capsys, "--config=configs/mqar.py:smoke", "--fit")
    assert status == 2 and "--fit searches a setting that fits config.mesh.target" in err
    status = cli.main(
        ["la-train", "--config=configs/mqar.py:smoke", f"--workdir={tmp_path}", "--fit"]
    )
    assert status == 2 and "--fit searches with --dry_run" in capsys.readouterr().err


@needs_libtpu
def test_a_topology_libtpu_cannot_lay_out_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    status, _, err = dry_run_cli(
        capsys, "--config=configs/mqar.py:smoke", "--config.mesh.target=tpu:v5e:3x3"
    )
    assert status == 2
    assert err.startswith("la-train: error: config.mesh.target = 'tpu:v5e:3x3': libtpu cannot")
    assert "not divisible" in err and "Traceback" not in err


@needs_libtpu
@pytest.mark.parametrize("preset, mixers", FAMILY_CASES)
def test_every_mixer_family_compiles_for_a_v5e_slice(capsys, monkeypatch, preset, mixers):
    """One layer of each family (linear, decays, delta rule, DPLR, DeltaProduct, softmax,
    sliding window) in one model, compiled for 4 v5e chips (~30 s of CPU: the delta-rule
    family's chunk forms are most of it); the default backend stays the CPU's (a TPU target
    compiles, it runs nothing)."""
    monkeypatch.chdir(ROOT)
    _check_sizing(families_dry_run(capsys, preset, mixers, "tpu:v5e:2x2"), devices=4)
    assert os.environ.get("ALLOW_MULTIPLE_LIBTPU_LOAD") is not None


@needs_libtpu
@pytest.mark.slow
def test_the_recurrent_blocks_compile_for_a_v5e_slice(capsys, monkeypatch):
    """Mamba-1's block and Griffin's recurrent block in one LM smoke model, compiled for 4 v5e
    chips (10 s on a loaded 2-core CPU: under -m slow)."""
    monkeypatch.chdir(ROOT)
    model = [f"--config.model.mixer={RECURRENT_FAMILIES}", "--config.model.num_layers=2"]
    status, sizing, err = dry_run_cli(capsys, "--config=configs/lm.py:smoke", V5E, *model)
    assert status == 0, err
    _check_sizing(sizing, devices=4)


@needs_libtpu
def test_the_pallas_method_compiles_for_a_v5e_slice(capsys, monkeypatch):
    """method="pallas" on a CPU machine: the Mosaic kernels lowered for the target (a per-token
    decay and a plain linear layer), for every layer or for one layer type; without a target
    the dry run compiles for this machine's CPU, where the Pallas kernels raise."""
    monkeypatch.chdir(ROOT)
    model = ["--config.model.options.method=pallas", "--config.model.options.chunk_size=16"]
    model += ["--config.model.mixer=gated,linear", "--config.model.num_layers=2"]
    status, sizing, err = dry_run_cli(capsys, "--config=configs/mqar.py:smoke", V5E, *model)
    assert status == 0, err
    _check_sizing(sizing, devices=4)
    status, _, err = dry_run_cli(capsys, "--config=configs/mqar.py:smoke", *model)
    assert status == 2 and "the Pallas kernels target TPU" in err, err
    # one layer type on Pallas through layer_options: the step is still split by shard_map
    # (else XLA:TPU refuses: "Mosaic kernels cannot be automatically partitioned")
    hybrid = [*model[1:], "--config.model.layer_options={'gated': {'method': 'pallas'}}"]
    status, sizing, err = dry_run_cli(capsys, "--config=configs/mqar.py:smoke", V5E, *hybrid)
    assert status == 0, err
    _check_sizing(sizing, devices=4)


@needs_libtpu
def test_a_step_that_cannot_fit_exits_1_with_what_it_needs(capsys, monkeypatch):
    """2^21 rows of 32 tokens on 4 chips: each holds 2^19 · 32 · 256 float32 logits (16 GiB)
    alone, more than a v5e chip's 15.75 GiB, so the compiler refuses the step."""
    monkeypatch.chdir(ROOT)
    status, sizing, err = dry_run_cli(
        capsys, "--config=configs/lm.py:smoke", V5E, f"--config.train.batch_size={2**21}"
    )
    assert status == 1
    assert sizing["fits"] is False and sizing["memory"] is None
    logits = 2**19 * 32 * 256 * 4
    assert sizing["train_step_bytes_per_device"] > logits > sizing["hbm_bytes_per_device"]
    need = sizing["train_step_bytes_per_device"] / GiB
    assert err == (
        "la-train: the train step does not fit tpu:v5e:2x2 (4 x TPU v5 lite): it needs "
        f"{need:.2f} GiB per device and a device has 15.75 GiB (XLA:TPU's figures); --fit "
        "searches a setting that fits\n"
    )
    assert "RESOURCE_EXHAUSTED" in sizing["compiler_message"]
    assert oom_bytes(sizing["compiler_message"])[0] == sizing["train_step_bytes_per_device"]


def _capped(monkeypatch, mib: int):
    """la-train's dry run holding XLA:TPU to ``mib`` MiB per device (`dry_run`'s
    ``hbm_limit``, the compiler's own cap), so that tiny models need a change to fit."""
    monkeypatch.setattr(
        cli, "dry_run_sizing", functools.partial(sizing.dry_run, hbm_limit=mib * 2**20)
    )


@needs_libtpu
def test_fit_finds_the_first_setting_in_its_order_that_fits(capsys, monkeypatch):
    """d 256 (1.19M parameters: 13.6 MiB of float32 parameters and AdamW moments on each
    device when replicated) under a 16 MiB cap: with remat=block given, neither it nor 2
    micro-batches (one row per device) fit; FSDP (a quarter of the state per device) does.
    The tries follow FIT_ORDER and the batch, sequence and model are untouched."""
    monkeypatch.chdir(ROOT)
    _capped(monkeypatch, 16)
    argv = ["--config=configs/lm.py:smoke", V5E, "--config.model.d_model=256"]
    status = cli.main(["la-train", *argv, "--config.model.remat=block", "--dry_run", "--fit"])
    out, err = capsys.readouterr()
    assert status == 0, err
    *_, found, last = out.strip().splitlines()
    sizing_ = json.loads(last)
    assert found == "fits tpu:v5e:2x2 with: --config.mesh.fsdp=True"
    assert sizing_["fit"]["overrides"] == ["--config.mesh.fsdp=True"]
    tries = [
        (t["remat"], t["grad_accum_steps"], t["fsdp"], t["fits"]) for t in sizing_["fit"]["tries"]
    ]
    assert tries == [
        ("block", 1, False, False),  # as given
        ("block", 2, False, False),  # the most micro-batches: 8 rows over 4 devices
        ("block", 1, True, True),  # FSDP, the remat stage again: block is its strongest
    ]
    assert [line.split(":")[1].strip() for line in err.splitlines() if "try" in line] == [
        "try 1",
        "try 2",
        "try 3",
    ]
    assert sizing_["hbm_bytes_per_device"] == 16 * 2**20
    assert sizing_["fits"] and sizing_["train_step_bytes_per_device"] <= 16 * 2**20
    assert sizing_["memory"]["arguments"] >= 3 * 4 * sizing_["parameters"] / 4
    assert sizing_["memory"]["arguments"] < 3 * 4 * sizing_["parameters"]  # split over 4
    given = sizing_["fit"]["tries"][0]["bytes_per_device"]
    assert given > 16 * 2**20 > sizing_["train_step_bytes_per_device"]


@needs_libtpu
def test_fit_without_a_setting_that_fits_exits_1(capsys, monkeypatch):
    """Under a 1 MiB cap with block, the most micro-batches and FSDP given, nothing is left
    to try: one compile, then one la-train line with the smallest need."""
    monkeypatch.chdir(ROOT)
    _capped(monkeypatch, 1)
    status = cli.main(
        [
            "la-train",
            "--config=configs/lm.py:smoke",
            V5E,
            "--config.model.d_model=128",
            "--config.model.remat=block",
            "--config.train.grad_accum_steps=2",
            "--config.mesh.fsdp=True",
            "--dry_run",
            "--fit",
        ]
    )
    out, err = capsys.readouterr()
    assert status == 1
    sizing_ = json.loads(out.strip().splitlines()[-1])
    assert sizing_["fits"] is False and sizing_["fit"]["overrides"] is None
    assert len(sizing_["fit"]["tries"]) == 1
    need = sizing_["train_step_bytes_per_device"]
    assert need > 2**20
    assert err.splitlines()[-1] == (
        "la-train: no setting tried fits tpu:v5e:2x2 (4 x TPU v5 lite): the smallest needs "
        f"{need / 2**20:.2f} MiB per device (remat=block, grad_accum_steps=2, fsdp=True) and "
        "a device has 1.00 MiB"
    )


def test_a_run_with_a_target_trains_on_the_visible_devices_and_says_so(
    capsys, monkeypatch, tmp_path
):
    """The target is for --dry_run: training with it set runs here (no libtpu needed)."""
    monkeypatch.chdir(ROOT)
    argv = ["--config=configs/mqar.py:smoke", V5E, f"--workdir={tmp_path / 'run'}"]
    argv += ["--config.train.num_steps=2", "--config.train.eval_every=2"]
    assert cli.main(["la-train", *argv]) == 0
    out, err = capsys.readouterr()
    kind = jax.devices()[0].device_kind
    assert (
        f"config.mesh.target = 'tpu:v5e:2x2' is what --dry_run compiles for; this run trains on "
        f"the visible {kind} device(s)"
    ) in out + err
    assert json.loads((tmp_path / "run" / "config.json").read_text())["mesh"]["target"] == (
        "tpu:v5e:2x2"
    )


PAPER = tuple(load_module("configs/lm.py", "configs_lm_tpu").PAPER_SIZES)


@pytest.mark.parametrize("preset", PAPER)
def test_a_paper_preset_with_a_target_states_it_and_its_setting(preset):
    """A preset that names a slice says so in configs/lm.py's docstring, with the setting."""
    config = load_config("lm", preset)
    if not config.mesh.target:
        pytest.skip(f"{preset} names no TPU slice yet (not sized by XLA:TPU)")
    module = load_module("configs/lm.py", "configs_lm_tpu")
    setting = (
        f"``{preset}``: ``{config.mesh.target}`` with remat={config.model.remat}, "
        f"grad_accum_steps={config.train.grad_accum_steps}, fsdp={config.mesh.fsdp}"
    )
    assert setting in " ".join(module.__doc__.split())


@pytest.mark.slow  # a paper-size compile: ~4 to 15 minutes each on 2 loaded cores
@needs_libtpu
@pytest.mark.parametrize("preset", PAPER)
def test_every_paper_preset_fits_its_named_target(capsys, monkeypatch, preset):
    monkeypatch.chdir(ROOT)
    config = load_config("lm", preset)
    if not config.mesh.target:
        pytest.skip(f"{preset} names no TPU slice yet (not sized by XLA:TPU)")
    status, sizing_, err = dry_run_cli(capsys, f"--config=configs/lm.py:{preset}")
    assert status == 0, err
    assert sizing_["target"]["name"] == config.mesh.target and sizing_["fits"] is True
    assert sizing_["train_step_bytes_per_device"] <= sizing_["hbm_bytes_per_device"]


def test_help_gives_the_target_forms_and_the_fit_order(capsys):
    assert cli.main(["la-train", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert " ".join(sizing.FIT_ORDER.split()) in out
    assert "--config.mesh.target=tpu:GEN:TOPOLOGY" in out and "target" in out


def test_every_remat_policy_has_a_place_in_the_fit_order():
    assert sorted(sizing.REMAT_ORDER) == sorted(REMAT)


@needs_libtpu
def test_a_compiler_error_is_one_line_and_exit_1(capsys, monkeypatch):
    """XLA:TPU refusing a step for another reason than memory: its message in one line."""
    monkeypatch.chdir(ROOT)

    def refuse(traced, target, hbm, limit=None):
        raise target_base.TargetCompileError(
            f"XLA:TPU could not compile for {target.name}: UNIMPLEMENTED: no such op"
        )

    monkeypatch.setattr(sizing, "compile_for_target", refuse)
    status, sizing_, err = dry_run_cli(capsys, "--config=configs/mqar.py:smoke", V5E)
    assert status == 1 and sizing_ is None
    assert err == "la-train: XLA:TPU could not compile for tpu:v5e:2x2: UNIMPLEMENTED: no such op\n"


@needs_libtpu
def test_more_devices_than_the_target_has_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    status, _, err = dry_run_cli(
        capsys, "--config=configs/mqar.py:smoke", V5E, "--config.mesh.num_devices=8"
    )
    assert status == 2
    assert err == (
        "la-train: error: config.mesh.num_devices = 8 but only 4 devices are in "
        "config.mesh.target\n"
    )
