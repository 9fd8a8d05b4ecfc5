"""The NVIDIA GPUs a dry run can compile for (``gpu:<chip>:...``), as the hardware facts XLA:GPU
needs to compile without the GPU, rendered to the ``GpuTargetConfig`` protobuf text that
`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)` reads.

Sources. The facts of a compute capability (`ARCHITECTURES`) are the limits of CUDA's
"Technical Specifications per Compute Capability" table (CUDA C++ Programming Guide): threads
per block and per SM, shared memory per block (static, and the opt-in maximum) and per SM,
registers, grid and block dimensions; the FP32 cores per SM are from NVIDIA's architecture
whitepapers (A100: GA100; H100/H200: GH100; B200: Blackwell). The facts of a chip (`CHIPS`) are
from its NVIDIA datasheet (SM count, memory bandwidth, L2 cache, boost clock) and from CUDA's
device properties on the chip (``cudaDeviceProp``: ``name``, ``totalGlobalMem``, the bytes of
memory a program can be given, less than the marketed GB), which XLA's own target configs for
these chips (openxla/xla, ``xla/backends/gpu/target_config/specs/``) record alike.

What is left out, against XLA's configs for the same chips: the per-type throughput tables
(``scalar_unit_description``, ``matrix_unit_description``: XLA's cost models use them to
estimate times, and no time is estimated here), ``collective_memory_granularity`` (jaxlib
0.10.2 does not parse it), the driver, runtime, cuDNN and CUB versions, the interconnect's
link count, PCIe bandwidth, ECC and the ``model_str`` summary. The memory figures of a compiled
train step are the same with and without them (BENCHMARKS.md "XLA:GPU's bytes per GPU").
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Architecture:
    """The limits CUDA states for one compute capability."""

    major: int
    minor: int
    accelerated: bool  # the arch-specific "a" features (sm_90a, sm_100a): wgmma, TMA, ...
    shared_memory_per_core: int  # bytes per SM
    shared_memory_per_block_optin: int  # bytes a block may ask for
    fpus_per_core: int  # FP32 cores per SM
    threads_per_block_limit: int = 1024
    threads_per_warp: int = 32
    shared_memory_per_block: int = 48 * 2**10  # without opting in
    threads_per_core_limit: int = 2048
    registers_per_core_limit: int = 64 * 2**10
    registers_per_block_limit: int = 64 * 2**10
    block_dim_limit: tuple[int, int, int] = (2**31 - 1, 65535, 65535)  # grid size
    thread_dim_limit: tuple[int, int, int] = (1024, 1024, 64)  # block size


ARCHITECTURES = {
    "8.0": Architecture(8, 0, False, 164 * 2**10, 163 * 2**10, 64),  # Ampere GA100
    "9.0": Architecture(9, 0, True, 228 * 2**10, 227 * 2**10, 128),  # Hopper GH100
    "10.0": Architecture(10, 0, True, 228 * 2**10, 227 * 2**10, 128),  # Blackwell B200
}


@dataclasses.dataclass(frozen=True)
class Chip:
    """One GPU product: its compute capability and its datasheet and device-property facts."""

    name: str  # cudaDeviceProp.name (as nvidia-smi lists it): the device kind jax reports
    capability: str  # a key of ARCHITECTURES
    core_count: int  # SMs
    device_memory_size: int  # cudaDeviceProp.totalGlobalMem, bytes
    memory_bandwidth: int  # bytes/s
    l2_cache_size: int  # bytes
    clock_rate_ghz: float  # boost clock of the SMs
    per_host: int = 8  # GPUs one host (an HGX/DGX board) holds

    @property
    def architecture(self) -> Architecture:
        return ARCHITECTURES[self.capability]


# The chip's name in a target -> its facts (the SXM parts). Memory bandwidth: the datasheets
# round it (2.0, 3.35, 4.8 and 8 TB/s); the figures here are the ones XLA's own configs for the
# chips hold, with which the compiled step's memory was checked to be the same (H100). Clock:
# the SMs' boost clock as the driver reports it (cudaDeviceProp.clockRate).
CHIPS = {
    "a100": Chip(
        "NVIDIA A100-SXM4-80GB", "8.0", 108, 85_100_068_864, 2_039 * 10**9, 40 * 2**20, 1.41
    ),
    "h100": Chip(
        "NVIDIA H100 80GB HBM3", "9.0", 132, 84_942_979_072, 3_352 * 10**9, 50 * 2**20, 1.98
    ),
    "h200": Chip("NVIDIA H200", "9.0", 132, 151_397_597_184, 4_800 * 10**9, 50 * 2**20, 1.98),
    "b200": Chip("NVIDIA B200", "10.0", 148, 191_514_411_008, 7_672 * 10**9, 126.5 * 2**20, 1.965),
}


def target_config(chip: Chip) -> str:
    """The chip as ``GpuTargetConfig`` protobuf text (`stream_executor.GpuTargetConfigProto`):
    the fields of `Architecture` and `Chip`, nothing else (see the module docstring)."""
    arch = chip.architecture
    extension = "ACCELERATED_FEATURES" if arch.accelerated else "NONE"
    fields = {
        "threads_per_block_limit": arch.threads_per_block_limit,
        "threads_per_warp": arch.threads_per_warp,
        "shared_memory_per_block": arch.shared_memory_per_block,
        "shared_memory_per_core": arch.shared_memory_per_core,
        "threads_per_core_limit": arch.threads_per_core_limit,
        "core_count": chip.core_count,
        "fpus_per_core": arch.fpus_per_core,
        **{f"block_dim_limit_{a}": n for a, n in zip("xyz", arch.block_dim_limit, strict=True)},
        "memory_bandwidth": chip.memory_bandwidth,
        "l2_cache_size": int(chip.l2_cache_size),
        "clock_rate_ghz": chip.clock_rate_ghz,
        "device_memory_size": chip.device_memory_size,
        "shared_memory_per_block_optin": arch.shared_memory_per_block_optin,
        "cuda_compute_capability": (
            f"{{ major: {arch.major} minor: {arch.minor} feature_extension: {extension} }}"
        ),
        "registers_per_core_limit": arch.registers_per_core_limit,
        "registers_per_block_limit": arch.registers_per_block_limit,
        **{f"thread_dim_limit_{a}": n for a, n in zip("xyz", arch.thread_dim_limit, strict=True)},
        "device_vendor": '"NVIDIA Corporation"',
        "name": f'"{chip.name}"',
    }
    info = "\n".join(
        f"  {k} {v}" if str(v).startswith("{") else f"  {k}: {v}" for k, v in fields.items()
    )
    return (
        f'gpu_device_info {{\n{info}\n}}\nplatform_name: "CUDA"\n'
        f'device_description_str: "{chip.name}"\n'
    )
