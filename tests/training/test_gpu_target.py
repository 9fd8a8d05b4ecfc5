"""``config.mesh.target = "gpu:..."``: the train step compiled by XLA:GPU for NVIDIA GPUs on this
machine (the CUDA plugin's compile-only devices, described by `gpu_chips`), its memory per GPU,
whether it fits, the exit status and errors of ``la-train --dry_run``, and ``--fit``.

Compiling for a GPU needs the ``gpu-compile`` extra (in the ``test`` extras); where it is absent
the tests that compile skip with the reason. Shapes are tiny except in the preset tests: the cost
is XLA:GPU's compile and ptxas, ~2 to 15 s per small step here."""

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from linear_attention.training import cli, gpu_target, sizing
from linear_attention.training.gpu_chips import ARCHITECTURES, CHIPS, target_config
from linear_attention.training.target_base import compile_for_target
from linear_attention.training.targets import TARGET_FORMS, parse_target
from tests.scripts import load_module
from tests.training.conftest import (
    FAMILIES,
    FAMILY_CASES,
    RECURRENT_FAMILIES,
    ROOT,
    dry_run_cli,
    families_dry_run,
    load_config,
)

GiB = 2**30
MISSING = gpu_target.cuda_missing()
needs_cuda = pytest.mark.skipif(MISSING is not None, reason=f"compiling for GPU: {MISSING}")
H100 = "--config.mesh.target=gpu:h100:8"
H100_BYTES = CHIPS["h100"].device_memory_size


def _check_sizing(sizing_: dict, name: str = "gpu:h100:8", devices: int = 8):
    """What every GPU sizing holds: the chip's memory from its facts, the parts adding up to the
    total, and every GPU holding at least the replicated float32 parameters and AdamW's two
    moments (donated: the outputs reuse them)."""
    assert sizing_["target"] == {
        "name": name,
        "compiler": "XLA:GPU",
        "device_kind": "NVIDIA H100 80GB HBM3",
        "devices": devices,
        "chips": devices,
        "hosts": 1,
        "compute_capability": "9.0",
        "mesh": {"data": devices, "seq": 1, "model": 1},
    }
    assert sizing_["hbm_bytes_per_device"] == H100_BYTES
    assert "totalGlobalMem" in sizing_["hbm_source"]
    assert sizing_["versions"]["jax"] == jax.__version__
    m = sizing_["memory"]
    assert sizing_["train_step_bytes_per_device"] == (
        m["arguments"] + m["outputs"] - m["aliases"] + m["temporaries"]
    )
    assert m["arguments"] >= 3 * 4 * sizing_["parameters"]
    assert m["aliases"] >= 3 * 4 * sizing_["parameters"]
    assert sizing_["fits"] is True
    assert 0 < sizing_["train_step_bytes_per_device"] <= H100_BYTES


@pytest.mark.parametrize(
    "target",
    ["gpu:h999:8", "gpu:h100:0", "gpu:h100:3x", "gpu:h100:9", "gpu:h100:2x9", "gpu:h100", "gpu:"],
)
def test_a_bad_gpu_target_is_a_usage_error_naming_the_accepted_forms(capsys, monkeypatch, target):
    """A chip not in the table, no GPUs, a half-written host split, a count that is not whole
    hosts of 8, more than 8 GPUs a host: refused before anything compiles."""
    monkeypatch.chdir(ROOT)
    status, sizing_, err = dry_run_cli(
        capsys, "--config=configs/mqar.py:smoke", f"--config.mesh.target={target}"
    )
    assert status == 2 and sizing_ is None
    assert err.startswith(f"la-train: error: config.mesh.target = {target!r}")
    assert TARGET_FORMS in err and "gpu:h100:2x8" in err and "Traceback" not in err


def test_gpu_targets_parse():
    """A count up to a host's 8 GPUs is one host; above it, whole hosts of 8."""
    shapes = {
        "gpu:h100:1": (1, 1),
        "gpu:h100:8": (1, 8),
        "gpu:h100:2x8": (2, 8),
        "gpu:h100:16": (2, 8),
        "gpu:h200:8": (1, 8),
        "gpu:a100:4": (1, 4),
        "gpu:b200:2x4": (2, 4),
    }
    for name, shape in shapes.items():
        t = parse_target(name)
        assert (t.hosts, t.per_host) == shape and t.name == name
        assert t.compiler == "XLA:GPU" and t.platform == "cuda"
        # The Mosaic GPU kernels are Hopper kernels: H100 and H200 only.
        assert t.pallas_backend == ("gpu" if name.startswith(("gpu:h100", "gpu:h200")) else None)
    assert parse_target("gpu:h200:8").device_kind == "NVIDIA H200"


def test_the_target_config_renders_each_chips_facts():
    """The rendered text holds each fact of the chip's table row and of its compute capability,
    once, in protobuf text form (the GPU compiler parses it: the compile tests)."""
    h100 = target_config(CHIPS["h100"])
    assert "core_count: 132\n" in h100 and "device_memory_size: 84942979072\n" in h100
    assert "shared_memory_per_core: 233472\n" in h100  # 228 KiB per SM on compute capability 9.0
    assert "feature_extension: ACCELERATED_FEATURES" in h100  # sm_90a
    assert 'name: "NVIDIA H100 80GB HBM3"' in h100 and 'platform_name: "CUDA"' in h100
    a100 = target_config(CHIPS["a100"])
    assert "cuda_compute_capability { major: 8 minor: 0 feature_extension: NONE }" in a100
    assert "l2_cache_size: 41943040\n" in a100  # 40 MiB
    for chip in CHIPS.values():
        text = target_config(chip)
        assert text.count("core_count:") == 1 and chip.capability in ARCHITECTURES
        assert text.count("{") == text.count("}") == 2


def test_without_the_cuda_plugin_a_gpu_target_names_the_extra(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(gpu_target, "_spec", lambda module: False)
    gpu_target.topology_devices.cache_clear()
    try:
        status, _, err = dry_run_cli(capsys, "--config=configs/mqar.py:smoke", H100)
    finally:
        gpu_target.topology_devices.cache_clear()
    assert status == 2
    assert err == (
        "la-train: error: config.mesh.target = 'gpu:h100:8' needs XLA:GPU: the CUDA plugin of "
        "jax is not installed: pip install 'linear_attention[gpu-compile]'\n"
    )


def test_the_pallas_method_with_a_gpu_target_is_a_usage_error(capsys, monkeypatch):
    """method="pallas" on a GPU target is refused before compiling where the target has no
    kernel for a layer's family (DPLR on an H100, anything on an A100), for the model's
    method and for one layer type's, and where the Mosaic GPU kernels would get float32
    inputs."""
    monkeypatch.chdir(ROOT)
    mqar = "--config=configs/mqar.py:smoke"
    model = ["--config.model.mixer=gated,rwkv7", "--config.model.num_layers=2"]
    status, _, err = dry_run_cli(capsys, mqar, H100, "--config.model.options.method=pallas", *model)
    assert status == 2 and "Traceback" not in err
    assert err.startswith(
        "la-train: error: config.model.options.method = 'pallas' (the layers rwkv7): "
        "config.mesh.target = 'gpu:h100:8' is compiled by XLA:GPU, whose Pallas kernels (gpu) "
        "do not cover these layers' kernel families; use method 'chunk'"
    )
    a100 = "--config.mesh.target=gpu:a100:8"
    one = "--config.model.layer_options={'gated': {'method': 'pallas'}}"
    status, _, err = dry_run_cli(capsys, mqar, a100, one, *model)
    assert status == 2 and "(the layers gated): " in err and "which has no Pallas kernels" in err
    status, _, err = dry_run_cli(capsys, mqar, H100, one, *model)
    assert status == 2 and err.startswith(
        "la-train: error: config.model.dtype = 'float32' with method 'pallas': the Mosaic GPU "
        "kernels take bfloat16 or float16 inputs"
    )


@needs_cuda
@pytest.mark.parametrize("mixer", ["gated", pytest.param("gated_deltanet", marks=pytest.mark.slow)])
def test_the_pallas_method_compiles_the_mosaic_gpu_kernel_for_an_h100(capsys, monkeypatch, mixer):
    """A gated (or Gated DeltaNet) layer with method="pallas" (bfloat16) is compiled for an
    H100 with the Mosaic GPU kernels in its program; the same model with "chunk" has none."""
    monkeypatch.chdir(ROOT)
    argv = ["--config=configs/mqar.py:smoke", "--config.mesh.target=gpu:h100:1"]
    argv += [f"--config.model.mixer={mixer}", "--config.model.num_layers=1"]
    argv += ["--config.model.dtype=bfloat16", "--config.model.options.chunk_size=64"]
    calls, real = [], sizing.compile_for_target

    def spy(traced, *args):
        calls.append(traced.lower(lowering_platforms=("cuda",)).as_text().count("mosaic_gpu"))
        return real(traced, *args)

    monkeypatch.setattr(sizing, "compile_for_target", spy)
    for method in ("pallas", "chunk"):
        status, result, err = dry_run_cli(capsys, *argv, f"--config.model.options.method={method}")
        assert status == 0, err
        assert result["fits"] and result["train_step_bytes_per_device"] > 0
    assert calls[0] > 0 and calls[1] == 0


@needs_cuda
def test_the_compile_only_gpus_are_the_chip_and_the_hosts_of_the_target():
    """Every chip of the table describes its GPUs in the installed plugin; a host split gives
    each host's GPUs their process."""
    for chip in CHIPS:
        devices = parse_target(f"gpu:{chip}:2").devices()
        assert [d.device_kind for d in devices] == [CHIPS[chip].name] * 2
    devices = parse_target("gpu:h100:2x8").devices()
    assert [d.process_index for d in devices] == [0] * 8 + [1] * 8
    assert parse_target("gpu:h100:2x8").describe()["hosts"] == 2


@needs_cuda
def test_the_memory_of_a_compiled_program_is_the_arrays_it_holds():
    """Hand-computed case: ``x + 1`` on a float32 [8·2^17, 8] array split over 8 GPUs holds its
    argument and its output, 4 MiB each per GPU; donated, the output reuses the argument.
    Replicated 24 GiB arrays (48 GiB held) fit an H100; 48 GiB ones (96 GiB held) do not,
    though XLA:GPU compiles them."""
    target = parse_target("gpu:h100:8")
    mesh = Mesh(np.asarray(target.devices()), ("d",))

    def traced(shape, spec, donate):
        x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
        return jax.jit(lambda a: a + 1, donate_argnums=(0,) if donate else ()).trace(x)

    split = compile_for_target(traced((8 * 2**17, 8), P("d"), False), target, H100_BYTES)
    assert split.fits and split.memory["arguments"] == split.memory["outputs"] == 4 * 2**20
    assert split.memory["aliases"] == 0 and split.bytes_per_device >= 8 * 2**20
    donated = compile_for_target(traced((8 * 2**17, 8), P("d"), True), target, H100_BYTES)
    assert donated.memory["aliases"] == 4 * 2**20 and donated.bytes_per_device < 8 * 2**20
    fits = compile_for_target(traced((6 * 2**30,), P(), False), target, H100_BYTES)
    assert fits.fits and fits.bytes_per_device >= 48 * GiB
    too_big = compile_for_target(traced((12 * 2**30,), P(), False), target, H100_BYTES)
    assert not too_big.fits and too_big.bytes_per_device >= 96 * GiB > H100_BYTES
    assert too_big.memory["arguments"] == 48 * GiB


@needs_cuda
@pytest.mark.parametrize("preset, mixers", FAMILY_CASES)
def test_every_mixer_family_compiles_for_8_h100s(capsys, monkeypatch, preset, mixers):
    """One layer of each family (linear, decays, delta rule, DPLR, DeltaProduct, softmax,
    sliding window) in one model, compiled by XLA:GPU and ptxas for 8 H100s; the default
    backend stays the CPU's (a GPU target compiles, it runs nothing)."""
    monkeypatch.chdir(ROOT)
    sizing_ = families_dry_run(capsys, preset, mixers, "gpu:h100:8")
    _check_sizing(sizing_)
    print(f"{preset} {mixers}: {sizing_['train_step_bytes_per_device']} bytes per GPU")


# The mixers of the kernel families (and attention kinds) FAMILIES leaves out. At chunks of 16,
# XLA:GPU (jaxlib 0.10.2) cannot tile a [4, 16, 16] dot of the log-linear backward ("Couldn't
# find output tile sizes"); at 64, the preset's chunk, they compile.
OTHER_FAMILIES = "mla,fox,path,lstm,mesanet,log_linear_mamba2,log_linear_gated_deltanet,comba"


def test_the_two_family_lists_cover_every_registered_mixers_kernel_family():
    from linear_attention.layers import MIXERS

    def family(name):
        return getattr(MIXERS[name].FAMILY, "name", name)  # attention kinds: the mixer itself

    listed = ",".join((FAMILIES, OTHER_FAMILIES, RECURRENT_FAMILIES)).split(",")
    assert {family(m) for m in listed} == {family(m) for m in MIXERS}


@needs_cuda
def test_the_other_families_compile_for_8_h100s(capsys, monkeypatch):
    """MLA, FoX, PaTH, the LSTM, MesaNet, both log-linear families and Comba in one LM smoke
    model, compiled by XLA:GPU and ptxas for 8 H100s at chunks of 64."""
    monkeypatch.chdir(ROOT)
    sizing_ = families_dry_run(capsys, "lm.py:smoke", OTHER_FAMILIES, "gpu:h100:8", chunk=64)
    _check_sizing(sizing_)


@needs_cuda
@pytest.mark.slow
def test_the_recurrent_blocks_compile_for_8_h100s(capsys, monkeypatch):
    """Mamba-1's block and Griffin's recurrent block (the selective scan and the RG-LRU, each
    a `lax.scan` over time) in one LM smoke model, compiled by XLA:GPU and ptxas for 8 H100s
    (20 s on a loaded 2-core CPU: under -m slow)."""
    monkeypatch.chdir(ROOT)
    status, sizing_, err = dry_run_cli(
        capsys,
        "--config=configs/lm.py:smoke",
        "--config.mesh.target=gpu:h100:8",
        f"--config.model.mixer={RECURRENT_FAMILIES}",
        "--config.model.num_layers=2",
    )
    assert status == 0, err
    _check_sizing(sizing_)


@needs_cuda
def test_the_step_split_over_time_and_fsdp_compiles_for_two_h200_hosts(capsys, monkeypatch):
    """2 hosts of 4 H200s, time split over 2 of them (shard_map), FSDP over the 4 data devices,
    2 micro-batches, remat=block: the state on a GPU is between a quarter of the replicated
    float32 parameters and AdamW moments and all of them."""
    monkeypatch.chdir(ROOT)
    argv = ["--config=configs/lm.py:smoke", "--config.mesh.target=gpu:h200:2x4"]
    argv += ["--config.mesh.seq=2", "--config.mesh.fsdp=True", "--config.model.remat=block"]
    argv += ["--config.train.grad_accum_steps=2", "--config.model.options.chunk_size=16"]
    status, sizing_, err = dry_run_cli(capsys, *argv)
    assert status == 0, err
    assert sizing_["target"]["mesh"] == {"data": 4, "seq": 2, "model": 1}
    assert (sizing_["target"]["hosts"], sizing_["target"]["devices"]) == (2, 8)
    assert sizing_["hbm_bytes_per_device"] == CHIPS["h200"].device_memory_size
    state = 3 * 4 * sizing_["parameters"]
    assert state / 4 <= sizing_["memory"]["arguments"] < state
    assert sizing_["fits"] is True


@needs_cuda
def test_a_step_that_cannot_fit_a_gpu_exits_1_with_what_it_needs(capsys, monkeypatch):
    """2^22 rows of 32 tokens on one H100: 2^22 · 32 · 256 float32 logits (128 GiB) alone are
    more than its 79.11 GiB. XLA:GPU compiles the step anyway; the dry run holds it to the
    GPU's memory."""
    monkeypatch.chdir(ROOT)
    status, sizing_, err = dry_run_cli(
        capsys,
        "--config=configs/lm.py:smoke",
        "--config.mesh.target=gpu:h100:1",
        f"--config.train.batch_size={2**22}",
    )
    assert status == 1
    assert sizing_["fits"] is False and sizing_["memory"] is not None
    logits = 2**22 * 32 * 256 * 4
    assert sizing_["train_step_bytes_per_device"] > logits > sizing_["hbm_bytes_per_device"]
    need = sizing_["train_step_bytes_per_device"] / GiB
    assert err.splitlines()[-1] == (
        "la-train: the train step does not fit gpu:h100:1 (1 x NVIDIA H100 80GB HBM3): it needs "
        f"{need:.2f} GiB per device and a device has 79.11 GiB (XLA:GPU's figures); --fit "
        "searches a setting that fits"
    )


@pytest.mark.slow  # three compiles; the search is the TPU target's, tested there
@needs_cuda
def test_fit_on_gpus_finds_the_first_setting_that_fits(capsys, monkeypatch):
    """d 256 (1.19M parameters: 13.6 MiB of float32 parameters and AdamW moments on each GPU
    when replicated) held to 16 MiB a GPU on 4 H100s: as given (remat=block) and with 2
    micro-batches it does not fit; FSDP (a quarter of the state per GPU) does."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(
        cli, "dry_run_sizing", functools.partial(sizing.dry_run, hbm_limit=16 * 2**20)
    )
    argv = ["--config=configs/lm.py:smoke", "--config.mesh.target=gpu:h100:4"]
    argv += ["--config.model.d_model=256", "--config.model.remat=block", "--dry_run", "--fit"]
    status = cli.main(["la-train", *argv])
    out, err = capsys.readouterr()
    assert status == 0, err
    *_, found, last = out.strip().splitlines()
    sizing_ = json.loads(last)
    assert found == "fits gpu:h100:4 with: --config.mesh.fsdp=True"
    tries = [(t["grad_accum_steps"], t["fsdp"], t["fits"]) for t in sizing_["fit"]["tries"]]
    assert tries == [(1, False, False), (2, False, False), (1, True, True)]
    assert sizing_["hbm_bytes_per_device"] == 16 * 2**20
    assert sizing_["train_step_bytes_per_device"] <= 16 * 2**20
    assert 3 * 4 * sizing_["parameters"] / 4 <= sizing_["memory"]["arguments"]
    assert sizing_["memory"]["arguments"] < 3 * 4 * sizing_["parameters"]  # split over 4


LM = load_module("configs/lm.py", "configs_lm_gpu")
PAPER = tuple(LM.PAPER_SIZES)
# The smallest preset (341.1M parameters): compiled in the default run (gla_340m, 367.1M, and the
# rest under -m slow; every family compiles for 8 H100s in the default run above).
SMALLEST = ("transformer_340m",)


def _h100_config(preset: str):
    """The preset with its stated H100 setting (``<preset>@h100``)."""
    return load_config("lm", f"{preset}@h100")


@pytest.mark.parametrize("preset", PAPER)
def test_a_paper_preset_states_its_smallest_h100_count_and_setting(preset):
    """configs/lm.py's docstring names, for each paper preset, the H100 count and setting
    that ``<preset>@h100`` applies."""
    config = _h100_config(preset)
    count = int(re.fullmatch(r"gpu:h100:([0-9]+)", config.mesh.target).group(1))
    setting = (
        f"``{preset}``: {count} H100 with remat={config.model.remat}, "
        f"grad_accum_steps={config.train.grad_accum_steps}"
    )
    assert setting in " ".join(LM.__doc__.split())
    assert config.data.seq_len == load_config("lm", preset).data.seq_len  # the model is as given


@needs_cuda
@pytest.mark.parametrize(
    "preset",
    [p if p in SMALLEST else pytest.param(p, marks=pytest.mark.slow) for p in PAPER],
)
def test_every_paper_preset_fits_its_stated_h100s(capsys, monkeypatch, preset):
    """The stated setting compiles for the stated H100 count and fits (the two smallest in the
    default run; every preset under ``-m slow``)."""
    monkeypatch.chdir(ROOT)
    config = _h100_config(preset)
    status, sizing_, err = dry_run_cli(capsys, f"--config=configs/lm.py:{preset}@h100")
    assert status == 0, err
    assert sizing_["target"]["name"] == config.mesh.target and sizing_["fits"] is True
    assert sizing_["train_step_bytes_per_device"] <= H100_BYTES
