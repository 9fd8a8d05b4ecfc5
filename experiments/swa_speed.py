"""Sliding-window softmax (`K.sliding_window_attention`) against full causal softmax.

    python experiments/swa_speed.py --out runs/swa_speed            # ~3 min on 2 cores

Shape as experiments/benchmark.py (B=1, H=4, d=64, float32), window 64 (the default), T = 1024,
4096, 16384. Methods: `swa` (window 64), `blockwise` (`blockwise_softmax_attention(causal=True)`,
O(T) memory, O(T²) time) and `softmax` (`softmax_attention(causal=True)`, the T×T logits; only
up to T=4096). "fwd" times f(q, k, v), "grad" the gradient of <f, g> w.r.t. q, k, v. Compiled
temporary memory (XLA's `temp_size_in_bytes`) does not depend on the machine's load; times are
medians over interleaved rounds (benchmark.interleaved) and the ratio is the median over rounds
of t_blockwise / t_swa. Writes `results.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from linear_attention import kernels as K

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark import compile_point, interleaved, make_inputs  # noqa: E402
from machine import machine_info  # noqa: E402

WINDOW = 64
METHODS = {
    "swa": lambda q, k, v: K.sliding_window_attention(q, k, v, window=WINDOW),
    "blockwise": lambda q, k, v: K.blockwise_softmax_attention(q, k, v, causal=True),
    "softmax": lambda q, k, v: K.softmax_attention(q, k, v, causal=True),
}
SOFTMAX_MAX_T = 4096  # the T×T float32 logits (and their gradient) beyond that: GiBs


def run(T_list, rounds: int) -> dict:
    records = []
    for T in T_list:
        args = make_inputs(T)["raw"]
        points, memory = {}, {}
        for name, fn in METHODS.items():
            if name == "softmax" and T > SOFTMAX_MAX_T:
                continue
            for mode in ("fwd", "grad"):
                compiled, call_args = compile_point(fn, mode, args)
                points[name, mode] = (compiled, call_args)
                memory[name, mode] = compiled.memory_analysis().temp_size_in_bytes
        times = interleaved(points, rounds, slow_s=30.0)
        for (name, mode), ts in times.items():
            timed = ts[1:] or ts
            rec = dict(T=T, method=name, mode=mode, median_s=statistics.median(timed))
            rec["temp_bytes"] = memory[name, mode]
            if name != "blockwise":
                pairs = list(zip(times["blockwise", mode], ts, strict=False))[1:]
                rec["blockwise_over_this"] = statistics.median(b / t for b, t in pairs)
            records.append(rec)
            print(json.dumps(rec), flush=True)
    return dict(window=WINDOW, shape=dict(B=1, H=4, D=64), records=records)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(machine=machine_info(), **run(a.T, a.rounds))
    (out / "results.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
