"""flash-linear-attention's Triton kernels, forward + backward, timed by torch on this machine's
GPU: the peer of `accelerator_check.py`'s JAX timings, at the same shapes.

    python experiments/fla_timings.py --out parts/fla.json --T 4096 16384 65536 --B 1 --H 16 \
        --K 128 --V 128 --repeats 5 --deadline <unix time>

A part of `accelerator_check.py`, run there in its own process: it imports torch and never jax
(two CUDA runtimes in one process are a risk the check does not take, and a crash here loses
only this part). The operations and their inputs are those of the check (`OPS`): q, k, v and the
output cotangent in bfloat16 [B, T, H, K|V] (q and k of the delta rules L2-normalised), beta in
bfloat16, log decays in float32 (log-sigmoid / 16: per token [B, T, H] or per key
[B, T, H, K]). A point is the time of one ``o = op(...)``; ``o.backward(do)`` (every input
requires a gradient), measured with CUDA events: one untimed call (Triton compiles and tunes
there), then ``repeats`` timed calls, median and min. Writes one JSON: the versions, the GPU,
and a record per point, or what was skipped and why (fla absent, no CUDA device, out of
memory, the deadline).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

# op -> (fla.ops function, its inputs in order: names from `inputs`)
OPS = {
    "delta_rule": ("chunk_delta_rule", ("q", "k", "v", "beta")),
    "gated_delta_rule": ("chunk_gated_delta_rule", ("q", "k", "v", "g", "beta")),
    "kda": ("chunk_kda", ("q", "k", "v", "g_key", "beta")),
    "simple_gla": ("chunk_simple_gla", ("q", "k", "v", "g")),
    "gla": ("chunk_gla", ("q", "k", "v", "g_key")),
}
NORMALISED = ("delta_rule", "gated_delta_rule", "kda")  # q and k L2-normalised


def first_line(error: BaseException) -> str:
    text = next((line for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {text}"[:300]


def why_not() -> str | None:
    """Why FLA's kernels cannot run here (None: they can)."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention (fla-core) is not installed"
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA device (FLA's Triton kernels need a GPU)"
    return None


def inputs(op: str, B: int, T: int, H: int, K: int, V: int, seed: int = 0) -> dict:
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(seed)

    def normal(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    q, k = normal(B, T, H, K), normal(B, T, H, K)
    if op in NORMALISED:
        q, k = F.normalize(q.float(), dim=-1).bfloat16(), F.normalize(k.float(), dim=-1).bfloat16()
    found = {
        "q": q,
        "k": k,
        "v": normal(B, T, H, V),
        "beta": torch.sigmoid(normal(B, T, H, dtype=torch.float32)).bfloat16(),
        "g": F.logsigmoid(normal(B, T, H, dtype=torch.float32)) / 16,
        "g_key": F.logsigmoid(normal(B, T, H, K, dtype=torch.float32)) / 16,
        "do": normal(B, T, H, V),
    }
    return {name: x.requires_grad_(name != "do") for name, x in found.items()}


def time_point(op: str, B: int, T: int, H: int, K: int, V: int, repeats: int) -> dict:
    import torch

    name, arg_names = OPS[op]
    fn = getattr(importlib.import_module("fla.ops"), name)
    x = inputs(op, B, T, H, K, V)
    kwargs = {("g" if n == "g_key" else n): x[n] for n in arg_names}

    def step():
        for t in kwargs.values():
            t.grad = None
        out = fn(**kwargs)
        o = out[0] if isinstance(out, tuple) else out
        o.backward(x["do"])

    start = time.perf_counter()
    step()  # Triton compiles and autotunes here
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return dict(
        function=f"fla.ops.{name}", first_call_s=first_s, times_s=times,
        median_s=statistics.median(times), min_s=min(times),
        peak_bytes=torch.cuda.max_memory_allocated(),
    )  # fmt: skip


def run(T_list, B, H, K, V, repeats, deadline, save=lambda result: None) -> dict:
    """Every op at every T; ``save(result so far)`` after each point, so that a process killed
    past its deadline keeps what it timed."""
    import importlib.metadata as md

    result = {"shape": dict(B=B, H=H, K=K, V=V, dtype="bfloat16"), "versions": {}}
    for dist in ("torch", "triton", "fla-core", "flash-linear-attention"):
        try:
            result["versions"][dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    reason = why_not()
    if reason:
        result["skipped"] = reason
        return result
    import torch

    result["device"] = dict(
        name=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
        capability=".".join(map(str, torch.cuda.get_device_capability(0))),
    )  # fmt: skip
    records, failed = [], {}
    result["records"] = records
    for T in T_list:
        for op in OPS:
            rec = dict(op=op, method="fla", T=T)
            records.append(rec)
            if time.time() > deadline:
                rec["skipped"] = "the part's time budget is spent"
            elif op in failed:
                rec["skipped"] = f"failed at a smaller T ({failed[op]})"
            if "skipped" in rec:
                continue
            try:
                torch.cuda.reset_peak_memory_stats()
                rec.update(time_point(op, B, T, H, K, V, repeats))
            except Exception as e:  # out of memory, a kernel that does not build: said, not fatal
                rec["error"] = failed[op] = first_line(e)
                torch.cuda.empty_cache()
            save(result)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--T", type=int, nargs="+", required=True)
    for name in ("B", "H", "K", "V", "repeats"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--deadline", type=float, default=float("inf"), help="unix time")
    a = p.parse_args(argv)
    if min(a.T + [a.B, a.H, a.K, a.V, a.repeats]) < 1:
        p.error("--T, --B, --H, --K, --V and --repeats must be positive")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(result):  # whole or not at all: the check may kill this process mid-write
        Path(f"{out}.tmp").write_text(json.dumps(result, indent=1))
        os.replace(f"{out}.tmp", out)

    save(run(a.T, a.B, a.H, a.K, a.V, a.repeats, a.deadline, save))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
