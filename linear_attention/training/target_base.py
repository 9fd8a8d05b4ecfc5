"""What a compile target (``config.mesh.target``) is, whatever the accelerator: compile-only
devices described without owning them, the memory one of them has, and the compile of a traced
step for them with its `memory_analysis()` per device.

A target is a `Target`: `tpu_target.TpuTarget` (libtpu's XLA:TPU) or `gpu_target.GpuTarget`
(the CUDA plugin's XLA:GPU); `targets.parse_target` reads one from the config. `compile_for_target`
is the one compile: it lowers for the target's platform and reads the memory parts; a target
whose compiler refuses a program too large for the device (XLA:TPU) reads the refusal's figures
(`Target.refusal`); one whose compiler does not (XLA:GPU compiles a program of any size) is held
to its memory here, by the bytes the compiled step holds at its peak (`step_bytes`).
"""

from __future__ import annotations

import abc
import dataclasses
import time
import typing


class TargetCompileError(RuntimeError):
    """The target's compiler refused a program for a reason other than memory."""


class Target(abc.ABC):
    """A parsed ``config.mesh.target``. Subclasses are frozen dataclasses whose first field is
    ``name`` (the target as written)."""

    name: str
    compiler: typing.ClassVar[str]  # "XLA:TPU": named in the messages and the sizing
    platform: typing.ClassVar[str]  # the lowering platform of `jax.stages.Traced.lower`
    # The Pallas kernels that method="pallas" compiles to for this target ("tpu": Mosaic, "gpu":
    # Mosaic GPU), None where it has none (`kernels.pallas_lowering`).
    pallas_backend: typing.ClassVar[str | None]

    @abc.abstractmethod
    def devices(self) -> tuple:
        """The compile-only devices; `ValueError` naming the target where this machine cannot
        describe them (a missing compiler package, a layout the compiler does not know)."""

    def describe(self) -> dict:
        """``{"name", "compiler", "device_kind", "devices", "chips", ...}``: the compile-only
        devices and what `layout` adds for the kind of target."""
        devices = self.devices()
        return {
            "name": self.name,
            "compiler": self.compiler,
            "device_kind": devices[0].device_kind,
            "devices": len(devices),
            **self.layout(devices),
        }

    @abc.abstractmethod
    def layout(self, devices: tuple) -> dict:
        """``{"chips", ...}`` of the target's compile-only `devices`."""

    @abc.abstractmethod
    def memory(self) -> tuple[int, str]:
        """``(bytes, source)``: the memory a program may use on one device, and where that
        figure comes from."""

    @abc.abstractmethod
    def versions(self) -> dict[str, str]:
        """The versions of jax and of the packages that compile for the target."""

    def compiler_options(self, limit: int | None) -> dict:
        """Compiler options holding a program to ``limit`` bytes per device (None: no cap)."""
        return {}

    def refusal(self, message: str) -> tuple[int, str] | None:
        """``(needed bytes per device, the message's line)`` where a compiler error is its
        refusal of a program too large for the device; None for any other error."""
        return None


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One compile for the target: the `memory_analysis()` parts when it compiled, or the
    compiler's out-of-memory figures when it refused the program."""

    fits: bool
    seconds: float
    memory: dict | None = None  # arguments, outputs, aliases, temporaries, generated_code
    needed_bytes: int | None = None  # per device
    message: str = ""  # the compiler's refusal, where it refused

    @property
    def bytes_per_device(self) -> int | None:
        return self.needed_bytes if self.memory is None else step_bytes(self.memory)


def memory_parts(compiled) -> dict[str, int]:
    """The parts of a compiled program's `memory_analysis()` per device, in bytes."""
    m = compiled.memory_analysis()
    return {
        "arguments": int(m.argument_size_in_bytes),
        "outputs": int(m.output_size_in_bytes),
        "aliases": int(m.alias_size_in_bytes),
        "temporaries": int(m.temp_size_in_bytes),
        "generated_code": int(m.generated_code_size_in_bytes),
    }


def step_bytes(parts: dict[str, int]) -> int:
    """What a compiled step holds per device at its peak: arguments + outputs − the outputs
    that reuse donated arguments + temporaries."""
    return parts["arguments"] + parts["outputs"] - parts["aliases"] + parts["temporaries"]


def first_line(error: Exception) -> str:
    """The first non-blank line of an error's message (its type where it has none)."""
    return next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)


def compile_for_target(traced, target: Target, hbm: int, limit: int | None = None) -> Compiled:
    """Compile a traced jit function (`jax.jit(f).trace(...)`, arguments placed on a mesh over
    ``target.devices()``) for the target, whose devices have ``hbm`` bytes. ``limit`` (bytes,
    whole MiB) holds the step to less, leaving the rest free. Does not fit: ``fits=False`` with
    the bytes it needs. Any other compiler error: `TargetCompileError` with its first line."""
    hbm = hbm if limit is None else min(hbm, limit)
    start = time.perf_counter()
    try:
        compiled = traced.lower(lowering_platforms=(target.platform,)).compile(
            compiler_options=target.compiler_options(limit)
        )
    except Exception as e:
        refused = target.refusal(str(e))
        if refused is None:
            raise TargetCompileError(
                f"{target.compiler} could not compile for {target.name}: {first_line(e)}"
            ) from None
        return Compiled(False, time.perf_counter() - start, None, *refused)
    result = Compiled(True, time.perf_counter() - start, memory_parts(compiled))
    if result.bytes_per_device > hbm:  # past the compiler's own check, where it has one
        return dataclasses.replace(result, fits=False)
    return result
