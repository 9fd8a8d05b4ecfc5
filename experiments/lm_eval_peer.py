"""Peer check of `LMEvalModel` against lm-evaluation-harness's own ``hf`` backend, and their
log-likelihood throughput, on a transformers fixture imported with ``la-convert``.

    python experiments/lm_eval_peer.py --out docs/results/lm_eval_peer_cpu.json

Both backends run the local tasks of tests/evals/tasks (cloze, multiple choice, rolling
perplexity) through ``simple_evaluate``; every request's log-likelihood and is-greedy are
recorded side by side with the largest relative difference, and the task metrics. The ``hf``
backend gets the fixture's ``tokenizer.json`` as it is (`transformers.PreTrainedTokenizerFast`):
transformers 5 reads that character-level file through the architecture's own tokenizer class,
which drops its spaces, so both backends tokenize alike only this way. The prefix token (the
fixture's tokenizer names none) is 0 on both sides.

Throughput: the same loglikelihood requests (every word of the tasks' texts after the words
before it, truncated to the model's length) scored by each backend, compiled or warmed up
first, then timed in interleaved rounds in one process; tokens/s counts each request's input
tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf", "qwen3_5")
TASK_DIR = os.path.join(ROOT, "tests", "evals", "tasks")
TASKS = ["local_cloze", "local_choice", "local_pages"]


class _Request:
    def __init__(self, *args):
        self.args = args


def hf_model(fixture: str = FIXTURE, batch_size: int = 16):
    """lm-eval's ``hf`` backend on ``fixture`` in float32 on the CPU (module docstring)."""
    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(fixture, "tokenizer.json")
    )
    return HFLM(pretrained=fixture, tokenizer=tokenizer, dtype=torch.float32, device="cpu",
                batch_size=batch_size, prefix_token_id=0)  # fmt: skip


def responses(result: dict) -> dict:
    """``{task: [[doc_id, index, log-likelihood, is-greedy or None], ...]}`` of a result
    dict with samples, in a fixed order."""
    out = {}
    for task, samples in result["samples"].items():
        rows = []
        for sample in samples:
            for index, resp in enumerate(sample["resps"]):
                value = resp[0]
                ll, greedy = value if isinstance(value, list | tuple) else (value, None)
                rows.append([sample["doc_id"], index, float(ll), greedy])
        out[task] = sorted(rows, key=lambda r: (r[0], r[1]))
    return out


def evaluate(model, tasks=TASKS, task_dir: str = TASK_DIR, model_args=None) -> dict:
    """``{"metrics", "requests"}`` of ``simple_evaluate`` on the local tasks (run from the
    checkout's root: the tasks' data files are relative to it); ``model`` an lm-eval model or
    a registered name with ``model_args``."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    here = os.getcwd()
    os.chdir(ROOT)
    try:
        manager = TaskManager(include_path=task_dir, include_defaults=False)
        result = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks),
                                         task_manager=manager, log_samples=True,
                                         bootstrap_iters=0)  # fmt: skip
    finally:
        os.chdir(here)
    metrics = {
        task: {k: v for k, v in values.items() if "," in k and "stderr" not in k}
        for task, values in result["results"].items()
    }
    return {"metrics": metrics, "requests": responses(result)}


def compare(ours: dict, theirs: dict) -> dict:
    """The largest relative difference of the log-likelihoods, is-greedy and the metrics."""
    worst, greedy_same = 0.0, True
    for task, rows in ours["requests"].items():
        for a, b in zip(rows, theirs["requests"][task], strict=True):
            assert a[:2] == b[:2], (a, b)
            worst = max(worst, abs(a[2] - b[2]) / max(abs(b[2]), 1e-30))
            greedy_same &= a[3] == b[3]
    metric_worst = max(
        abs(v - theirs["metrics"][t][k]) / max(abs(theirs["metrics"][t][k]), 1e-30)
        for t, values in ours["metrics"].items()
        for k, v in values.items()
    )
    return {"max_relative_difference": worst, "is_greedy_equal": greedy_same,
            "max_metric_relative_difference": metric_worst}  # fmt: skip


def greedy_requests(theirs, num_tokens: int = 3) -> list:
    """Requests whose continuation is the transformers model's own greedy next tokens after a
    prompt (read off its logits, one character a token), so that is-greedy is True."""
    import torch

    tokenizer, model = theirs.tokenizer, theirs.model
    out = []
    for prompt in ("the cat sat on", "Question: Which is a fruit? Answer:", "Bread is made"):
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
        for _ in range(num_tokens):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        new = ids[-num_tokens:]
        if 0 not in new:  # (the unknown token has no text)
            out.append(_Request(prompt, "".join(tokenizer.convert_ids_to_tokens(new))))
    return out


def compare_greedy(ours, theirs) -> list:
    """``[context, continuation, ours (ll, greedy), hf (ll, greedy)]`` of `greedy_requests`."""
    requests = greedy_requests(theirs)
    a = ours.loglikelihood(requests, disable_tqdm=True)
    b = theirs.loglikelihood(requests, disable_tqdm=True)
    return [[*r.args, list(x), list(y)] for r, x, y in zip(requests, a, b, strict=True)]


def throughput_requests(tokenizer_encode, max_length: int) -> list:
    """Every word of the local tasks' texts after the words before it."""
    texts = []
    for name in ("cloze.jsonl", "pages.jsonl"):
        with open(os.path.join(TASK_DIR, name)) as f:
            texts += [next(iter(json.loads(line).values())) for line in f if line.strip()]
    out = []
    for text in texts:
        words = text.split(" ")
        out += [_Request(" ".join(words[:k]), " " + words[k]) for k in range(1, len(words))]
    return out


def _rounds(models: dict, requests: list, rounds: int) -> dict:
    times = {name: [] for name in models}
    for model in models.values():  # warm-up (compilation)
        model.loglikelihood(requests, disable_tqdm=True)
    for r in range(rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            start = time.perf_counter()
            models[name].loglikelihood(requests, disable_tqdm=True)
            times[name].append(time.perf_counter() - start)
    return times


def throughput(ours, theirs, rounds: int = 5) -> dict:
    import numpy as np

    requests = throughput_requests(ours.tok_encode, ours.max_length)
    pairs = [r.args for r in requests]
    tokens = sum(min(len(ours.tok_encode(c + x)), ours.max_length + 1) - 1 for c, x in pairs)
    times = _rounds({"linear_attention": ours, "hf": theirs}, requests, rounds)
    med = {k: float(np.median(v)) for k, v in times.items()}
    ratios = [a / b for a, b in zip(times["hf"], times["linear_attention"], strict=True)]
    return {
        "requests": len(requests),
        "input_tokens": tokens,
        "batch_tokens": ours.batch_tokens,
        "hf_batch_size": theirs.batch_size,
        "seconds_median": med,
        "tokens_per_second": {k: tokens / v for k, v in med.items()},
        "speedup_median_of_rounds": float(np.median(ratios)),
        "rounds": times,
    }


def converted_workdir(folder: str) -> str:
    """``la-convert --from-hf`` of the fixture into ``folder``/run."""
    from linear_attention.training import convert

    workdir = os.path.join(folder, "run")
    convert.from_hf(FIXTURE, workdir)
    return workdir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch_tokens", type=int, default=1024)
    args = parser.parse_args(argv)
    from linear_attention.evals import LMEvalModel

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        ours = LMEvalModel(converted_workdir(tmp), batch_tokens=args.batch_tokens)
        theirs = hf_model()
        mine, hf = evaluate(ours), evaluate(theirs)
        record = {
            "fixture": os.path.relpath(FIXTURE, ROOT),
            "tasks": TASKS,
            "comparison": compare(mine, hf),
            "greedy_continuations": compare_greedy(ours, theirs),
            "linear_attention": mine,
            "hf": hf,
            "throughput": throughput(ours, theirs, args.rounds),
            "machine": {
                "processor": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "load_before": load_before,
                "python": sys.version.split()[0],
            },
            "commit": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip(),  # fmt: skip
        }
    record["machine"]["load_after"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps({k: record[k] for k in ("comparison", "greedy_continuations")}, indent=1))
    t = record["throughput"]
    print(f"tokens/s {t['tokens_per_second']}; speedup {t['speedup_median_of_rounds']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
