"""Length generalisation: language models trained at one length, evaluated on longer windows.

    python experiments/length_gen.py runs/lm-sweep/runs/lr-0.003_mixer-gated \
        softmax-rope=runs/length-gen/runs/lr-0.003_mixer-softmax-rope ... \
        --lengths 128 512 2048 --out runs/length-gen/eval

Each run (a workdir, or ``label=workdir``) is reloaded with `load_run` (its latest checkpoint)
and evaluated on windows of ``L + 1`` bytes, ``L`` the longest of ``--lengths``, of its
validation split that lie inside one document (so a window is one stretch of one file: no
segment ids, no document boundary, and position ``t`` of the window has ``t`` bytes of context
from the same file; a window starts anywhere in its file, as training windows do). The windows
are consecutive stretches of every validation document, at most ``--max_tokens // L`` of them,
evenly spaced over the candidates; the same windows for every run of the same data. The loss
of every token is summed per position and reported as bits per byte per position bucket
``[e_i, e_(i+1))`` (``--edges``; default ``0, T, 2T, 4T, ...`` with ``T`` the first run's
training length) and, for every length ``l`` of ``--lengths``, as the mean over positions
``[0, l)``: the models are causal, so that is their evaluation at length ``l`` on the windows'
first ``l + 1`` bytes (the same windows at every length; the test checks it).

Position embeddings: a run's model is rebuilt with ``max_length`` raised to ``L`` (it only
sizes decoding caches, and bounds the input, for "none" and "rope" positions). Learned absolute
positions have a table of ``max_length`` rows (2048 in ``configs/lm.py``): the rows past the
training length were never trained (they keep their initialisation, shrunk by weight decay),
and they are used as they are; such a model is evaluated on the windows' first
``max_length + 1`` bytes, and the lengths and buckets past its table are reported as not
applicable, with the reason.

``--max_bytes`` reads more of the corpus than the runs were trained on (default: each run's
own ``data.max_bytes``): the validation blocks of the first ``max_bytes`` are the same, and the
rest is text no run trained on, so it only adds validation windows.

``--replot length_gen.json --out DIR`` evaluates nothing: it redraws ``DIR/length_gen.png``
from a finished evaluation's JSON (``docs/figures/length_gen.png`` is drawn so from
``docs/results/length_gen_cpu.json``).

``--reuse`` keeps the figures of runs already in ``--out``'s JSON (same workdir, checkpoint step
and settings), so runs can be added as they finish training; each run records the load average
before its evaluation (the figures do not depend on it, the seconds do). The JSON's
``sessions`` keeps every invocation's wall time, load averages and the runs it evaluated (the
top-level ``wall_time_sec`` and ``load_avg_end`` are the last invocation's).

Byte-level runs only: the windows are bytes of the corpus files and a position is a byte, so
bits per byte are the loss in bits (`tokenizers.bits_per_byte` with one byte per token). A run
with another tokenizer (``config.data.tokenizer``) is refused with a ValueError.

Writes ``length_gen.json`` (machine, settings, per run: windows, bits per byte per bucket and
per length, seconds) and ``length_gen.png`` (left: bits per byte per bucket, one line per run;
right: mean bits per byte at each evaluation length, as points: only those were measured);
prints a Markdown table. The evaluation is jitted once per run (one shape), in batches of
``--tokens_per_batch // L`` windows.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from flax import nnx

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from linear_attention.benchmarks import machine_info  # noqa: E402
from linear_attention.data.text import load_documents, split_corpus, split_documents  # noqa: E402
from linear_attention.data.tokenizers import BYTES, bits_per_byte  # noqa: E402
from linear_attention.training import experiment_config  # noqa: E402
from linear_attention.training.checkpoint import latest_saved_step  # noqa: E402
from linear_attention.training.load import load_run, run_config  # noqa: E402


def default_edges(train_length: int, max_length: int) -> list[int]:
    """``0, T, 2T, 4T, ...`` up to ``max_length`` (the last edge is ``max_length``)."""
    edges, edge = [0], train_length
    while edge < max_length:
        edges.append(edge)
        edge *= 2
    return edges + [max_length]


def bucket_bits(nll_sum_T: np.ndarray, count_T: np.ndarray, edges) -> list[dict]:
    """Bits per byte over positions ``[edges[i], edges[i+1])`` that exist (``< T``)."""
    out = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        hi = min(hi, nll_sum_T.size)
        if lo >= hi:
            break
        n = float(count_T[lo:hi].sum())
        bits = bits_per_byte(float(nll_sum_T[lo:hi].sum()), n, n)  # a token is a byte
        out.append(dict(start=lo, end=hi, tokens=int(n), bits_per_byte=bits))
    return out


@functools.lru_cache(maxsize=4)
def _validation_split(path, max_bytes, separator, val_fraction):
    """The validation bytes and their document ids (read once per corpus setting)."""
    corpus, starts = load_documents(path, max_bytes=max_bytes, separator=separator)
    val = split_corpus(corpus, val_fraction=val_fraction)[1]
    return val, split_documents(corpus.size, starts, val_fraction=val_fraction)[1]


def validation_windows(data, length: int, max_tokens: int) -> np.ndarray:
    """``uint8[N, length + 1]``: consecutive windows inside each validation document of a
    text-data config (`TextDataConfig`), at most ``max_tokens // length`` evenly spaced."""
    val, docs = _validation_split(
        data.path or None, data.max_bytes or None, data.separator_bytes, data.val_fraction
    )
    first = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
    ends = np.r_[first[1:], docs.size]
    begin = [np.arange(a, b - length, length) for a, b in zip(first, ends, strict=True)]
    begin = np.concatenate(begin) if begin else np.zeros(0, np.int64)
    if begin.size == 0:
        raise ValueError(
            f"no validation document is longer than length + 1 = {length + 1} bytes; use a "
            f"shorter length or a larger corpus (--max_bytes)"
        )
    n = max(1, min(begin.size, max_tokens // length))
    pick = np.unique(np.linspace(0, begin.size - 1, n).round().astype(np.int64))
    return val[begin[pick, None] + np.arange(length + 1)]


@nnx.jit
def _position_nll(model, inputs_BT, labels_BT, weight_B):
    """Per position, the weighted sum over rows of the next-byte NLL (float32)."""
    logits_BTV = model(inputs_BT).astype(jnp.float32)
    logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    nll_BT = -jnp.take_along_axis(logp_BTV, labels_BT[..., None], axis=-1)[..., 0]
    return (nll_BT * weight_B[:, None]).sum(axis=0)


def position_nll(model, windows: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(nll_sum[T], count[T])`` float64 over ``windows[N, T + 1]`` (inputs ``w[:, :-1]``,
    labels ``w[:, 1:]``), in batches of ``batch_size`` (the last padded with zero weight)."""
    n, t = windows.shape[0], windows.shape[1] - 1
    total = np.zeros(t, np.float64)
    for i in range(0, n, batch_size):
        rows = windows[i : i + batch_size].astype(np.int32)
        weight = np.ones(batch_size, np.float32)
        if rows.shape[0] < batch_size:
            weight[rows.shape[0] :] = 0.0
            rows = np.concatenate([rows, np.repeat(rows[:1], batch_size - rows.shape[0], 0)])
        total += np.asarray(_position_nll(model, rows[:, :-1], rows[:, 1:], weight), np.float64)
    return total, np.full(t, float(n))


def _label(config) -> str:
    m = config.model
    mixer = m.mixer if isinstance(m.mixer, str) else ",".join(m.mixer)
    return mixer if m.position == "none" else f"{mixer}+{m.position}"


def check_byte_run(workdir: str, cfg) -> None:
    """ValueError unless ``cfg`` is a byte-level text run (see the module docstring)."""
    if cfg.data.kind != "text":
        raise ValueError(f"{workdir} is not a text run (data.kind = {cfg.data.kind!r})")
    if cfg.data.tokenizer != BYTES:
        raise ValueError(
            f"{workdir} was trained with tokenizer {cfg.data.tokenizer!r}; length_gen.py "
            f"evaluates byte-level runs only (config.data.tokenizer = {BYTES!r}): its windows "
            "and positions are bytes"
        )


def evaluate_run(
    workdir: str,
    lengths,
    edges,
    *,
    max_tokens,
    tokens_per_batch,
    max_bytes=None,
    label=None,
    log=print,
) -> dict:
    """Bits per byte per bucket and per length for the run in ``workdir`` (see the module
    docstring); lengths a learned position table cannot index are reported as skipped."""
    raw = run_config(workdir)
    cfg = experiment_config(raw)
    check_byte_run(workdir, cfg)
    longest = max(lengths)
    learned = cfg.model.position == "learned"
    table = cfg.model.max_length
    if not learned:  # max_length bounds the input only; raise it to the longest length
        raw = json.loads(json.dumps(raw))
        raw["model"]["max_length"] = max(table, longest)
    step = latest_saved_step(workdir)
    model, cfg = load_run(workdir, config=raw, step=step)
    data = cfg.data
    if max_bytes is not None:
        data = dataclasses.replace(data, max_bytes=max_bytes)
    length = min(longest, table) if learned else longest
    load_avg = os.getloadavg()
    windows = validation_windows(data, longest, max_tokens)[:, : length + 1]
    start = time.perf_counter()
    nll, count = position_nll(model, windows, max(1, tokens_per_batch // longest))
    seconds = time.perf_counter() - start
    means = {}
    for l in lengths:
        if l > length:
            means[str(l)] = (
                f"not applicable: the learned position embedding has {table} rows (max_length)"
            )
        else:
            n = float(count[:l].sum())
            means[str(l)] = bits_per_byte(float(nll[:l].sum()), n, n)
    out = dict(
        label=label or _label(cfg),
        workdir=str(workdir),
        step=step,
        mixer=cfg.model.mixer,
        position=cfg.model.position,
        window=cfg.model.options.get("window"),
        train_length=cfg.data.seq_len,
        d_model=cfg.model.d_model,
        seed=cfg.seed,
        steps=cfg.train.num_steps,
        learning_rate=cfg.optimizer.learning_rate,
        max_bytes=data.max_bytes,
        eval_length=length,
        windows=int(windows.shape[0]),
        buckets=bucket_bits(nll, count, edges),
        bits_per_byte=means,
        seconds=seconds,
        load_avg=load_avg,
    )
    cells = " ".join(f"{b['bits_per_byte']:.3f}" for b in out["buckets"])
    log(
        f"  {out['label']}: {windows.shape[0]} windows of {length}, buckets {cells}, {seconds:.0f}s"
    )
    return out


def _lengths(run) -> list[int]:
    return sorted(int(k) for k, v in run["bits_per_byte"].items() if not isinstance(v, str))


def markdown(runs, edges, lengths) -> str:
    names = [f"[{a}, {b})" for a, b in zip(edges[:-1], edges[1:], strict=True)]
    head = ["model", *names, *(f"mean @{l}" for l in lengths)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        cells = [f"{b['bits_per_byte']:.3f}" for b in r["buckets"]]
        cells += ["n/a"] * (len(names) - len(cells))
        for l in lengths:
            v = r["bits_per_byte"][str(l)]
            cells.append("n/a" if isinstance(v, str) else f"{v:.3f}")
        lines.append("| " + " | ".join([r["label"], *cells]) + " |")
    return "\n".join(lines)


MARKERS = "os^Dv<>pXP*h"


def plot(runs, edges, out: Path) -> None:
    """Left: bits per byte per position bucket, a line per run. Right: the mean over positions
    ``[0, l)`` at each evaluated length ``l``, as points only (only those lengths were measured;
    a line between them would suggest values in between), runs dodged sideways within each
    length so that equal values stay visible."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 5.2), width_ratios=(3, 2))
    cmap = plt.get_cmap("tab10")
    lengths = sorted({l for r in runs for l in _lengths(r)})
    dodge = 0.6 / max(len(runs), 1)  # the runs of one length share 60% of its slot
    for i, r in enumerate(runs):
        color, marker = cmap(i % 10), MARKERS[i % len(MARKERS)]
        ls = "--" if "softmax" in r["label"] or r["mixer"] == "swa" else "-"
        buckets = r["buckets"]
        ax.plot(
            range(len(buckets)),
            [b["bits_per_byte"] for b in buckets],
            label=r["label"],
            color=color,
            marker=marker,
            ms=4,
            ls=ls,
        )
        done = _lengths(r)
        offset = (i - (len(runs) - 1) / 2) * dodge
        ax2.plot(
            [lengths.index(l) + offset for l in done],
            [r["bits_per_byte"][str(l)] for l in done],
            ls="none",
            color=color,
            marker=marker,
            ms=6,
            label=r["label"],
        )
    ax.set_xticks(range(len(edges) - 1))
    ax.set_xticklabels(
        [f"[{a},{b})" for a, b in zip(edges[:-1], edges[1:], strict=True)], fontsize=9
    )
    ax.axvline(0.5, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("position in the window (bucket); trained on the first bucket's length")
    ax.set_ylabel("validation bits per byte")
    ax.set_title("loss per position bucket (the same windows for every model)")
    ax.legend(fontsize=8, ncol=2)
    ax2.set_xticks(range(len(lengths)), [str(l) for l in lengths])
    ax2.set_xlim(-0.6, len(lengths) - 0.4)
    for edge in range(len(lengths) - 1):
        ax2.axvline(edge + 0.5, color="0.85", lw=0.8)
    ax2.set_xlabel(
        "evaluation length l (mean over positions [0, l))\n"
        "measured at these lengths only; the models side by side at each"
    )
    ax2.set_title("mean bits per byte at each evaluated length")
    ax2.grid(alpha=0.3, axis="y")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def earlier_session(result: dict) -> dict:
    """The one session a JSON written before ``sessions`` existed records (its top level)."""
    return dict(
        load_avg_start=result["machine"].get("load_avg_start"),
        load_avg_end=result.get("load_avg_end"),
        wall_time_sec=result.get("wall_time_sec"),
        evaluated=None,  # not recorded then
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="*", help="workdir or label=workdir")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument(
        "--edges",
        type=int,
        nargs="+",
        default=None,
        help="bucket edges (default 0, T, 2T, 4T, ... to the longest length)",
    )
    parser.add_argument("--max_tokens", type=int, default=131072, help="tokens per length")
    parser.add_argument("--tokens_per_batch", type=int, default=4096)  # at least one window
    parser.add_argument("--max_bytes", type=int, default=None, help="corpus bytes to read")
    parser.add_argument("--out", required=True, help="folder for length_gen.json / .png")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="take a run's figures from --out's length_gen.json when it holds that workdir at "
        "the same checkpoint step with the same settings (evaluate only the new runs)",
    )
    parser.add_argument(
        "--replot",
        metavar="JSON",
        default=None,
        help="evaluate nothing: redraw --out/length_gen.png from this length_gen.json",
    )
    args = parser.parse_args(argv)
    if args.replot is not None:
        if args.runs:
            parser.error("--replot takes no runs (it redraws a finished evaluation)")
        result = json.loads(Path(args.replot).read_text())
        Path(args.out).mkdir(parents=True, exist_ok=True)
        plot(result["runs"], result["settings"]["edges"], Path(args.out) / "length_gen.png")
        return 0
    if not args.runs:
        parser.error("give at least one run (workdir or label=workdir), or --replot JSON")
    if any(L < 1 for L in args.lengths):
        raise ValueError(f"--lengths must be >= 1, got {args.lengths}")
    if args.max_tokens < 1 or args.tokens_per_batch < 1:
        raise ValueError(
            f"--max_tokens and --tokens_per_batch must be >= 1, got {args.max_tokens} and "
            f"{args.tokens_per_batch}"
        )
    specs = [r.split("=", 1) if "=" in r else [None, r] for r in args.runs]
    for _, workdir in specs:  # every run exists and is byte-level before any work
        check_byte_run(workdir, experiment_config(run_config(workdir)))
    lengths = sorted(set(args.lengths))
    edges = args.edges
    if edges is None:
        edges = default_edges(experiment_config(run_config(specs[0][1])).data.seq_len, lengths[-1])
    if edges[0] != 0 or any(b <= a for a, b in zip(edges[:-1], edges[1:], strict=False)):
        raise ValueError(f"--edges must start at 0 and increase, got {edges}")
    settings = dict(
        lengths=lengths,
        edges=edges,
        max_tokens=args.max_tokens,
        tokens_per_batch=args.tokens_per_batch,
        max_bytes=args.max_bytes,
    )
    out = Path(args.out)
    previous, sessions = {}, []
    if args.reuse and (out / "length_gen.json").exists():
        old = json.loads((out / "length_gen.json").read_text())
        if old["settings"] == settings:
            previous = {(r["workdir"], r["step"]): r for r in old["runs"]}
            sessions = old.get("sessions") or [earlier_session(old)]
    machine = machine_info()
    start = time.perf_counter()
    runs, evaluated = [], []
    for label, workdir in specs:
        reused = previous.get((str(workdir), latest_saved_step(workdir)))
        if reused is not None:
            runs.append({**reused, "label": label or reused["label"]})
            print(f"  {runs[-1]['label']}: reused from {out / 'length_gen.json'}")
            continue
        evaluated.append(str(workdir))
        runs.append(
            evaluate_run(
                workdir,
                lengths,
                edges,
                max_tokens=args.max_tokens,
                tokens_per_batch=args.tokens_per_batch,
                max_bytes=args.max_bytes,
                label=label,
            )
        )
    table = markdown(runs, edges, lengths)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    session = dict(
        load_avg_start=machine["load_avg_start"],
        load_avg_end=os.getloadavg(),
        wall_time_sec=time.perf_counter() - start,
        evaluated=evaluated,
    )
    result = dict(
        machine=machine,
        load_avg_end=session["load_avg_end"],
        wall_time_sec=session["wall_time_sec"],
        sessions=[*sessions, session],
        settings=settings,
        runs=runs,
    )
    (out / "length_gen.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "length_gen.md").write_text(table + "\n")
    plot(runs, edges, out / "length_gen.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
