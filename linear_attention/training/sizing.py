"""Sizing a run before launching it: parameters, FLOPs per token and the compiled train step's
memory per device, from abstract shapes only (nothing is allocated, no data is read).

`dry_run(config)` builds the model and optimizer with `nnx.eval_shape`, lowers the real
`train_step` (the same function the loop runs: accumulation, remat, sharding, donation) on
`jax.ShapeDtypeStruct`s placed on the configured mesh, compiles it, and reads XLA's
`memory_analysis()`. The bytes per device are what the compiled step holds at its peak:
arguments + outputs − the outputs that reuse donated arguments (the state) + temporaries.

Without ``config.mesh.target`` the mesh is that of `config.mesh` over the visible devices; to
size an N-device job on a laptop, make N host devices visible:
``XLA_FLAGS=--xla_force_host_platform_device_count=N``. Those figures are XLA's for this
machine's backend: another backend fuses and schedules differently (the same order).

With ``config.mesh.target`` set (`training.targets`: ``"tpu:<gen>:<topology>"`` or
``"gpu:<chip>:<count>"``) the mesh is laid over the target's compile-only devices and its
compiler compiles the step on any machine that has it (XLA:TPU from libtpu, XLA:GPU from jax's
CUDA plugin): the result adds the target, the memory a device has (``hbm_bytes_per_device``,
its source), whether the step ``fits`` and the `memory_analysis()` parts. XLA:TPU refuses a
step that does not fit and then gives only its needed total (no parts); XLA:GPU compiles any
step, which fits where its peak bytes are at most the GPU's memory.

`dry_run(config, fit=True)` searches for a setting that fits the target (`FIT_ORDER`), never
changing the global batch, the sequence or the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention.kernels.primitives.pallas import pallas_lowering
from linear_attention.training.config import ExperimentConfig, experiment_config
from linear_attention.training.flops import flops_per_token
from linear_attention.training.mesh import (
    batch_devices,
    batch_sharding,
    check_train_batches,
    make_mesh,
    state_shardings,
)
from linear_attention.training.optim import make_optimizer
from linear_attention.training.target_base import (
    Compiled,
    Target,
    compile_for_target,
    memory_parts,
    step_bytes,
)
from linear_attention.training.targets import parse_target
from linear_attention.training.trainer import build_model, train_step

GiB = 2**30


def size(n: int) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.2f} MiB"


# Remat policies from the least memory saved to the most (`ModelConfig.remat`).
REMAT_ORDER = ("none", "dots", "dots_no_batch", "block")  # every one of `REMAT`
FIT_ORDER = """\
The fit search compiles the train step for the target, one setting at a time, and stops at the
first that fits. First the setting as given. Then, in stages, each on top of the last stage's
strongest setting:
  1. remat: the policies that save more than the given one, in the order dots, dots_no_batch,
     block (model.remat);
  2. grad_accum_steps: the given value times 2, 4, 8, ... while each micro-batch still splits
     evenly over the devices (train.grad_accum_steps; the global batch is unchanged);
  3. FSDP (mesh.fsdp=True; parameters and optimizer state split over the devices), then
     stages 1 and 2 again with it.
A stage's strongest setting (block; the most micro-batches) is compiled first: memory only
falls along a stage, so where it does not fit the stage is skipped; where it fits, the weaker
settings are searched for the first that fits (remat: in order; grad_accum_steps: by halving
the interval, a compile per halving)."""


def abstract_batch(cfg, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes and dtypes of a training batch (int32 ``inputs``, ``labels`` and, for packed
    text and token files, ``segment_ids``), rows split over the mesh's ``data`` axis."""
    shape, sharding = (cfg.train.batch_size, cfg.data.seq_len), batch_sharding(mesh)
    names = ["inputs", "labels"]
    if cfg.data.packed:
        names.append("segment_ids")
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding) for k in names}


def trace_train_step(cfg, mesh):
    """The real `train_step` traced on abstract shapes: the model and optimizer state placed
    as the loop places them (replicated or FSDP) and a batch split over ``data``."""
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.num_steps)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg, tx)))
    shardings = state_shardings(state, mesh, cfg.mesh.fsdp)
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )
    return train_step.trace(
        state,
        abstract_batch(cfg, mesh),
        graphdef=graphdef,
        mesh=mesh,
        fsdp=cfg.mesh.fsdp,
        accum=cfg.train.grad_accum_steps,
        loss_chunks=cfg.loss_chunks,
    )


def train_step_bytes(cfg, mesh) -> int:
    """Bytes per device of the train step compiled for this machine's backend."""
    return step_bytes(memory_parts(trace_train_step(cfg, mesh).lower().compile()))


def abstract_model(cfg):
    """The `LanguageModel` of an `ExperimentConfig` as abstract shapes (nothing allocated).
    Its initialisation is lowered too (not run): shapes alone pass where an initialiser has no
    kernel for the parameter dtype, and the run would then fail to build what was sized."""
    build = lambda: build_model(cfg, make_optimizer(cfg.optimizer, 1)[0])[0]  # noqa: E731
    try:
        jax.jit(lambda: nnx.state(build())).lower()
    except Exception as e:  # noqa: BLE001 (XLA's own error names the operation)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"the model cannot be built with config.model.param_dtype = "
            f"{cfg.model.param_dtype!r}: {first}"
        ) from None
    return nnx.eval_shape(build)


def dry_run(
    config,
    *,
    fit: bool = False,
    log: Callable[[str], None] | None = None,
    hbm_limit: int | None = None,
) -> dict:
    """``{"parameters", "flops_per_token", "train_step_bytes_per_device"}`` of the run that
    ``config`` (a ConfigDict or `ExperimentConfig`) describes; with ``config.mesh.target``
    also ``target``, ``hbm_bytes_per_device``, ``hbm_source``, ``fits``, ``memory`` (the
    parts; None where the compiler refused the step), ``compile_s`` and ``versions``. With
    ``fit`` (needs a target): the first setting in `FIT_ORDER` that fits, its sizing and
    ``fit: {"overrides", "tries"}``; ``log`` gets a line per try. ``hbm_limit`` (bytes per
    device, whole MiB, at most the chip's) holds the compiler to less than the chip has, to
    leave room (it becomes ``hbm_bytes_per_device``). Bad settings (a bad target,
    a batch the devices do not divide, method="pallas" for a GPU target) raise `ValueError`; a
    compiler error other than memory `target_base.TargetCompileError`."""
    cfg = experiment_config(config)
    target = parse_target(cfg.mesh.target)
    if fit and target is None:
        raise ValueError("--fit searches a setting that fits config.mesh.target, which is ''")
    if target is not None:
        check_pallas_target(cfg, target)
    devices = None if target is None else target.devices()
    mesh = make_mesh(cfg.mesh.num_devices, cfg.mesh.seq, devices, cfg.mesh.model, cfg.mesh.expert)
    check_train_batches(cfg.train, mesh)
    model = abstract_model(cfg)
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    result = {"parameters": params, "flops_per_token": flops_per_token(model, cfg.data.seq_len)}
    result["flops_per_token"] = result["flops_per_token"]["total"]
    if target is None:
        result["train_step_bytes_per_device"] = train_step_bytes(cfg, mesh)
        return result
    chip, source = target.memory()
    hbm = chip
    if hbm_limit is not None:
        if not 0 < hbm_limit <= chip or hbm_limit % 2**20:
            raise ValueError(
                f"hbm_limit = {hbm_limit} must be a whole number of MiB in (0, {chip}] bytes "
                f"(a {target.device_kind} device's)"
            )
        hbm, source = hbm_limit, f"hbm_limit, below the {chip} bytes of the {source}"
    result["target"] = {**target.describe(), "mesh": dict(mesh.shape)}
    result["hbm_bytes_per_device"] = hbm
    result["hbm_source"] = source
    result["versions"] = target.versions()

    def compile_one(c: ExperimentConfig) -> Compiled:
        # method="pallas": the target's Pallas kernels, lowered whatever this backend is
        lowering = pallas_lowering(target.pallas_backend) if target.pallas_backend else None
        with lowering or contextlib.nullcontext():
            traced = trace_train_step(
                c, make_mesh(c.mesh.num_devices, c.mesh.seq, devices, c.mesh.model, c.mesh.expert)
            )
        return compile_for_target(traced, target, chip, hbm_limit)

    if not fit:
        return {**result, **_compiled_fields(compile_one(cfg))}
    chosen, tries = _fit_search(cfg, batch_devices(mesh), compile_one, hbm, log or _quiet)
    overrides = None if chosen is None else overrides_of(cfg, chosen[0])
    shown = chosen or min(tries.values(), key=lambda t: t[1].bytes_per_device or 0)
    return {
        **result,
        **_compiled_fields(shown[1]),
        "fit": {
            "overrides": overrides,
            "setting": _setting(shown[0]),
            "tries": [{**_setting(c), **_try_fields(r)} for c, r in tries.values()],
        },
    }


def check_pallas_target(cfg: ExperimentConfig, target: Target) -> None:
    """`ValueError` where a layer runs method="pallas" and the target has no Pallas kernel for
    it (its family's descriptor names the backends: TPU for every Pallas family, Mosaic GPU on
    Hopper for causal linear attention, the delta rule and DeltaProduct), or where the Mosaic
    GPU kernels would get float32 inputs (their wgmma operands are bfloat16 or float16)."""
    layers = cfg.model.backend_layers
    if not layers:
        return
    backend = target.pallas_backend
    lacking = sorted(n for n, backends in layers.items() if backend not in backends)
    first = cfg.model.mixer_config(lacking[0] if lacking else next(iter(layers)))
    if lacking:
        has = (
            f"whose Pallas kernels ({backend}) do not cover these layers' kernel families"
            if backend
            else "which has no Pallas kernels"
        )
        raise ValueError(
            f"config.model.options.method = {first.method!r} (the layers {', '.join(lacking)}): "
            f"config.mesh.target = {target.name!r} is compiled by {target.compiler}, {has}; "
            f"use method {first.FAMILY.supported[0]!r} (the same recurrence in XLA) there, or "
            "a target with these kernels"
        )
    if backend == "gpu" and cfg.model.compute_dtype == jnp.float32:
        raise ValueError(
            f"config.model.dtype = 'float32' with method {first.method!r}: the Mosaic GPU "
            "kernels take bfloat16 or float16 inputs (their wgmma operands); set "
            "--config.model.dtype=bfloat16, or use method "
            f"{first.FAMILY.supported[0]!r}"
        )


def _quiet(line: str) -> None:
    pass


def _compiled_fields(compiled: Compiled) -> dict:
    fields = {
        "train_step_bytes_per_device": compiled.bytes_per_device,
        "fits": compiled.fits,
        "memory": compiled.memory,
        "compile_s": round(compiled.seconds, 1),
    }
    if compiled.message:
        fields["compiler_message"] = compiled.message
    return fields


def _try_fields(compiled: Compiled) -> dict:
    return {
        "fits": compiled.fits,
        "bytes_per_device": compiled.bytes_per_device,
        "compile_s": round(compiled.seconds, 1),
    }


def _setting(cfg: ExperimentConfig) -> dict:
    return {
        "remat": cfg.model.remat,
        "grad_accum_steps": cfg.train.grad_accum_steps,
        "fsdp": cfg.mesh.fsdp,
    }


def _with(cfg: ExperimentConfig, *, remat=None, accum=None, fsdp=None) -> ExperimentConfig:
    model = cfg.model if remat is None else dataclasses.replace(cfg.model, remat=remat)
    train = cfg.train
    if accum is not None:
        train = dataclasses.replace(cfg.train, grad_accum_steps=accum)
    mesh = cfg.mesh if fsdp is None else dataclasses.replace(cfg.mesh, fsdp=fsdp)
    return dataclasses.replace(cfg, model=model, train=train, mesh=mesh)


def overrides_of(cfg: ExperimentConfig, new: ExperimentConfig) -> list[str]:
    """The command-line overrides that turn ``cfg``'s fit settings into ``new``'s."""
    names = {"remat": "model.remat", "grad_accum_steps": "train.grad_accum_steps"}
    names["fsdp"] = "mesh.fsdp"
    old, want = _setting(cfg), _setting(new)
    return [f"--config.{names[k]}={want[k]}" for k in names if old[k] != want[k]]


def _accumulations(cfg: ExperimentConfig, data: int) -> list[int]:
    """grad_accum_steps above the given one, doubling, while micro-batches split over
    ``data`` devices."""
    batch, accum, found = cfg.train.batch_size, cfg.train.grad_accum_steps, []
    while batch % (accum * 2) == 0 and (batch // (accum * 2)) % data == 0:
        accum *= 2
        found.append(accum)
    return found


def _fit_search(cfg, data: int, compile_one, hbm: int, log):
    """``((setting, compiled) or None, {key: (setting, compiled)} of every try in order)``
    (`FIT_ORDER`)."""
    tries: dict = {}

    def attempt(c: ExperimentConfig) -> bool:
        key = tuple(_setting(c).values())
        if key not in tries:
            result = compile_one(c)
            tries[key] = (c, result)
            shown = " ".join(overrides_of(cfg, c)) or "as given"
            need = result.bytes_per_device
            verdict = "fits" if result.fits else "does not fit"
            log(
                f"try {len(tries)}: {shown}: {verdict}, {size(need)} of {size(hbm)} per device "
                f"({result.seconds:.0f} s)"
            )
        return tries[key][1].fits

    if attempt(cfg):
        return tries[tuple(_setting(cfg).values())], tries
    start = REMAT_ORDER.index(cfg.model.remat)
    fsdps = [cfg.mesh.fsdp] if cfg.mesh.fsdp or data == 1 else [False, True]
    for fsdp in fsdps:
        base = _with(cfg, fsdp=fsdp)
        strongest = _with(base, remat=REMAT_ORDER[-1])
        stages = [
            [_with(base, remat=r) for r in REMAT_ORDER[start:]],
            [_with(strongest, accum=a) for a in _accumulations(cfg, data)],
        ]
        for stage, bisect in zip(stages, (False, True), strict=True):
            if not stage or not attempt(stage[-1]):
                continue
            low, high = -1, len(stage) - 1  # stage[high] fits; stage[: low + 1] do not
            while high - low > 1:
                mid = (low + high) // 2 if bisect else low + 1
                low, high = (low, mid) if attempt(stage[mid]) else (mid, high)
            return tries[tuple(_setting(stage[high]).values())], tries
    return None, tries


def verdict(sizing: dict) -> str | None:
    """The one line for a sizing whose step does not fit its target (None where it fits or
    has no target)."""
    if sizing.get("fits", True):
        return None
    target, hbm = sizing["target"], sizing["hbm_bytes_per_device"]
    need = sizing["train_step_bytes_per_device"]
    where = f"{target['name']} ({target['devices']} x {target['device_kind']})"
    if "fit" in sizing:
        s = sizing["fit"]["setting"]
        return (
            f"no setting tried fits {where}: the smallest needs {size(need)} per device "
            f"(remat={s['remat']}, grad_accum_steps={s['grad_accum_steps']}, fsdp={s['fsdp']}) "
            f"and a device has {size(hbm)}"
        )
    return (
        f"the train step does not fit {where}: it needs {size(need)} per device and a device "
        f"has {size(hbm)} ({target['compiler']}'s figures); --fit searches a setting that fits"
    )
