"""Compiler figures of the Pallas kernels against the XLA chunk form, for a TPU, on any machine.

For each kernel (`causal_linear_attention` and, with `--kernels`, `delta_rule`,
`dplr_delta_rule`, `delta_product`; `method="pallas"` and `method="chunk"`, each decay kind) and
each length T, the program is compiled for a TPU topology through libtpu (no TPU needed) and the
compiler's own figures are recorded: `memory_analysis()` (temporaries, arguments, outputs and
the peak, per chip) and `cost_analysis()` (FLOPs, bytes accessed). These are compiler figures,
not times. Two programs: "forward" (the outputs) and "train" (the outputs and the gradients of a
loss on them with respect to q, k, v, the kernel's other inputs (β; DPLR's a, b) and the log
decay).

    python experiments/pallas_compile.py --topology v5e:2x2 \
        --out docs/results/pallas_compile_v5e.json

`--reuse OLD.json` keeps every row of an earlier file of the same topology that this run does
not compile (a row from another file names that file and its date), so `--methods pallas`
recompiles only the Pallas programs and `--lengths 16384,65536` adds lengths to a file. Each
compiled row names the commit it was compiled at.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402

from linear_attention import kernels as K  # noqa: E402
from linear_attention.kernels.primitives.pallas import pallas_mosaic  # noqa: E402
from linear_attention.training.machine import library_commit  # noqa: E402

DECAYS = ("none", "per_token", "per_key")
METHODS = ("pallas", "chunk")
KERNELS = ("causal_linear_attention", "delta_rule", "dplr_delta_rule", "delta_product")


def arrays(kernel, B, T, H, M, spec):
    """q, k, v and the kernel's other inputs (a tuple; all differentiated in "train"), bfloat16:
    DeltaProduct with n = 2 steps per token."""
    match kernel:
        case "causal_linear_attention":
            return [spec((B, T, H, M))] * 3, ()
        case "delta_rule":  # β
            return [spec((B, T, H, M))] * 3, (spec((B, T, H)),)
        case "dplr_delta_rule":  # a, b
            return [spec((B, T, H, M))] * 3, (spec((B, T, H, M)), spec((B, T, H, M)))
        case "delta_product":  # k, v with n = 2 steps; β
            qkv = [spec((B, T, H, M)), spec((B, T, H, 2, M)), spec((B, T, H, 2, M))]
            return qkv, (spec((B, T, H, 2)),)
        case _:
            raise ValueError(f"unknown kernel {kernel!r}; allowed: {', '.join(KERNELS)}")


def call(kernel, q, k, v, extra, **options):
    match kernel:
        case "causal_linear_attention":
            return K.causal_linear_attention(q, k, v, **options)
        case "delta_rule":
            return K.delta_rule(q, k, v, *extra, **options)
        case "dplr_delta_rule":
            return K.dplr_delta_rule(q, k, v, *extra, **options)
        case "delta_product":
            return K.delta_product(q, k, v, *extra, **options)
        case _:
            raise ValueError(f"unknown kernel {kernel!r}; allowed: {', '.join(KERNELS)}")


def compile_one(topology, kernel, method, decay, T, mode, *, B=1, H=4, M=128, chunk_size=64):
    sharding = jax.sharding.SingleDeviceSharding(topology.devices[0])

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    decay_shape = {"none": None, "per_token": (B, T, H), "per_key": (B, T, H, M)}[decay]
    a = None if decay_shape is None else spec(decay_shape, jnp.float32)

    def forward(q, k, v, extra, a):
        options = dict(log_decay=a, method=method, chunk_size=chunk_size)
        return call(kernel, q, k, v, extra, **options)

    def train(q, k, v, extra, a):
        def loss(q, k, v, extra, a):
            o = forward(q, k, v, extra, a)
            return jnp.sum(o.astype(jnp.float32) ** 2), o

        argnums = (0, 1, 2, 3) + (() if a is None else (4,))
        return jax.grad(loss, argnums=argnums, has_aux=True)(q, k, v, extra, a)

    fn = forward if mode == "forward" else train
    qkv, extra = arrays(kernel, B, T, H, M, spec)
    start = time.perf_counter()
    with pallas_mosaic():
        lowered = jax.jit(fn).trace(*qkv, extra, a).lower(lowering_platforms=("tpu",))
    compiled = lowered.compile()
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    return {
        "kernel": kernel,
        "method": method,
        "decay": decay,
        "T": T,
        "mode": mode,
        "temp_bytes": memory.temp_size_in_bytes,
        "peak_bytes": memory.peak_memory_in_bytes,
        "argument_bytes": memory.argument_size_in_bytes,
        "output_bytes": memory.output_size_in_bytes,
        "flops": cost.get("flops"),
        "bytes_accessed": cost.get("bytes accessed"),
        "compile_s": round(time.perf_counter() - start, 1),
    }


def table(rows) -> str:
    """Markdown: per kernel, T, program and decay kind, the Pallas and chunk figures side by side
    (MiB of temporaries / peak; FLOPs in G and bytes accessed in MiB as counted)."""
    MiB = 2**20
    order = {name: i for i, name in enumerate(KERNELS + ("forward", "train") + DECAYS)}
    by = {
        (r.get("kernel", "causal_linear_attention"), r["T"], r["mode"], r["decay"], r["method"]): r
        for r in sorted(
            rows,
            key=lambda r: (
                order[r.get("kernel", "causal_linear_attention")],
                r["T"],
                order[r["mode"]],
                order[r["decay"]],
            ),
        )
    }
    lines = [
        "| kernel | T | program | decay | temp MiB pallas / chunk | peak MiB pallas / chunk "
        "| arguments MiB | FLOPs G pallas / chunk | bytes MiB pallas / chunk |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for kernel, T, mode, decay, method in by:
        if method != "pallas" or (kernel, T, mode, decay, "chunk") not in by:
            continue
        p, c = by[kernel, T, mode, decay, "pallas"], by[kernel, T, mode, decay, "chunk"]

        def pair(key, unit, p=p, c=c):
            return f"{p[key] / unit:.1f} / {c[key] / unit:.1f}"

        lines.append(
            f"| {kernel} | {T} | {mode} | {decay} | {pair('temp_bytes', MiB)} | "
            f"{pair('peak_bytes', MiB)} | {p['argument_bytes'] / MiB:.1f} | "
            f"{pair('flops', 1e9)} | {pair('bytes_accessed', MiB)} |"
        )
    return "\n".join(lines)


def key(row):
    return (
        row.get("kernel", "causal_linear_attention"),
        row["method"],
        row["decay"],
        row["T"],
        row["mode"],
    )


def reused(path, topology, rows, same_file):
    """The rows of `path` (same topology) that `rows` does not compile again, and the earlier
    file's runs. Taken from another file, each row names that file and its date; a row of the
    file being rewritten (`same_file`) stays as it is."""
    with open(path) as f:
        old = json.load(f)
    if old["topology"] != topology:
        raise ValueError(f"--reuse {path}: topology {old['topology']!r}, not {topology!r}")
    compiled = {key(r) for r in rows}
    kept = []
    for r in old["rows"]:
        if key(r) in compiled:
            continue
        if same_file:
            kept.append({**r, "kernel": key(r)[0]})
            continue
        source = r.get("reused_from", f"{path} ({old['date_utc']} UTC)")  # where it was compiled
        kept.append({**r, "kernel": key(r)[0], "reused_from": source})
    runs = old.get("runs", [{"date_utc": old["date_utc"], "load_avg": old["load_avg"]}])
    return kept, runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="v5e:2x2", help="a libtpu topology, e.g. v6e:2x2")
    parser.add_argument("--lengths", default="4096,16384,65536")
    parser.add_argument("--modes", default="forward,train")
    parser.add_argument(
        "--kernels", default="causal_linear_attention", help=f"some of {','.join(KERNELS)}"
    )
    parser.add_argument("--decays", default=",".join(DECAYS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--reuse", help="earlier JSON whose rows not compiled again to keep")
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument(
        "--table", nargs="+", help="print the markdown table of these JSON files and stop"
    )
    args = parser.parse_args()
    if args.table:
        rows = []
        for path in args.table:
            with open(path) as f:
                rows += json.load(f)["rows"]
        print(table(rows))
        return
    if not args.out:
        parser.error("--out is required (unless --table)")
    if args.reuse:  # its topology checked before any compile
        reused(args.reuse, args.topology, [], False)
    topology = topologies.get_topology_desc(topology_name=args.topology, platform="tpu")
    methods = args.methods.split(",")
    at = library_commit()
    rows = []
    for kernel in args.kernels.split(","):
        for T in (int(x) for x in args.lengths.split(",")):
            for mode in args.modes.split(","):
                for decay in args.decays.split(","):
                    for method in methods:
                        row = compile_one(topology, kernel, method, decay, T, mode)
                        row["commit"] = at
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    runs = []
    if args.reuse:
        same_file = os.path.abspath(args.reuse) == os.path.abspath(args.out)
        kept, runs = reused(args.reuse, args.topology, rows, same_file)
        rows += kept
    date = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    run = {
        "kernels": args.kernels,
        "lengths": args.lengths,
        "modes": args.modes,
        "decays": args.decays,
        "methods": args.methods,
        "commit": at,
        "date_utc": date,
        "load_avg": os.getloadavg(),
    }
    result = {
        "what": "compiler figures (memory_analysis, cost_analysis) per chip, not times",
        "topology": args.topology,
        "shape": {"B": 1, "H": 4, "K": 128, "V": 128, "dtype": "bfloat16", "chunk_size": 64},
        "jax": jax.__version__,
        "machine": platform.node(),
        "load_avg": os.getloadavg(),
        "date_utc": date,
        "runs": runs + [run],
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(table(rows))


if __name__ == "__main__":
    main()
