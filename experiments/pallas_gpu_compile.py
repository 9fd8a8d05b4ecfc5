"""Compiler figures of the Mosaic GPU (Hopper) kernels against the XLA chunk form, for an H100,
on any machine (the CUDA plugin's compile-only device; no GPU needed).

For `causal_linear_attention` and `delta_rule` with `method="pallas"` (the Mosaic GPU kernels,
emitted under `pallas_lowering("gpu")`) and `method="chunk"`, each decay kind (and, for linear
attention, normalisation) and each length T, the program is compiled by XLA:GPU for sm_90a, and
the compiler's own figures are recorded: `memory_analysis()` (temporaries, arguments, outputs,
per GPU) and the compile time (lowering included: Mosaic GPU compiles the kernel as it lowers).
These are compiler figures, not times. Two programs: "forward" (the outputs) and "train" (the
outputs and the gradients of a loss on them with respect to q, k, v, β and the log decay).
B = 1, H = 4, K = V = 128, bfloat16, chunk 64.

    JAX_PLATFORMS=cpu python experiments/pallas_gpu_compile.py \
        --out docs/results/pallas_gpu_compile_h100.json
    python experiments/pallas_gpu_compile.py --table docs/results/pallas_gpu_compile_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from linear_attention import kernels as K  # noqa: E402
from linear_attention.training import gpu_target  # noqa: E402
from linear_attention.training.machine import library_commit  # noqa: E402

METHODS = ("pallas", "chunk")
KERNELS = ("linear", "delta_rule")
# (kernel, decay, normalize). Linear attention: a decay per token and head, unnormalised
# (Mamba-2, simple GLA) and normalised; no decay, normalised (plain linear attention); a decay
# per key channel, unnormalised (GLA). The delta rule: none (DeltaNet), per token (Gated
# DeltaNet), per key channel (KDA).
CONFIGS = (
    ("linear", "per_token", False),
    ("linear", "per_token", True),
    ("linear", "none", True),
    ("linear", "per_key", False),
    ("delta_rule", "none", False),
    ("delta_rule", "per_token", False),
    ("delta_rule", "per_key", False),
)


def compile_one(
    device, method, decay, normalize, T, mode, *, kernel="linear", B=1, H=4, M=128, chunk_size=64
):
    sharding = jax.sharding.SingleDeviceSharding(device)

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    a = {
        "none": None,
        "per_token": spec((B, T, H), jnp.float32),
        "per_key": spec((B, T, H, M), jnp.float32),
    }[decay]
    inputs = [spec((B, T, H, M))] * 3
    if kernel == "delta_rule":
        inputs.append(spec((B, T, H), jnp.float32))  # β

        def forward(q, k, v, beta, a):
            return K.delta_rule(q, k, v, beta, log_decay=a, method=method, chunk_size=chunk_size)

    else:

        def forward(q, k, v, a):
            return K.causal_linear_attention(
                q, k, v, log_decay=a, normalize=normalize, method=method, chunk_size=chunk_size
            )

    def train(*args):
        def loss(*args):
            o = forward(*args)
            return jnp.sum(o.astype(jnp.float32) ** 2), o

        argnums = tuple(range(len(args) - (a is None)))
        return jax.grad(loss, argnums=argnums, has_aux=True)(*args)

    fn = forward if mode == "forward" else train
    start = time.perf_counter()
    with K.pallas_lowering("gpu"):
        traced = jax.jit(fn).trace(*inputs, a)
    lowered = traced.lower(lowering_platforms=("cuda",))
    kernels = lowered.as_text().count("@mosaic_gpu")
    compiled = lowered.compile()
    memory = compiled.memory_analysis()
    return {
        "kernel": kernel,
        "method": method,
        "decay": decay,
        "normalize": normalize,
        "T": T,
        "mode": mode,
        "mosaic_gpu_calls": kernels,
        "temp_bytes": memory.temp_size_in_bytes,
        "argument_bytes": memory.argument_size_in_bytes,
        "output_bytes": memory.output_size_in_bytes,
        "compile_s": round(time.perf_counter() - start, 1),
    }


def _key(r, method=None):
    # rows made before the delta rule was measured have no "kernel": linear attention's
    kernel = r.get("kernel", "linear")
    return (r["T"], r["mode"], kernel, r["decay"], r["normalize"], method or r["method"])


def table(rows) -> str:
    """Markdown: per T, program and configuration, the Mosaic GPU and chunk figures side by side
    (MiB of temporaries; compile seconds)."""
    MiB = 2**20
    by = {_key(r): r for r in rows}
    lines = [
        "| T | program | kernel | decay | normalize | temp MiB pallas / chunk "
        "| compile s pallas / chunk |",
        "|---:|---|---|---|---|---:|---:|",
    ]
    for T in sorted({r["T"] for r in rows}):
        for mode in ("forward", "train"):
            for kernel, decay, normalize in CONFIGS:
                p = by.get((T, mode, kernel, decay, normalize, "pallas"))
                c = by.get((T, mode, kernel, decay, normalize, "chunk"))
                if p is None or c is None:
                    continue
                lines.append(
                    f"| {T:,} | {mode} | {kernel} | {decay} | {normalize} "
                    f"| {p['temp_bytes'] / MiB:,.1f} / {c['temp_bytes'] / MiB:,.1f} "
                    f"| {p['compile_s']} / {c['compile_s']} |"
                )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="4096,16384,65536")
    parser.add_argument("--decays", default="per_token,none,per_key", help="which CONFIGS")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="which CONFIGS")
    parser.add_argument("--modes", default="forward,train")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--reuse", help="keep this JSON file's rows that the run does not make")
    parser.add_argument("--out", help="write the rows here as JSON")
    parser.add_argument("--table", nargs="*", help="print the table of these JSON files")
    args = parser.parse_args(argv)
    if args.table:
        rows = [r for path in args.table for r in json.load(open(path))["rows"]]
        print(table(rows))
        return
    target = gpu_target.match_gpu("gpu:h100:1")
    device = gpu_target.topology_devices(target)[0]
    decays, kernels = args.decays.split(","), args.kernels.split(",")
    rows = []
    for T in (int(x) for x in args.lengths.split(",")):
        for mode in args.modes.split(","):
            for kernel, decay, normalize in CONFIGS:
                if decay not in decays or kernel not in kernels:
                    continue
                for method in args.methods.split(","):
                    row = compile_one(device, method, decay, normalize, T, mode, kernel=kernel)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    if args.reuse:
        made = {_key(r) for r in rows}
        rows = [r for r in json.load(open(args.reuse))["rows"] if _key(r) not in made] + rows
    result = {
        "target": "gpu:h100:1 (sm_90a, compile-only)",
        "versions": gpu_target.versions(),
        "commit": library_commit(),
        "machine": platform.machine(),
        "rows": rows,
    }
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
