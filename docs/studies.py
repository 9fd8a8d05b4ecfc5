"""The study pages' tables, generated from the committed results files.

A page under `docs/studies/` holds each table between two markers::

    <!-- table: mqar.best -->
    ...
    <!-- /table -->

`fill(text)` rewrites every marked block from `docs/results/` with the function registered
under that name in `TABLES`. The docs build (`docs/conf.py`) fills each study page as Sphinx
reads it, so the site never shows a table its file does not hold; `python docs/studies.py`
rewrites the committed pages in place, and `tests/test_docs_studies.py` checks that every
committed page equals its regeneration, so a table cannot drift from its file.

One rounding rule: each figure is rounded once from the file's value, accuracies, bits per
byte and errors to three decimals (`f"{x:.3f}"`), latencies and ratios to three significant
figures; a mean over seeds is taken on the file's values, then rounded.
"""

from __future__ import annotations

import csv
import json
import math
import re
import sys
from pathlib import Path

from linear_attention.data.mad import TASKS as MAD_TASKS

DOCS = Path(__file__).resolve().parent
RESULTS = DOCS / "results"
STUDIES = DOCS / "studies"

BLOCK = re.compile(r"(<!-- table: ([\w.]+) -->\n)(.*?)(<!-- /table -->)", re.DOTALL)
TABLES = {}

LEARNED = 0.9  # a run learned a state-tracking task if its final training accuracy is >= this


def table(name):
    def register(fn):
        TABLES[name] = fn
        return fn

    return register


# --- reading and formatting ------------------------------------------------------------------


def read_csv(name: str) -> list[dict]:
    with open(RESULTS / name, newline="") as f:
        return list(csv.DictReader(f))


def read_json(name: str):
    return json.loads((RESULTS / name).read_text())


def f3(x) -> str:
    """Three decimals, a true minus sign; `–` for a missing value."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    text = f"{float(x):.3f}"
    if text == "-0.000":
        text = "0.000"
    return text.replace("-", "−")


def sig3(x) -> str:
    """Three significant figures (latencies, MiB, ratios); whole numbers from 1,000."""
    if abs(float(x)) >= 1000:
        return grouped(round(float(x)))
    text = f"{float(x):#.3g}"
    return text.rstrip(".").replace("-", "−")


def grouped(n: int) -> str:
    return f"{n:,}"


def rate(lr) -> str:
    """A learning rate as the pages write it: 1e-2, 3e-3."""
    mantissa, exponent = f"{float(lr):.0e}".split("e")
    return f"{mantissa}e-{int(exponent[1:])}" if exponent.startswith("-") else f"{float(lr):g}"


def spread(cell: dict) -> str:
    return f"{f3(cell['mean'])} ({f3(cell['min'])}–{f3(cell['max'])})"


def render(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """A Markdown table; `align` one character per column: `l` (default) or `r`."""
    align = align or "l" * len(header)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def best_of_rates(rows, keys, metric="eval/accuracy", larger=True, tune="lr", seed="seed"):
    """Per setting (the `keys` columns): the `tune` value with the best mean over the seeds,
    Zoology's protocol as `experiments/sweep.py` applies it (the first of equal means). Returns
    {setting: {"lr", "mean", "min", "max", "runs": {seed: value}, "rates": n, "rows"}}."""
    settings: dict[tuple, dict[str, list[dict]]] = {}
    for row in rows:
        setting = tuple(row[k] for k in keys)
        settings.setdefault(setting, {}).setdefault(row[tune], []).append(row)
    best = {}
    for setting, by_rate in settings.items():
        cells = []
        for lr, runs in by_rate.items():
            values = [float(r[metric]) for r in runs]
            mean = sum(values) / len(values)
            cells.append((mean, lr, runs, values))
        pick = max(cells, key=lambda c: c[0]) if larger else min(cells, key=lambda c: c[0])
        mean, lr, runs, values = pick
        best[setting] = {
            "lr": lr,
            "mean": mean,
            "min": min(values),
            "max": max(values),
            "runs": {r[seed]: float(r[metric]) for r in runs},
            "rates": len(by_rate),
            "rows": runs,
        }
    return best


def by_seed(runs: dict) -> str:
    return " / ".join(f3(runs[s]) for s in sorted(runs, key=int))


def fisher_one_sided(a: int, n1: int, b: int, n2: int) -> float:
    """P(X >= a) for X hypergeometric: a of n1 against b of n2 successes (Fisher's exact test,
    one-sided, the first group larger)."""
    total, successes = n1 + n2, a + b
    denominator = math.comb(total, successes)
    return (
        sum(
            math.comb(n1, k) * math.comb(n2, successes - k)
            for k in range(a, min(n1, successes) + 1)
        )
        / denominator
    )


SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def p_value(p: float) -> str:
    if p >= 0.01:
        return f"{p:.3f}"
    mantissa, exponent = f"{p:.1e}".split("e")
    return f"{mantissa}·10" + str(int(exponent)).translate(SUPERSCRIPT)


# --- MQAR ------------------------------------------------------------------------------------

MQAR_MIXERS = (
    "softmax",
    "linear",
    "linear_scale8",
    "taylor",
    "retnet",
    "gated",
    "gla",
    "deltanet",
    "gated_deltanet",
    "swa",
    "based",
    "kda",
    "gated_deltaproduct",
    "rwkv7",
    "fox",
    "fox_bias5",
    "mesanet",
    "path",
    "log_linear_mamba2",
    "log_linear_gated_deltanet",
)


def mqar_rows() -> list[dict]:
    return read_csv("mqar_sweep_cpu.csv") + read_csv("mqar_sweep_cpu_families.csv")


@table("mqar.best")
def mqar_best() -> str:
    rows = mqar_rows()
    best = best_of_rates(rows, ("mixer", "d_model"))
    out = []
    for mixer in MQAR_MIXERS:
        cells = [best[(mixer, d)] for d in ("64", "128")]
        state = " / ".join(grouped(int(c["rows"][0]["state_bytes"])) for c in cells)
        line = [f"`{mixer}`", state]
        for c in cells:
            line += [spread(c), rate(c["lr"]), by_seed(c["runs"]), f"{c['rates']} of 3"]
        out.append(line)
    header = ["mixer", "state bytes, d 64 / 128"]
    for d in (64, 128):
        header += [f"d_model {d}", "lr", "seed 0 / 1", "rates run"]
    return render(header, out, "lr" + "lrlr" * 2)


@table("mqar.per_rate")
def mqar_per_rate() -> str:
    """Every run of the mixers added after the first grid, seeds 0 / 1 at each rate."""
    rows = mqar_rows()
    mixers = (
        "kda",
        "gated_deltaproduct",
        "rwkv7",
        "fox",
        "fox_bias5",
        "mesanet",
        "path",
        "log_linear_mamba2",
        "log_linear_gated_deltanet",
    )
    lrs = ("0.003", "0.01", "0.03")
    header = ["mixer"] + [f"d {d}, {rate(lr)}" for d in (64, 128) for lr in lrs]
    out = []
    for mixer in mixers:
        line = [f"`{mixer}`"]
        for d in ("64", "128"):
            for lr in lrs:
                runs = {
                    r["seed"]: float(r["eval/accuracy"])
                    for r in rows
                    if (r["mixer"], r["d_model"], r["lr"]) == (mixer, d, lr)
                }
                line.append(by_seed(runs) if runs else "not run")
        out.append(line)
    return render(header, out)


@table("mqar.seed_splits")
def mqar_seed_splits() -> str:
    """The tuned cells whose two seeds differ by more than 0.2."""
    best = best_of_rates(mqar_rows(), ("mixer", "d_model"))
    out = []
    for mixer in MQAR_MIXERS:
        for d in ("64", "128"):
            c = best[(mixer, d)]
            if c["max"] - c["min"] > 0.2:
                out.append(
                    [f"`{mixer}`", d, rate(c["lr"]), by_seed(c["runs"]), f3(c["max"] - c["min"])]
                )
    return render(["mixer", "d_model", "lr", "seed 0 / 1", "max − min"], out, "lrllr")


@table("mqar.forgetting")
def mqar_forgetting() -> str:
    forgetting = read_csv("mqar_forgetting_cpu.csv")
    plain = [
        r for r in read_csv("mqar_sweep_cpu.csv") if (r["d_model"], r["lr"]) == ("128", "0.01")
    ]
    out = []
    for mixer in ("deltanet", "gated_deltanet", "kda", "softmax", "retnet", "gla"):
        f = {r["seed"]: float(r["eval/accuracy"]) for r in forgetting if r["mixer"] == mixer}
        p = {r["seed"]: float(r["eval/accuracy"]) for r in plain if r["mixer"] == mixer}
        out.append([f"`{mixer}`", by_seed(f), f3(sum(f.values()) / len(f)), by_seed(p)])
    header = ["mixer", "forgetting MQAR, seed 0 / 1", "mean", "plain MQAR, seed 0 / 1"]
    return render(header, out)


@table("mqar.decay_swap")
def mqar_decay_swap() -> str:
    out = []
    for run in read_json("decay_init_swap_cpu.json"):
        layers = " / ".join(
            ", ".join(f"{v:.3f}" for v in layer) for layer in run["init_rate_per_layer"]
        )
        out.append(
            [f"seed {run['seed']}", f"seed {run['decay_seed']}", layers, f3(run["eval_accuracy"])]
        )
    header = ["weights and data", "decays", "A·softplus(b) at init, layer 0 / layer 1", "accuracy"]
    return render(header, out, "lllr")


# --- language model, decoding, packing, length, tokenizers, FAVOR+ ----------------------------


@table("lm.sweep")
def lm_sweep() -> str:
    rows = sorted(read_csv("lm_sweep_cpu.csv"), key=lambda r: float(r["eval/bits_per_byte"]))
    out = [
        [
            f"`{r['mixer']}`",
            r["model.d_model"],
            grouped(int(r["param_count"])),
            f3(float(r["eval/bits_per_byte"])),
            grouped(int(r["state_bytes"])),
            r["step"],
        ]
        for r in rows
    ]
    header = ["mixer", "d_model", "parameters", "val bits/byte", "state bytes", "steps"]
    return render(header, out, "lrrrrr")


@table("decode.latency")
def decode_latency() -> str:
    data = read_json("decode_cpu.json")
    points = {(p["mixer"], p["context"]): p for p in data["decode"]}
    contexts = sorted({p["context"] for p in data["decode"]})
    out = []
    for n in contexts:
        ms = [
            sig3(points[(m, n)]["median_s"] * 1e3) for m in ("gated", "softmax", "softmax_maxcache")
        ]
        mib = [sig3(points[(m, n)]["state_size_bytes"] / 2**20) for m in ("gated", "softmax")]
        out.append([grouped(n), *ms, *mib])
    header = [
        "context",
        "gated ms",
        "softmax ms",
        "softmax ms, 65,536-slot cache",
        "gated state MiB",
        "softmax KV cache MiB",
    ]
    return render(header, out, "rrrrrr")


@table("decode.prefill")
def decode_prefill() -> str:
    data = read_json("decode_cpu.json")
    points = {(p["mixer"], p["length"]): p for p in data["prefill"]}
    lengths = sorted({p["length"] for p in data["prefill"]})
    out = [
        [grouped(n), *(sig3(points[(m, n)]["median_s"]) for m in ("gated", "softmax"))]
        for n in lengths
    ]
    return render(["length", "gated s", "softmax s"], out, "rrr")


@table("decode.headline")
def decode_headline() -> str:
    h = read_json("decode_cpu.json")["headline"]
    rows = [
        [
            "slope of log latency against log context, gated (all / last two contexts)",
            f"{sig3(h['gated_latency_slope'])} / {sig3(h['gated_latency_slope_last'])}",
        ],
        [
            "the same, softmax",
            f"{sig3(h['softmax_latency_slope'])} / {sig3(h['softmax_latency_slope_last'])}",
        ],
        [
            f"softmax over gated, latency at {grouped(h['longest_context'])}",
            sig3(h["softmax_over_gated_latency"]),
        ],
        [
            f"softmax's cache over gated's state at {grouped(h['longest_context'])}",
            sig3(h["softmax_over_gated_state_bytes"]),
        ],
        [
            "65,536-slot cache over its own cache, latency at the shortest context",
            sig3(h["maxcache_over_own_cache_latency_shortest"]),
        ],
        [
            "prefill slope (log time against log length), gated / softmax",
            f"{sig3(h['gated_prefill_slope'])} / {sig3(h['softmax_prefill_slope'])}",
        ],
    ]
    return render(["measure", "value"], rows, "lr")


def _separator(text: str) -> str:
    return "files" if text == "" else "`\\n\\n\\n` pieces"


@table("packing.table")
def packing_table() -> str:
    runs = read_json("lm_packing_cpu.json")["runs"]
    out = []
    for trained in ((False, ""), (True, ""), (True, "\\n\\n\\n")):
        for separator in ("", "\\n\\n\\n"):
            line = [
                "not packed" if not trained[0] else f"packed ({_separator(trained[1])})",
                _separator(separator),
            ]
            boundaries = None
            for mixer in ("gated", "softmax"):
                match = [
                    r
                    for r in runs
                    if (r["mixer"], r["trained_packed"], r["trained_separator"], r["separator"])
                    == (mixer, *trained, separator)
                ]
                line += (
                    [f3(match[0]["packed/bits_per_byte"]), f3(match[0]["windows/bits_per_byte"])]
                    if match
                    else ["not run", "not run"]
                )
                boundaries = match[0]["boundaries"] if match else boundaries
            line.append(str(boundaries))
            out.append(line)
    header = [
        "trained as",
        "documents at eval",
        "gated packed",
        "gated windows",
        "softmax packed",
        "softmax windows",
        "boundaries",
    ]
    return render(header, out, "llrrrrr")


@table("length_gen.table")
def length_gen_table() -> str:
    data = read_json("length_gen_cpu.json")
    edges = data["settings"]["edges"]
    lengths = data["settings"]["lengths"]
    header = ["model", "position", "trained at"]
    header += [f"[{a}, {b})" for a, b in zip(edges, edges[1:], strict=False)]
    header += [f"mean @{n}" for n in lengths]
    out = []
    for run in data["runs"]:
        line = [f"`{run['label']}`", run["position"], str(run["train_length"])]
        line += [f3(b["bits_per_byte"]) for b in run["buckets"]]
        line += [f3(run["bits_per_byte"][str(n)]) for n in lengths]
        out.append(line)
    return render(header, out, "lll" + "r" * (len(header) - 3))


@table("bpe.table")
def bpe_table() -> str:
    data = read_json("lm_bpe_vs_bytes_cpu.json")
    byte_run = data["byte_baseline"]["runs"][0]
    bpe = data["bpe_run"]
    own = {e["step"]: e["eval/bits_per_byte"] for e in bpe["own_validation"]}
    steps = sorted(own)
    header = ["model", "parameters", "measure", *(f"step {s}" for s in steps)]
    blanks = [""] * (len(steps) - 1)
    out = [
        [
            "bytes (vocabulary 256)",
            "(section 5's packed run)",
            "its own windows, no segment ids",
            *blanks,
            f3(byte_run["windows/bits_per_byte"]),
        ],
        [
            f"BPE {grouped(bpe['vocab_size'])}",
            grouped(bpe["param_count"]),
            "the byte run's windows",
            *blanks,
            f3(data["byte_windows"]["bits_per_byte"]),
        ],
        [
            f"BPE {grouped(bpe['vocab_size'])}",
            grouped(bpe["param_count"]),
            "its own validation",
            *(f3(own[s]) for s in steps),
        ],
    ]
    return render(header, out, "lrl" + "r" * len(steps))


@table("favor.error")
def favor_error() -> str:
    summary = read_json("favor_error_cpu.json")["summary"]
    mean = {(s["norm"], s["m"], s["orthogonal"], s["metric"]): s["mean"] for s in summary}
    norms = sorted({s["norm"] for s in summary})
    ms = sorted({s["m"] for s in summary})
    out = []
    for norm in norms:
        for m in ms:
            line = [f"{norm:g}", str(m)]
            for metric in ("kernel", "weights", "output"):
                line.append(" / ".join(sig3(mean[(norm, m, o, metric)]) for o in (True, False)))
            out.append(line)
    header = ["\\|x'\\|", "m", "kernel, orth / iid", "weights, orth / iid", "output, orth / iid"]
    return render(header, out, "rrrrr")


@table("favor.slopes")
def favor_slopes() -> str:
    slopes = read_json("favor_error_cpu.json")["slopes"]
    value = {(s["norm"], s["orthogonal"], s["metric"]): s["slope"] for s in slopes}
    out = []
    for norm in sorted({s["norm"] for s in slopes}):
        line = [f"{norm:g}"]
        for metric in ("kernel", "weights", "output"):
            line.append(" / ".join(f3(value[(norm, o, metric)]) for o in (True, False)))
        out.append(line)
    header = ["\\|x'\\|", "kernel, orth / iid", "weights, orth / iid", "output, orth / iid"]
    return render(header, out, "rrrr")


# --- state tracking --------------------------------------------------------------------------

DELTA = ("deltanet", "gated_deltanet", "gated_deltaproduct_n1", "gated_deltaproduct_n2", "kda")
OTHERS = ("softmax", "gla", "gated", "retnet", "taylor", "swa", "linear", "based", "rwkv7")
SLICES = (
    ("parity", "state_tracking_parity_sweep_cpu.csv", "1/2"),
    ("S5 with swaps", "state_tracking_s5_swaps_cpu.csv", "1/120"),
    ("modular arithmetic", "state_tracking_mod_arith_sweep_cpu.csv", "1/5"),
    ("S3", "state_tracking_s3_cpu.csv", "1/6"),
    ("S5", "state_tracking_s5_cpu.csv", "1/120"),
    ("A5", "state_tracking_a5_cpu.csv", "1/60"),
)


def learned(rows) -> int:
    return sum(float(r["train/accuracy"]) >= LEARNED for r in rows)


@table("st.slices")
def st_slices() -> str:
    out = []
    for task, name, chance in SLICES:
        rows = read_csv(name)
        neg = [r for r in rows if r["mixer"].endswith("_neg")]
        pos = [r for r in rows if r["mixer"] in DELTA]
        other = [r for r in rows if r["mixer"] in OTHERS]
        assert len(neg) + len(pos) + len(other) == len(rows), name
        a, b = learned(neg), learned(pos)
        accuracy = [float(r["eval/accuracy"]) for r in rows]
        best = best_of_rates(rows, ("mixer",))
        top = max(best.items(), key=lambda kv: kv[1]["mean"])
        out.append(
            [
                f"{task} ({chance})",
                str(len(rows)),
                f"{a} of {len(neg)}",
                f"{b} of {len(pos)}",
                f"{learned(other)} of {len(other)}",
                p_value(fisher_one_sided(a, len(neg), b, len(pos))),
                f"{f3(min(accuracy))}–{f3(max(accuracy))}",
                f"`{top[0][0]}`, {rate(top[1]['lr'])}: {spread(top[1])}",
            ]
        )
    header = [
        "task (chance)",
        "runs",
        "learned, delta rules β ∈ (0, 2)",
        "learned, the same β ∈ (0, 1)",
        "learned, the 9 others",
        "one-sided Fisher p, (0, 2) against (0, 1)",
        "eval/accuracy, all runs",
        "best cell (mean over 2 seeds, min–max)",
    ]
    return render(header, out, "lrrrrrll")


@table("st.parity_delta")
def st_parity_delta() -> str:
    rows = read_csv("state_tracking_parity_sweep_cpu.csv")
    best = best_of_rates(rows, ("mixer",))
    out = []
    for mixer in DELTA:
        pos, neg = best[(mixer,)], best[(mixer + "_neg",)]
        at_256 = [float(r["eval/length_256/accuracy"]) for r in neg["rows"]]
        out.append(
            [
                f"`{mixer}`",
                rate(pos["lr"]),
                spread(pos),
                f"{learned(r for r in rows if r['mixer'] == mixer)} of 6",
                rate(neg["lr"]),
                spread(neg),
                f3(sum(at_256) / len(at_256)),
                f"{learned(r for r in rows if r['mixer'] == mixer + '_neg')} of 6",
            ]
        )
    header = [
        "mixer",
        "β ∈ (0, 1): best lr",
        "mean (min–max)",
        "learned",
        "β ∈ (0, 2): best lr",
        "mean (min–max)",
        "L = 256",
        "learned",
    ]
    return render(header, out, "llllllrl")


@table("st.parity_others")
def st_parity_others() -> str:
    rows = read_csv("state_tracking_parity_sweep_cpu.csv")
    best = best_of_rates(rows, ("mixer",))
    out = [
        [
            f"`{m}`",
            rate(best[(m,)]["lr"]),
            spread(best[(m,)]),
            f"{learned(r for r in rows if r['mixer'] == m)} of 6",
        ]
        for m in OTHERS
    ]
    return render(["mixer", "best lr", "mean (min–max)", "learned"], out)


@table("st.parity_by_rate")
def st_parity_by_rate() -> str:
    rows = read_csv("state_tracking_parity_sweep_cpu.csv")
    out = []
    for lr in ("0.001", "0.003", "0.01"):
        neg = [r for r in rows if r["mixer"].endswith("_neg") and r["lr"] == lr]
        over = [r for r in rows if r["lr"] == lr and float(r["eval/length_256/accuracy"]) >= 0.9]
        out.append(
            [
                rate(lr),
                f"{learned(neg)} of {len(neg)}",
                ", ".join(f"`{r['mixer']}` seed {r['seed']}" for r in over) or "none",
            ]
        )

    return render(["lr", "β ∈ (0, 2) runs that learned", "runs ≥ 0.9 at length 256"], out)


@table("st.mod_arith_by_rate")
def st_mod_arith_by_rate() -> str:
    rows = read_csv("state_tracking_mod_arith_sweep_cpu.csv")
    out = []
    for lr in ("0.001", "0.003", "0.01"):
        at = [r for r in rows if r["lr"] == lr]
        acc = [float(r["eval/accuracy"]) for r in at]
        loss = [float(r["eval/loss"]) for r in at]
        out.append(
            [
                rate(lr),
                str(len(at)),
                f"{f3(min(acc))}–{f3(max(acc))}",
                f"{min(loss):.4f}–{max(loss):.4f}",
                f"{learned(at)} of {len(at)}",
            ]
        )
    header = ["lr", "runs", "eval/accuracy", "eval/loss (ln 5 = 1.6094)", "learned"]
    return render(header, out, "lrllr")


@table("st.mod_arith_short")
def st_mod_arith_short() -> str:
    files = (("(0, 2)", "neg"), ("(0, 1)", "pos"))
    data = {
        label: read_json(f"state_tracking_mod_arith_deltanet_{kind}_2000steps_short_lengths.json")
        for label, kind in files
    }
    lengths = sorted(
        int(k.split("/")[1].split("_")[1]) for k in data["(0, 2)"] if k.startswith("eval/length_")
    )
    header = ["β range", *(f"{n // 2} operands (L = {n})" for n in lengths)]
    out = [
        [label, *(f3(d[f"eval/length_{n}/accuracy"]) for n in lengths)] for label, d in data.items()
    ]
    return render(header, out, "l" + "r" * len(lengths))


def _fork_runs():
    return read_json("state_tracking_parity_fork_1layer_cpu.json")


def _fork_label(run) -> str:
    name = run["run"].split("_mixer-")[1].split("_seed-")[0]
    labels = {
        "gated_deltanet_neg": "`gated_deltanet`, β ∈ (0, 2)",
        "gated_deltanet": "`gated_deltanet`, β ∈ (0, 1)",
        "deltanet_neg": "`deltanet`, β ∈ (0, 2)",
        "deltanet": "`deltanet`, β ∈ (0, 1)",
        "gated": "`gated` (scalar decay)",
        "lstm": "`lstm`",
        "softmax": "`softmax` (no positions)",
    }
    return labels[name]


FORK_ORDER = (
    "gated_deltanet_neg",
    "gated_deltanet",
    "deltanet_neg",
    "deltanet",
    "gated",
    "lstm",
    "softmax",
)


def _fork_sorted(runs):
    def key(run):
        name = run["run"].split("_mixer-")[1].split("_seed-")[0]
        return FORK_ORDER.index(name), run["seed"]

    return sorted(runs, key=key)


@table("st.parity_paper_size")
def st_parity_paper_size() -> str:
    data = read_json("state_tracking_parity_paper_step_time_cpu.json")
    load = data["machine"]["load_avg_1min_start_end"]
    rows = [
        ["parameters", grouped(data["size"]["parameters"])],
        ["training FLOPs per token", sig3(data["size"]["train_flops_per_token"] / 1e6) + "M"],
        ["tokens per step (batch × longest length)", grouped(data["size"]["tokens_per_step"])],
        [
            f"seconds per step, 2-core CPU at load {load[0]:.0f}–{load[1]:.0f}",
            sig3(data["seconds_per_step_at_step_50"]),
        ],
        [
            "hours per 20,000-step run at that rate",
            sig3(data["hours_per_20000_step_run_at_that_rate"]),
        ],
    ]
    return render(["`:parity_paper` (deltanet, β ∈ (0, 2))", "value"], rows, "lr")


@table("st.fork_1layer")
def st_fork_1layer() -> str:
    out = []
    for run in _fork_sorted(_fork_runs()["runs"]):
        scaled = run["scaled_accuracy_at"]
        lengths = run["lengths_40_to_256_every_8"]
        out.append(
            [
                _fork_label(run),
                str(run["seed"]),
                f3(run["final"]["train/accuracy"]),
                *(f3(scaled[n]) for n in ("40", "64", "128", "256")),
                f3(lengths["scaled_accuracy"]) if lengths else "not run",
            ]
        )
    header = [
        "mixer",
        "seed",
        "train acc.",
        "scaled, L = 40",
        "64",
        "128",
        "256",
        "scaled, 28 lengths 40–256",
    ]
    return render(header, out, "lrrrrrrr")


@table("st.fork_like_for_like")
def st_fork_like_for_like() -> str:
    data = _fork_runs()
    paper = data["paper_table3_parity_scaled_accuracy"]
    rows = []
    for name, paper_key in (
        ("deltanet_neg", "DeltaNet [-1, 1]"),
        ("deltanet", "DeltaNet [0, 1]"),
        ("gated_deltanet_neg", None),
        ("gated_deltanet", None),
    ):
        runs = [r for r in data["runs"] if r["run"].split("_mixer-")[1].split("_seed-")[0] == name]
        runs = sorted(runs, key=lambda r: r["seed"])
        values = [r["lengths_40_to_256_every_8"]["scaled_accuracy"] for r in runs]
        rows.append(
            [
                _fork_label(runs[0]),
                str(len(values)),
                f3(max(values)),
                " / ".join(f3(v) for v in values),
                f3(paper[paper_key]) if paper_key else "no row",
            ]
        )
    header = ["mixer", "seeds", "best of the seeds", "seeds 0 / 1 / 2", "paper (one selected run)"]
    return render(header, rows, "lrrrr")


def _prefix_through(accuracy: dict, threshold: float) -> str:
    """The longest length L such that every evaluated length up to L is >= threshold."""
    through = None
    for n in sorted(accuracy):
        if accuracy[n] < threshold:
            break
        through = n
    return str(through) if through else "none"


def _per_length_rows():
    """(label, {length: accuracy}, scaled mean) of the β ∈ (0, 2) delta runs and the probes
    evaluated at the 28 lengths 40, 48, …, 256."""
    data = _fork_runs()
    for run in _fork_sorted(data["runs"]):
        lengths = run["lengths_40_to_256_every_8"]
        if lengths and run["run"].split("_mixer-")[1].split("_seed-")[0].endswith("_neg"):
            accuracy = {int(n): v for n, v in lengths["accuracy"].items()}
            yield f"{_fork_label(run)}, seed {run['seed']}", accuracy, lengths["scaled_accuracy"]
    for probe in data["probes"]:
        lengths = probe.get("lengths_40_to_256")
        if lengths:
            accuracy = {int(k.split("_")[1]): v for k, v in lengths["accuracy"].items()}
            name = probe["name"].replace("beta in (0, 2)", "β ∈ (0, 2)")
            yield f"probe: {name}", accuracy, lengths["scaled_accuracy"]


@table("st.fork_lengths")
def st_fork_lengths() -> str:
    out = []
    for label, accuracy, scaled in _per_length_rows():
        exact = [n for n in sorted(accuracy) if accuracy[n] == 1.0]
        low = min(accuracy, key=lambda n: (accuracy[n], n))
        out.append(
            [
                label,
                ", ".join(map(str, exact)) or "none",
                _prefix_through(accuracy, 0.99),
                _prefix_through(accuracy, 0.97),
                f"{f3(accuracy[low])} at {low}",
                f3(accuracy[max(accuracy)]),
                f3(scaled),
            ]
        )
    header = [
        "run",
        "accuracy 1.000 at lengths",
        "≥ 0.99 at every length through",
        "≥ 0.97 through",
        "lowest",
        "at 256",
        "scaled, mean of the 28",
    ]
    return render(header, out, "lllllrr")


@table("st.fork_probes")
def st_fork_probes() -> str:
    out = []
    for probe in _fork_runs()["probes"]:
        final = probe.get("final")
        evals = probe.get("evaluations") or []
        fitted = next((e["step"] for e in evals if e.get("length_40", 0) >= 0.99), None)
        lengths = probe.get("lengths_40_to_256")
        out.append(
            [
                probe["name"].replace("beta in (0, 2)", "β ∈ (0, 2)"),
                f3(final["eval/length_256/accuracy"]) if final else "stopped early",
                f3(lengths["scaled_accuracy"]) if lengths else "–",
                grouped(fitted) if fitted else "–",
            ]
        )
    header = [
        "probe",
        "accuracy at L = 256",
        "scaled, 28 lengths 40–256",
        "first evaluation (every 2,000 steps) ≥ 0.99 at L = 40",
    ]
    return render(header, out, "lrrr")


@table("st.budget")
def st_budget() -> str:
    data = read_json("state_tracking_budget_cpu.json")
    runs = {(r["task"], r["mixer"], r["budget"], r["seed"]): r for r in data["runs"]}
    budgets = ("1x", "4x", "16x")
    out = []
    for task in ("s3", "a5"):
        for mixer in ("gated_deltaproduct_n2_neg", "gated_deltanet_neg"):
            line = [task.upper(), f"`{mixer}`"]
            for budget in budgets:
                seeds = [runs.get((task, mixer, budget, s)) for s in (0, 1)]
                line.append(
                    " / ".join(f3(r["eval"]["eval/accuracy"]) if r else "not run" for r in seeds)
                )
            out.append(line)
    ratio = data["budget_ratio_to_deltaproduct_tokens"]
    header = [
        "task",
        "mixer",
        *(f"{b} ({ratio[b]} of DeltaProduct's tokens), seed 0 / 1" for b in budgets),
    ]
    return render(header, out)


# The papers' budgets the controls are measured against: Grazzi et al.'s sequences (parity:
# 20,000 steps of 256; modular arithmetic: 100,000 of 1,024) and DeltaProduct's training
# tokens (99,000 sequences of 128, 100 epochs).
PAPER_BUDGET = {
    "parity": (20_000 * 256, "sequences", "Grazzi et al.'s"),
    "mod_arith": (100_000 * 1_024, "sequences", "Grazzi et al.'s"),
    "s3": (99_000 * 100 * 128, "tokens", "DeltaProduct's"),
    "s5": (99_000 * 100 * 128, "tokens", "DeltaProduct's"),
    "a5": (99_000 * 100 * 128, "tokens", "DeltaProduct's"),
}


def budget_ratio(setting: dict) -> str:
    """A run's training budget as a fraction of its paper's: sequences, or tokens at the mean
    training length (lengths drawn uniformly between the two bounds)."""
    paper, unit, whose = PAPER_BUDGET[setting["task"]]
    sequences = setting["num_steps"] * setting["batch_size"]
    low, high = setting["train_lengths"]
    seen = sequences if unit == "sequences" else sequences * (low + high) / 2
    return f"1/{grouped(round(paper / seen))} of {whose} {unit}"


@table("st.controls")
def st_controls() -> str:
    out = []
    for run in read_json("state_tracking_positive_controls_cpu.json")["runs"]:
        final, s = run["final"], run["setting"]
        if final is None or run["run"] == "timing":
            continue
        model = run["setting"]["mixer"]
        if s.get("position") not in (None, "none"):
            model += f" + {s['position']}"
        lengths = sorted(
            int(k.split("_")[1].split("/")[0]) for k in final if k.startswith("eval/length_")
        )
        evals = ", ".join(f"{n}: {f3(final[f'eval/length_{n}/accuracy'])}" for n in lengths)
        out.append(
            [
                model,
                s["task"],
                f"{s['train_lengths'][0]}–{s['train_lengths'][1]}",
                str(s["num_layers"]),
                str(s["d_model"]),
                rate(s["learning_rate"]),
                grouped(s["num_steps"]),
                budget_ratio(s),
                str(s["seed"]),
                f3(final["train/accuracy"]),
                evals,
            ]
        )
    header = [
        "model",
        "task",
        "train lengths",
        "layers",
        "d_model",
        "lr",
        "steps",
        "budget",
        "seed",
        "train acc.",
        "accuracy by length",
    ]
    return render(header, out, "lllrrlrlrrl")


@table("st.s3_one_layer")
def st_s3_one_layer() -> str:
    rows = read_csv("state_tracking_s3_one_layer_cpu.csv")
    out = []
    for mixer in ("gated_deltaproduct_n1_neg", "gated_deltaproduct_n2_neg"):
        line = [f"`{mixer}`"]
        for lr in ("0.001", "0.003", "0.01"):
            runs = {
                r["seed"]: float(r["eval/accuracy"])
                for r in rows
                if (r["mixer"], r["lr"]) == (mixer, lr)
            }
            line.append(by_seed(runs))
        out.append(line)
    return render(["mixer", "lr 1e-3, seed 0 / 1", "3e-3", "1e-2"], out)


# --- MAD -------------------------------------------------------------------------------------


@table("mad.grid")
def mad_grid() -> str:
    rows = read_csv("mad_cpu.csv")
    best = best_of_rates(rows, ("mixer", "task"))
    mixers = sorted({r["mixer"] for r in rows})
    mean_of_six = {m: sum(best[(m, t)]["mean"] for t in MAD_TASKS) / len(MAD_TASKS) for m in mixers}
    out = []
    for m in sorted(mixers, key=lambda m: -mean_of_six[m]):
        out.append([f"`{m}`", *(spread(best[(m, t)]) for t in MAD_TASKS), f3(mean_of_six[m])])
    header = ["mixer", *(t.replace("_", " ") for t in MAD_TASKS), "mean of six"]
    return render(header, out)


@table("mad.rates")
def mad_rates() -> str:
    """The rate each cell kept (the best mean over the seeds)."""
    rows = read_csv("mad_cpu.csv")
    best = best_of_rates(rows, ("mixer", "task"))
    mixers = sorted({r["mixer"] for r in rows})
    out = [[f"`{m}`", *(rate(best[(m, t)]["lr"]) for t in MAD_TASKS)] for m in mixers]
    return render(["mixer", *(t.replace("_", " ") for t in MAD_TASKS)], out)


@table("mad.low_rate")
def mad_low_rate() -> str:
    """Mean over the seeds at lr 1e-3, the rate that separates the recall solvers."""
    rows = [r for r in read_csv("mad_cpu.csv") if r["lr"] == "0.001"]
    mixers = sorted({r["mixer"] for r in rows})
    out = []
    for m in mixers:
        line = [f"`{m}`"]
        for t in ("in_context_recall", "noisy_recall"):
            values = [float(r["eval/accuracy"]) for r in rows if (r["mixer"], r["task"]) == (m, t)]
            line.append(f3(sum(values) / len(values)))
        out.append(line)
    out.sort(key=lambda line: -float(line[1]))
    return render(["mixer", "in-context recall, lr 1e-3", "noisy recall, lr 1e-3"], out, "lrr")


# --- the README's headline tables (subsets of the study pages') ------------------------------


@table("readme.mqar")
def readme_mqar() -> str:
    best = best_of_rates(mqar_rows(), ("mixer", "d_model"))
    mixers = ("softmax", "rwkv7", "deltanet", "kda", "gla", "retnet", "gated_deltanet", "linear")
    out = [[f"`{m}`", spread(best[(m, "64")]), spread(best[(m, "128")])] for m in mixers]
    return render(["mixer", "d_model 64", "d_model 128"], out)


@table("readme.mad")
def readme_mad() -> str:
    rows = read_csv("mad_cpu.csv")
    best = best_of_rates(rows, ("mixer", "task"))
    out = []
    for m in ("rwkv7", "softmax", "kda", "deltanet", "gla", "linear"):
        mean = sum(best[(m, t)]["mean"] for t in MAD_TASKS) / len(MAD_TASKS)
        cells = [spread(best[(m, t)]) for t in ("fuzzy_recall", "selective_copying")]
        out.append([f"`{m}`", f3(mean), *cells])
    return render(["mixer", "mean of six", "fuzzy recall", "selective copying"], out)


@table("readme.lm")
def readme_lm() -> str:
    rows = sorted(read_csv("lm_sweep_cpu.csv"), key=lambda r: float(r["eval/bits_per_byte"]))
    out = [[f"`{r['mixer']}`", f3(float(r["eval/bits_per_byte"]))] for r in rows]
    return render(["mixer", "bits/byte"], out, "lr")


# --- filling the pages -----------------------------------------------------------------------


def fill(text: str) -> str:
    """`text` with every marked table regenerated; an unknown name raises."""

    def replace(match):
        name = match[2]
        if name not in TABLES:
            raise KeyError(f"docs/studies: no table named {name!r}; known: {sorted(TABLES)}")
        return match[1] + "\n" + TABLES[name]() + "\n" + match[4]

    return BLOCK.sub(replace, text)


def names_used(text: str) -> list[str]:
    return [m[2] for m in BLOCK.finditer(text)]


def pages() -> list[Path]:
    """The files with generated tables: the study pages and the README's headline results."""
    return [*sorted(STUDIES.glob("*.md")), DOCS.parent / "README.md"]


def main(argv=None) -> int:
    """Rewrite the committed pages' tables (`--check`: report the stale ones, exit 1)."""
    argv = sys.argv[1:] if argv is None else argv
    stale = []
    for page in pages():
        text = page.read_text()
        new = fill(text)
        if new != text:
            stale.append(page)
            if "--check" not in argv:
                page.write_text(new)
    for page in stale:
        print(f"{'stale' if '--check' in argv else 'rewrote'}: {page.relative_to(DOCS.parent)}")
    return 1 if stale and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main())
