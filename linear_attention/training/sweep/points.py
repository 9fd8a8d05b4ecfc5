"""One grid point: train it (or skip it when finished, resume it when interrupted), measure an
LM's decoding throughput, its state size, and the ``--dry-run`` listing.

A point whose ``summary.json`` exists is skipped (its ``config.json`` must match the grid's),
one without resumes from its latest checkpoint, one that diverged (``failed.json``) is recorded
as such. The state of a softmax model is its KV cache at ``data.seq_len`` (not
``model.max_length``), the context the task needs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention.models import LanguageModel, state_size_bytes, step_fn
from linear_attention.training.config import config_difference, experiment_config
from linear_attention.training.metrics import Reporter, write_json
from linear_attention.training.trainer import NonFiniteLossError, train


def _check_finished(run_dir: Path, cfg) -> None:
    saved = json.loads((run_dir / "config.json").read_text())
    config_dict = json.loads(json.dumps(cfg.to_dict()))
    diff = config_difference(saved, config_dict, cfg)
    if diff:
        raise ValueError(
            f"{run_dir} finished with config.{diff[0]} = {diff[1]!r} but the grid now has "
            f"{diff[2]!r}; use another --workdir (or delete that run) to run the new grid"
        )


def model_config_at(cfg, context: int):
    """The run's `ModelConfig` with ``max_length`` = the context (sizes the softmax cache)."""
    return dataclasses.replace(cfg.model, max_length=context)


@functools.cache
def _state_size_bytes(model_cfg) -> int:
    return state_size_bytes(model_cfg)


def state_bytes(cfg) -> int:
    """Decoding state per sequence of the run's model at its training context, in bytes
    (softmax: a KV cache of ``data.seq_len`` tokens); cached per model config."""
    return _state_size_bytes(model_config_at(cfg, cfg.data.seq_len))


def measure_decode(cfg, batch_size: int) -> dict:
    """Decoding throughput of a fresh model of ``cfg.model``: ``step`` over a whole
    ``data.seq_len`` context from an empty state, after one compiling step."""
    model_cfg = model_config_at(cfg, cfg.data.seq_len)
    model = LanguageModel(model_cfg, rngs=nnx.Rngs(cfg.seed))
    step = step_fn(model)
    tokens_B = jnp.full((batch_size,), 32, jnp.int32)
    num_tokens = cfg.data.seq_len
    jax.block_until_ready(step(tokens_B, model.init_state(batch_size, num_tokens)))  # compile
    state = model.init_state(batch_size, num_tokens)
    start = time.perf_counter()
    for _ in range(num_tokens):
        logits_BV, state = step(tokens_B, state)
    jax.block_until_ready(logits_BV)
    seconds = time.perf_counter() - start
    return {
        "decode_tokens_per_sec": batch_size * num_tokens / seconds,
        "decode_ms_per_step": 1e3 * seconds / num_tokens,
        "decode_batch_size": batch_size,
        "decode_context": num_tokens,
        "decode_weights": "fresh model of the same config",
    }


def is_finished(run_dir: Path) -> bool:
    return (run_dir / "summary.json").exists() or (run_dir / "failed.json").exists()


def run_point(config, run_dir: Path, *, decode_batch_size: int, log=print) -> str:
    """Train (or skip / resume) one point's config; returns its status: done, skipped or
    diverged."""
    cfg = experiment_config(config)
    summary_path, failed_path = run_dir / "summary.json", run_dir / "failed.json"
    if summary_path.exists() or failed_path.exists():
        _check_finished(run_dir, cfg)
        status = "skipped"
        log("  skipped (finished)")
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with open(run_dir / "train.log", "a") as stream:
            reporter = Reporter(cfg.train.num_steps, stream=stream, tty=False)
            try:
                train(cfg, str(run_dir), reporter=reporter)
                status = "done"
            except NonFiniteLossError as e:
                write_json(str(failed_path), {"error": str(e)})
                status = "diverged"
        log(f"  {status} in {time.perf_counter() - start:.0f} s")
    if (
        cfg.data.SWEEP_REPORT == "language"
        and summary_path.exists()
        and not (run_dir / "decode.json").exists()
    ):
        write_json(str(run_dir / "decode.json"), measure_decode(cfg, decode_batch_size))
    return status


def dry_run(axes, points, log=print) -> None:
    cache = {}
    log(f"{len(points)} points; axes: " + ", ".join(f"{a.name} {list(a.labels)}" for a in axes))
    for point in points:
        cfg = experiment_config(point.config)
        key = (cfg.model, cfg.data.seq_len)
        if key not in cache:
            # the model as trained (learned positions: max_length rows); the state at the
            # training context (softmax: a KV cache of seq_len tokens), as in results.csv
            abstract = nnx.eval_shape(lambda m=cfg.model: LanguageModel(m, rngs=nnx.Rngs(0)))
            params = sum(
                int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param))
            )
            cache[key] = (params, state_bytes(cfg))
        params, state = cache[key]
        log(
            f"  {point.name}: {params:,} params, state {state:,} B, "
            f"{cfg.train.num_steps} steps x {cfg.tokens_per_step} tokens"
        )
