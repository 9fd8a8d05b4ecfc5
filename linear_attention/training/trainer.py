"""`train(config, workdir)`: the training loop.

One jitted step (split/merge with the model's `GraphDef` static, the state donated) computes
the masked cross-entropy over labelled positions, its gradient, and the optax update. Every
random choice is keyed by the step: the batch of step s comes from a generator seeded by
``(seed, s)`` and the favor redraw before step s from the seed's key folded with s, so a run
resumed from a checkpoint at step c replays steps c+1... exactly as an uninterrupted run.

Workdir: ``config.json``, ``metrics.jsonl``, ``checkpoints/`` (orbax), ``summary.json``. A run
holds the workdir's lock (``.lock``) while it runs, and resumes from the newest checkpoint that
passes its integrity check (see `workdir` and `checkpoint`); a workdir or config that cannot be
resumed raises `RunError` (``la-train``: exit 2) before anything is overwritten.
Losses and gradient norms are checked at every flush (log, eval and checkpoint steps); a
non-finite value stops the run naming the step, before anything is saved after it.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from linear_attention.data import IGNORE_INDEX, MQARData
from linear_attention.data.sources import text_source, token_file_source
from linear_attention.data.tokenizers import bits_per_byte, label_bytes
from linear_attention.models import LanguageModel, ModelConfig, generate, redraw_features
from linear_attention.models.tokens import check_token_ids
from linear_attention.training.checkpoint import Checkpoints
from linear_attention.training.config import (
    ExperimentConfig,
    config_difference,
    experiment_config,
)
from linear_attention.training.mesh import (
    check_batch_size,
    initialize_distributed,
    make_mesh,
    sequence_parallel_stats,
    shard_batch,
    shard_local_batch,
    state_shardings,
)
from linear_attention.training.metrics import MetricsWriter, Reporter, write_json
from linear_attention.training.optim import make_optimizer
from linear_attention.training.tensorboard import Profiler, TensorBoardWriter
from linear_attention.training.workdir import RunError, WorkdirLock, prepare_workdir

# Independent random streams derived from the seed.
_REDRAW_STREAM, _SAMPLE_STREAM = 1, 2
# Sections of config.json that a resumed run must share with the run it continues.
_FIXED_SECTIONS = ("seed", "model", "data")


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN/Inf loss or gradient norm."""


class ResumeConfigError(RunError):
    """The workdir holds a run whose seed/model/data differ from the config given."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run; a checkpoint at ``step`` was saved first."""

    def __init__(self, step: int, signal_name: str):
        super().__init__(f"{signal_name} at step {step}: checkpoint saved")
        self.step = step


class _StopSignals:
    """While active, SIGINT and SIGTERM set ``received`` instead of killing the process, so the
    loop can finish its step and save a checkpoint; a second signal stops at once. Only in the
    main thread (elsewhere signals cannot be caught, and nothing changes)."""

    def __init__(self, reporter: Reporter):
        self.reporter, self.received, self._previous = reporter, None, {}
        self._announced = False

    def _handle(self, signum, frame):
        # Only set a flag: a handler that writes to a stream the loop is writing to raises
        # "reentrant call" (issue 23), so the loop prints the message (`announce`).
        if self.received is not None:  # a second signal: do not wait any longer
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def announce(self) -> None:
        """Called by the loop between steps: says once that a signal arrived."""
        if self.received is not None and not self._announced:
            self._announced = True
            self.reporter.message(
                f"{self.received} received: saving a checkpoint after this step "
                "(send it again to stop now)"
            )

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def build_data(config: ExperimentConfig, *, cache_dir: str | None = None, message=None):
    """The data source of ``config.data``: MQAR, text (`sources.text_source`; tokenized text
    cached in ``cache_dir``) or a token file (`sources.token_file_source`)."""
    d = config.data
    if d.kind == "mqar":
        return MQARData(
            vocab_size=d.vocab_size,
            seq_len=d.seq_len,
            num_kv_pairs=d.num_kv_pairs,
            num_train_examples=d.num_train_examples,
            num_test_examples=d.num_test_examples,
            power_a=d.power_a,
            random_non_queries=d.random_non_queries,
            seed=config.seed,
        )
    common = dict(
        seq_len=d.seq_len,
        val_fraction=d.val_fraction,
        num_val_windows=d.num_val_windows,
        seed=config.seed,
        batch_size=config.train.batch_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    if d.kind == "tokens":
        return token_file_source(
            path=d.path,
            token_dtype=d.token_dtype,
            vocab_size=config.model.vocab_size,
            tokenizer=d.tokenizer,
            **common,
        )
    return text_source(
        path=d.path,
        tokenizer=d.tokenizer,
        text_field=d.text_field,
        loader=d.loader,
        max_bytes=d.max_bytes or None,
        pack=d.pack,
        separator=d.separator_bytes,
        cache_dir=cache_dir,
        message=message,
        **common,
    )


def build_model(config: ExperimentConfig, tx: optax.GradientTransformation):
    """``(model, optimizer)``: the model from ``config.seed``, AdamW over its `nnx.Param`s."""
    model = LanguageModel(config.model, rngs=nnx.Rngs(config.seed))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def checked(batch: dict, model: ModelConfig, where: str) -> dict:
    """``batch`` once its inputs are token ids of the model and its labels too (or
    ``IGNORE_INDEX``); `RunError` naming the bad id and ``where`` otherwise."""
    try:
        check_token_ids(batch["inputs"], model.vocab_size, name=f"inputs of {where}")
        labels = np.asarray(batch["labels"])
        check_token_ids(
            np.where(labels == IGNORE_INDEX, 0, labels), model.vocab_size, name=f"labels of {where}"
        )
    except ValueError as e:
        raise RunError(f"the data do not fit config.model: {e}") from None
    return batch


def token_stats(logits_BTV: jax.Array, labels_BT: jax.Array):
    """``(sum of cross-entropy, number correct, number labelled)`` over labelled positions
    (``labels != IGNORE_INDEX``), in float32."""
    mask_BT = labels_BT != IGNORE_INDEX
    safe_BT = jnp.where(mask_BT, labels_BT, 0)
    ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), safe_BT)
    correct_BT = (jnp.argmax(logits_BTV, axis=-1) == labels_BT) & mask_BT
    return (
        jnp.sum(jnp.where(mask_BT, ce_BT, 0.0)),
        jnp.sum(correct_BT, dtype=jnp.float32),
        jnp.sum(mask_BT, dtype=jnp.float32),
    )


@functools.partial(
    jax.jit, static_argnames=("graphdef", "mesh", "fsdp"), donate_argnames=("state",)
)
def train_step(state, batch, *, graphdef, mesh, fsdp):
    """One optimizer step: ``(state, batch) -> (state, metrics)``; loss = mean cross-entropy
    over the labelled positions of the whole (global) batch. A batch with ``segment_ids``
    (packed documents) is run with them."""
    model, optimizer = nnx.merge(graphdef, state)

    def loss_fn(model):
        loss_sum, correct, count = model_stats(model, batch, mesh)
        count = jnp.maximum(count, 1.0)
        return loss_sum / count, correct / count

    (loss, accuracy), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    new_state = nnx.state((model, optimizer))
    new_state = jax.lax.with_sharding_constraint(new_state, state_shardings(new_state, mesh, fsdp))
    metrics = {
        "train/loss": loss,
        "train/accuracy": accuracy,
        "grad_norm": optax.tree.norm(grads),
    }
    return new_state, metrics


def model_stats(model, batch, mesh=None):
    """`token_stats` of the model on ``batch`` (with its ``segment_ids`` if packed); with a
    ``seq`` mesh axis over more than one device, time split over it (sequence parallelism)."""

    def stats(model, batch):
        return token_stats(model(batch["inputs"], batch.get("segment_ids")), batch["labels"])

    if mesh is None or mesh.shape.get("seq", 1) == 1:
        return stats(model, batch)
    if "segment_ids" in batch:
        raise ValueError("packed rows (segment_ids) with a split time axis are not supported")
    return sequence_parallel_stats(stats, model, batch, mesh)


@functools.partial(jax.jit, static_argnames=("graphdef", "mesh"))
def eval_step(state, batch, *, graphdef, mesh=None):
    model, _ = nnx.merge(graphdef, state)
    return model_stats(model, batch, mesh)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "mesh", "fsdp"), donate_argnames=("state",)
)
def redraw_step(state, key, *, graphdef, mesh, fsdp):
    """Redraw the random projections of every favor layer from ``key``."""
    model, optimizer = nnx.merge(graphdef, state)
    redraw_features(model, key)
    new_state = nnx.state((model, optimizer))
    return jax.lax.with_sharding_constraint(new_state, state_shardings(new_state, mesh, fsdp))


def evaluate(state, data, config: ExperimentConfig, graphdef, mesh) -> dict[str, float]:
    """Mean loss and accuracy over every labelled position of the evaluation set (for MQAR:
    the query positions only); bits per byte for text."""
    token_bytes = getattr(data, "token_bytes", None)  # None: MQAR, tokens of no tokenizer
    sums, num_bytes = [], 0
    for b in data.eval_batches(config.train.eval_batch):
        if token_bytes is not None:
            num_bytes += label_bytes(b["labels"], token_bytes)
        sums.append(
            eval_step(
                state,
                shard_batch(checked(b, config.model, "an eval batch"), mesh),
                graphdef=graphdef,
                mesh=mesh,
            )
        )
    loss_sum, correct, count = np.asarray(jax.device_get(sums), np.float64).sum(axis=0).tolist()
    out = {"eval/loss": loss_sum / max(count, 1.0), "eval/accuracy": correct / max(count, 1.0)}
    if token_bytes is not None:
        out["eval/bits_per_byte"] = bits_per_byte(loss_sum, count, num_bytes)
    return out


def _check_resume_config(path: str, current: dict, cfg: ExperimentConfig) -> None:
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            previous = json.load(f)
        if not isinstance(previous, dict):
            raise ValueError(f"a JSON {type(previous).__name__}, not an object")
    except (OSError, ValueError) as e:
        raise RunError(
            f"{path} is damaged ({e}); it records the run this workdir holds: restore it, or "
            "use another workdir"
        ) from None
    # (a field added to the code since the run was saved, at its default, is no difference)
    fixed = {section: previous.get(section) for section in _FIXED_SECTIONS}
    diff = config_difference(fixed, {section: current[section] for section in _FIXED_SECTIONS}, cfg)
    if diff:
        name, old, new = diff
        raise ResumeConfigError(
            f"{os.path.dirname(path)} holds a run with config.{name} = {old!r}, but this config "
            f"has {new!r}; resume with the same {'/'.join(_FIXED_SECTIONS)} or use another workdir"
        )


def _read_summary(path: str, reporter: Reporter) -> dict | None:
    """A finished run's summary, or None if there is none or it is damaged (then it is
    rewritten by a final evaluation)."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            summary = json.load(f)
        if isinstance(summary, dict):
            return summary
    except (OSError, ValueError):
        pass
    reporter.message(f"{path} is damaged: evaluating the final checkpoint again to rewrite it")
    return None


def _param_count(abstract_model) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract_model, nnx.Param)))


def _sample(state, graphdef, config: ExperimentConfig, tokenizer) -> str:
    model, _ = nnx.merge(graphdef, state)
    prompt = tokenizer.encode(config.train.sample_prompt).astype(np.int32)
    tokens = generate(
        model,
        prompt[None],
        config.train.sample_tokens,
        rng=jax.random.fold_in(jax.random.key(config.seed), _SAMPLE_STREAM),
        temperature=config.train.sample_temperature,
        top_k=config.train.sample_top_k or None,
    )
    new = np.asarray(jax.device_get(tokens))[0]
    return tokenizer.decode(np.concatenate([prompt, new]))


def train(config, workdir: str, *, reporter: Reporter | None = None) -> dict:
    """Train (or resume) the run described by ``config`` in ``workdir``; returns the summary.

    ``config`` is a ConfigDict (validated here, before anything is built) or an
    `ExperimentConfig`. Rerunning on the same workdir continues from the latest checkpoint.
    """
    start_time = time.perf_counter()
    cfg = experiment_config(config)
    tc = cfg.train
    initialize_distributed(cfg.mesh)
    try:
        mesh = make_mesh(cfg.mesh.num_devices, cfg.mesh.seq)
        check_batch_size("train.batch_size", tc.batch_size, mesh)
        check_batch_size("train.eval_batch_size", tc.eval_batch, mesh)
    except ValueError as e:
        raise RunError(str(e)) from None
    fsdp = cfg.mesh.fsdp
    lead = jax.process_index() == 0
    reporter = reporter or Reporter(tc.num_steps)

    prepare_workdir(workdir)
    lock = WorkdirLock(workdir, message=reporter.message)
    if lead:
        lock.acquire()  # one run per workdir; released in `finally`
    checkpoints, writers, profiler = None, [], None
    try:
        config_dict = json.loads(json.dumps(cfg.to_dict()))
        _check_resume_config(os.path.join(workdir, "config.json"), config_dict, cfg)
        try:
            cache = os.path.join(workdir, "token_cache")
            data = build_data(cfg, cache_dir=cache, message=reporter.message)
        except ValueError as e:
            raise RunError(f"config.data: {e}") from None

        tx, schedule = make_optimizer(cfg.optimizer, tc.num_steps)
        abstract_model, abstract_opt = nnx.eval_shape(lambda: build_model(cfg, tx))
        graphdef, abstract_state = nnx.split((abstract_model, abstract_opt))
        shardings = state_shardings(abstract_state, mesh, fsdp)
        param_count = _param_count(abstract_model)

        checkpoints = Checkpoints(os.path.join(workdir, "checkpoints"), keep=tc.keep_checkpoints)
        latest = checkpoints.latest_step() or 0
        if latest > tc.num_steps:
            raise RunError(
                f"{workdir!r} holds a checkpoint at step {latest}, past config.train.num_steps = "
                f"{tc.num_steps}: this run is already past num_steps (rerun with num_steps >= "
                f"{latest} to continue it, or use another workdir)"
            )
        summary_path = os.path.join(workdir, "summary.json")
        summary = None
        if latest and checkpoints.verify(latest) is None:
            summary = _read_summary(summary_path, reporter)
        # Finished: trained to num_steps, or stopped early at `latest` by a criterion that
        # still holds (a raised or disabled threshold trains on).
        stopped = summary is not None and summary.get("stopped_early") and tc.should_stop(summary)
        if (
            summary is not None
            and summary.get("step") == latest
            and (latest == tc.num_steps or stopped)
        ):
            # Nothing to train: the finished run's summary (and its timings) stay as they are.
            reporter.message(
                f"{workdir} is already trained to step {latest} (config.train.num_steps = "
                f"{tc.num_steps}{', stopped early' if latest < tc.num_steps else ''}): "
                "nothing to do; its summary.json is kept"
            )
            return summary
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            abstract_state,
            shardings,
        )
        start, state = checkpoints.restore_latest(target, message=reporter.message)
        if start:
            reporter.message(f"resuming from step {start} ({checkpoints.directory})")
            if hasattr(data, "restore_iterator"):  # a loader with a state (Grain)
                data_state = checkpoints.data_state(start)
                if data_state is None:
                    raise RunError(
                        f"checkpoint step {start} in {checkpoints.directory} holds no data "
                        "iterator state, which config.data's loader needs to resume"
                    )
                data.restore_iterator(data_state)
        else:
            state = jax.device_put(nnx.state(build_model(cfg, tx)), shardings)
        if lead:  # only once the config is known to fit the saved run
            write_json(os.path.join(workdir, "config.json"), config_dict)
        metrics_path = os.path.join(workdir, "metrics.jsonl")
        if lead:
            writers = [
                MetricsWriter(metrics_path, resume_step=start, message=reporter.message),
                TensorBoardWriter(workdir, resume_step=start),
            ]
        profiler = Profiler(workdir, first=start + 1, num_steps=tc.profile_steps)
        reporter.message(
            f"{param_count:,} parameters, {mesh.devices.size} device(s) "
            f"(data {mesh.shape['data']} × seq {mesh.shape['seq']}), "
            f"steps {start}..{tc.num_steps}"
        )
        with _StopSignals(reporter) as stop:
            summary = _loop(
                cfg,
                data,
                state,
                graphdef=graphdef,
                mesh=mesh,
                fsdp=fsdp,
                schedule=schedule,
                checkpoints=checkpoints,
                writers=writers,
                reporter=reporter,
                start=start,
                stop=stop,
                profiler=profiler,
            )
        state = summary.pop("_state")
        summary.update(
            workdir=os.path.abspath(workdir),
            param_count=param_count,
            num_devices=int(mesh.devices.size),
            resumed_from_step=start,
            wall_time_sec=time.perf_counter() - start_time,
        )
        if getattr(data, "provenance", None):  # what the corpus was (LM figures depend on it)
            summary["corpus"] = data.provenance
        if tc.sample_tokens:
            summary["sample"] = _sample(state, graphdef, cfg, data.tokenizer)
            reporter.message(f"sample:\n{summary['sample']}")
        if lead:
            write_json(os.path.join(workdir, "summary.json"), summary)
        return summary
    finally:
        if profiler is not None:
            profiler.close()
        for writer in writers:
            writer.close()
        if checkpoints is not None:
            checkpoints.close()
        reporter.close()
        lock.release()


def _loop(
    cfg,
    data,
    state,
    *,
    graphdef,
    mesh,
    fsdp,
    schedule,
    checkpoints,
    writers,
    reporter,
    start,
    stop,
    profiler,
):
    """Steps `start`..num_steps: log, evaluate, checkpoint, stop early or on a signal. Returns
    the summary, with the final state under "_state" (keyword-only past `state`: 13 arguments)."""
    tc = cfg.train
    key = jax.random.key(cfg.seed)
    redraw = cfg.model.redraw_interval
    tokens_per_step = cfg.tokens_per_step
    pending = []  # (step, device metrics, timed?) not yet checked for finiteness
    since_log = []  # host metrics since the last log record
    mark = time.perf_counter()  # start of the current timed interval
    log_steps, log_time = 0, 0.0  # timed steps and seconds since the last log record
    total_steps, total_time, compile_time = 0, 0.0, 0.0
    record, last = {}, {}
    done, stopped_early = start, False

    for s in range(start, tc.num_steps):
        if redraw and s > 0 and s % redraw == 0:
            state = redraw_step(
                state,
                jax.random.fold_in(jax.random.fold_in(key, _REDRAW_STREAM), s),
                graphdef=graphdef,
                mesh=mesh,
                fsdp=fsdp,
            )
        batch = data.train_batch(s, tc.batch_size)
        batch = checked(batch, cfg.model, f"the batch of step {s + 1}")
        local = getattr(data, "process_local", False)  # each process holds its own rows
        batch = shard_local_batch(batch, mesh) if local else shard_batch(batch, mesh)
        profiler.before_step(s)
        state, metrics = train_step(state, batch, graphdef=graphdef, mesh=mesh, fsdp=fsdp)
        done = s + 1
        pending.append((done, metrics))
        traced = profiler.after_step(done, metrics)
        if traced:
            reporter.message(traced)
        if s == start:
            # The first step compiles: keep it out of the throughput figures.
            jax.block_until_ready(metrics)
            compile_time = time.perf_counter() - mark
            mark = time.perf_counter()
            timed = 0
        else:
            timed += 1

        final = done == tc.num_steps
        do_log = done % tc.log_every == 0 or final
        do_eval = done % tc.eval_every == 0 or final
        # A stop signal: check and save what was trained, then stop (no extra log record, so
        # the resumed run's metrics.jsonl matches an uninterrupted one's).
        stop.announce()
        interrupted = stop.received is not None and not final
        do_ckpt = done % tc.checkpoint_every == 0 or final or interrupted
        if not (do_log or do_eval or do_ckpt):
            continue

        values = jax.device_get([m for _, m in pending])
        now = time.perf_counter()
        for (step, _), v in zip(pending, values, strict=True):
            bad = {k: float(x) for k, x in v.items() if not np.isfinite(x)}
            if bad:
                raise NonFiniteLossError(
                    f"non-finite {bad} at step {step}: stopped; the last good checkpoint "
                    f"(step {checkpoints.latest_step()}) is kept in {checkpoints.directory}"
                )
        since_log.extend(values)
        pending.clear()
        log_steps, log_time = log_steps + timed, log_time + (now - mark)
        total_steps, total_time = total_steps + timed, total_time + (now - mark)
        timed = 0
        record = {"step": done}
        if do_log:
            record.update({k: float(np.mean([v[k] for v in since_log])) for k in since_log[0]})
            record["lr"] = float(schedule(done - 1))
            if log_steps:  # (none when the interval holds only the compiling first step)
                record["tokens_per_sec"] = log_steps * tokens_per_step / log_time
            last = {k: record[k] for k in ("train/loss", "train/accuracy")}
            since_log, log_steps, log_time = [], 0, 0.0
        if do_eval:
            record.update(evaluate(state, data, cfg, graphdef, mesh))
            stopped_early = not final and tc.should_stop(record)
        if do_log or do_eval:
            for writer in writers:
                writer.write(record)
            reporter.record(record)
        if do_ckpt or stopped_early:
            data_state = data.iterator_state() if hasattr(data, "iterator_state") else None
            checkpoints.save(done, state, data_state=data_state)
        if interrupted:
            raise Interrupted(done, stop.received)
        if stopped_early:
            reporter.message(f"early stop at step {done}: {tc.stop_metric} meets {tc.stop_at}")
            break
        mark = time.perf_counter()  # eval and checkpoint time is not training time

    if start >= tc.num_steps:  # already complete: just report the final evaluation
        record = {"step": tc.num_steps, **evaluate(state, data, cfg, graphdef, mesh)}
        reporter.record(record)
    summary = {k: v for k, v in record.items() if k.startswith("eval/")}
    summary.update(last)
    summary.update(step=done, steps_this_run=done - start, _state=state)
    summary["stopped_early"] = stopped_early
    if total_steps:  # timings only when steps were timed (never a 0.0 from a no-op rerun)
        summary.update(
            compile_time_sec=compile_time,
            train_time_sec=total_time,
            tokens_per_sec=total_steps * tokens_per_step / total_time,
        )
    return summary
