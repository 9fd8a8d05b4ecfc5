"""A needle study: RULER-style tasks (`needles`) over a grid of context lengths × needle
depths, each cell the mean score of greedy answers to ``samples`` prompts; a table and a heat
map per task (behind ``la-eval --needles``)."""

from __future__ import annotations

import zlib

import numpy as np

from linear_attention.data.needles import NEEDLE_TASKS, make_prompt, string_match_all
from linear_attention.evals.figures import new_figure, save_png
from linear_attention.evals.generation import greedy_until


def check_grid(tasks, lengths, depths, answer_len: int, max_length: int) -> None:
    """ValueError for an unknown task, a depth outside [0, 1] or a length the model cannot
    read (over ``max_length``, or with no room past the answer's ``answer_len`` tokens)."""
    unknown = [t for t in tasks if t not in NEEDLE_TASKS]
    if unknown:
        raise ValueError(f"unknown needle task {unknown[0]!r}; allowed: {', '.join(NEEDLE_TASKS)}")
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad:
        raise ValueError(f"--depths must be in [0, 1], got {bad[0]}")
    for n in lengths:
        if not answer_len < n <= max_length:
            raise ValueError(
                f"--lengths {n}: a context length must be in ({answer_len}, {max_length}] (the "
                f"answer's {answer_len} tokens, the model's max_length)"
            )


def _rng(seed: int, task: str, length: int, depth: float, sample: int):
    return np.random.default_rng(
        [seed, zlib.crc32(task.encode()), length, round(depth * 1e6), sample]
    )


def needle_study(run, tasks, lengths, depths, *, samples: int, sentences, seed: int = 0,
                 answer_len: int = 64, noise=None) -> list[dict]:  # fmt: skip
    """``[{"task", "context_len", "depth", "score", "answers"}]``, one per cell: the mean
    `string_match_all` of ``samples`` greedy answers (each ``answer_len`` tokens at most, cut
    at a newline). ``sentences``: the corpus haystack; ``noise`` the noise one (default
    `needles.NOISE`). Prompts depend only on ``seed`` and the cell."""
    from linear_attention.data.needles import NOISE

    cells = []
    for task in tasks:
        spec = NEEDLE_TASKS[task]
        hay = sentences if spec.haystack == "corpus" else (noise or NOISE)
        for length in lengths:
            for depth in depths:
                scores, answers = [], []
                for s in range(samples):
                    rng = _rng(seed, task, length, depth, s)
                    prompt, expected = make_prompt(spec, rng, run.tokenizer, length, depth, hay,
                                                   answer_len)  # fmt: skip
                    text = greedy_until(run.model, run.tokenizer, run.tokenizer.encode(prompt),
                                        until=["\n"], max_new_tokens=answer_len,
                                        stop_token=run.eot_token_id)  # fmt: skip
                    scores.append(string_match_all(text, expected))
                    answers.append({"expected": expected, "answer": text})
                cells.append({"task": task, "context_len": length, "depth": depth,
                              "score": float(np.mean(scores)), "answers": answers})  # fmt: skip
    return cells


def score_grid(cells: list[dict], task: str):
    """``(lengths, depths, scores float64[lengths, depths] in %)`` of ``task``'s cells."""
    mine = [c for c in cells if c["task"] == task]
    depths = sorted({c["depth"] for c in mine})
    lengths = sorted({c["context_len"] for c in mine})
    grid = np.full((len(lengths), len(depths)), np.nan)
    for c in mine:
        grid[lengths.index(c["context_len"]), depths.index(c["depth"])] = 100 * c["score"]
    return lengths, depths, grid


def table(cells: list[dict], task: str) -> str:
    """A Markdown table of ``task``'s scores (%): a row per context length, a column per
    depth."""
    lengths, depths, grid = score_grid(cells, task)
    lines = [f"| {task} | " + " | ".join(f"depth {d:g}" for d in depths) + " |",
             "|---:|" + "---:|" * len(depths)]  # fmt: skip
    for n, row in zip(lengths, grid, strict=True):
        lines.append(f"| {n} | " + " | ".join(f"{v:.0f}" for v in row) + " |")
    return "\n".join(lines)


def heat_map(path: str, cells: list[dict], task: str) -> None:
    """``task``'s scores as a heat map: context length (rows) × depth (columns), 0–100 %."""
    lengths, depths, grid = score_grid(cells, task)
    fig, ax = new_figure((1.2 + 0.8 * len(depths), 1.2 + 0.5 * len(lengths)))
    image = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("needle depth")
    ax.set_ylabel("context length (tokens)")
    ax.set_title(task)
    for i in range(len(lengths)):
        for j in range(len(depths)):
            ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="score (%)")
    save_png(fig, path)
