"""`train(config, workdir)`: the training loop.

One jitted step (`steps.train_step`: split/merge with the model's `GraphDef` static, the state
donated) computes the masked cross-entropy over labelled positions, its gradient, and the optax
update. Every random choice is keyed by the step: the batch of step s comes from a generator
seeded by ``(seed, s)`` and the favor redraw before step s from the seed's key folded with s, so
a run resumed from a checkpoint at step c replays steps c+1... exactly as an uninterrupted run.

Workdir: ``config.json``, ``metrics.jsonl``, ``checkpoints/`` (orbax), ``summary.json``. A run
holds the workdir's lock (``.lock``) while it runs, and resumes from the newest checkpoint that
passes its integrity check (see `workdir` and `checkpoint`); a workdir or config that cannot be
resumed raises `RunError` (``la-train``: exit 2) before anything is overwritten.
Losses and gradient norms are checked at every flush (log, eval and checkpoint steps); a
non-finite value stops the run naming the step, before anything is saved after it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import jax
import numpy as np
from flax import nnx

from linear_attention.models import generate
from linear_attention.training.checkpoint import Checkpoints
from linear_attention.training.config import ExperimentConfig, experiment_config
from linear_attention.training.evaluation import evaluate
from linear_attention.training.flops import flops_per_token
from linear_attention.training.load import build_model, initialize_from
from linear_attention.training.machine import machine_info
from linear_attention.training.mesh import (
    check_train_batches,
    initialize_distributed,
    make_mesh,
    shard_batch,
    shard_local_batch,
    state_shardings,
)
from linear_attention.training.metrics import MetricsWriter, Reporter, Throughput, write_json
from linear_attention.training.optim import make_optimizer
from linear_attention.training.resume import (
    FIXED_SECTIONS,
    check_resume_config,
    compare_fixed,
    read_summary,
)
from linear_attention.training.run_data import build_data, checked, data_changes, data_record
from linear_attention.training.signals import Interrupted, StopSignals
from linear_attention.training.steps import redraw_step, train_step
from linear_attention.training.tensorboard import Profiler, TensorBoardWriter
from linear_attention.training.workdir import RunError, WorkdirLock, prepare_workdir

# Tests and scripts patch or call these through this module: the loop looks them up here.
__all__ = [
    "Interrupted",
    "NonFiniteLossError",
    "Run",
    "build_data",
    "build_model",
    "checked",
    "evaluate",
    "experiment_config",
    "train",
    "train_step",
]

# Independent random streams derived from the seed.
_REDRAW_STREAM, _SAMPLE_STREAM = 1, 2


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN/Inf loss or gradient norm."""


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


def train(
    config,
    workdir: str,
    *,
    reporter: Reporter | None = None,
    allow_data_change: bool = False,
) -> dict:
    """Train (or resume) the run described by ``config`` in ``workdir``; returns the summary.

    ``config`` is a ConfigDict (validated here, before anything is built) or an
    `ExperimentConfig`. Rerunning on the same workdir continues from the latest checkpoint.
    Every checkpoint records the seed/model/data config and what the data are (`data_record`:
    the corpus's SHA-256, the token file's digest, the tokenizer's SHA-256 and vocabulary); a
    resume whose data differ raises `RunError` naming what changed, unless
    ``allow_data_change`` (then it is said, and the run goes on). A workdir whose
    ``config.json`` is gone is checked against its checkpoint's record.
    """
    started = time.perf_counter()
    cfg = experiment_config(config)
    initialize_distributed(cfg.mesh)
    try:
        mesh = make_mesh(cfg.mesh.num_devices, cfg.mesh.seq, model=cfg.mesh.model)
        check_train_batches(cfg.train, mesh)
    except ValueError as e:
        raise RunError(str(e)) from None
    reporter = reporter or Reporter(cfg.train.num_steps)
    prepare_workdir(workdir)
    lock = WorkdirLock(workdir, message=reporter.message)
    if jax.process_index() == 0:
        lock.acquire()  # one run per workdir
    with contextlib.ExitStack() as closing:  # closed in reverse: the lock last
        closing.callback(lock.release)
        closing.callback(reporter.close)
        with StopSignals(reporter) as stop:  # (from the building on: `stop_before_training`)
            run = Run(
                cfg,
                workdir,
                mesh,
                reporter,
                closing,
                started=started,
                allow_data_change=allow_data_change,
            )
            if run.finished is not None:
                return run.finished
            stop.stop_before_training()
            run.loop(stop)
        return run.finish()


class Run:
    """One session of a run: what `train` builds (data, mesh, the model's `GraphDef` and
    state, checkpoints, writers) and what the loop carries (the state, the last step done,
    the last record, the timings).

    The loop (`loop`) runs steps `start`..num_steps; after each it asks which periodic actions
    are due (log, evaluate, checkpoint, or a stop signal), and when any is, it first checks the
    steps since the last one for non-finite values (`_flush`), then runs them. Each action is
    one method; the step itself (redraw, batch, update) is `_step`.
    """

    def __init__(
        self,
        cfg,
        workdir,
        mesh,
        reporter,
        closing,
        *,
        started: float,
        allow_data_change: bool = False,
    ):
        self.cfg, self.workdir, self.mesh, self.reporter = cfg, workdir, mesh, reporter
        self.fsdp, self.lead = cfg.mesh.fsdp, jax.process_index() == 0
        self.started = started
        config_dict = json.loads(json.dumps(cfg.to_dict()))
        self.fixed = {section: config_dict[section] for section in FIXED_SECTIONS}
        self.config_dict = config_dict
        had_config = check_resume_config(os.path.join(workdir, "config.json"), config_dict, cfg)
        self._build_data()
        tx, self.schedule = make_optimizer(cfg.optimizer, cfg.train.num_steps)
        abstract_state, shardings = self._build_abstract(tx)
        self._open_checkpoints(closing, had_config, allow_data_change)
        self.finished = self._finished_summary()
        if self.finished is not None:
            return
        self._restore(tx, abstract_state, shardings)
        self._start_session(closing)
        self._announce()

    def _build_data(self) -> None:
        try:
            cache = os.path.join(self.workdir, "token_cache")
            self.data = build_data(self.cfg, cache_dir=cache, message=self.reporter.message)
        except ValueError as e:
            raise RunError(f"config.data: {e}") from None

    def _build_abstract(self, tx):
        """The model's `GraphDef`, size and FLOPs from its abstract shapes (nothing allocated);
        returns ``(abstract_state, shardings)``."""
        cfg = self.cfg
        abstract_model, abstract_opt = nnx.eval_shape(lambda: build_model(cfg, tx))
        self.graphdef, abstract_state = nnx.split((abstract_model, abstract_opt))
        shardings = state_shardings(abstract_state, self.mesh, self.fsdp)
        self.param_count = _param_count(abstract_model)
        try:
            self.flops = flops_per_token(abstract_model, cfg.data.seq_len)
        except ValueError as e:  # a mixer without a count: no FLOPs or MFU, said once
            self.flops = None
            self.reporter.message(f"FLOPs per token and MFU are not logged: {e}")
        return abstract_state, shardings

    def _open_checkpoints(self, closing, had_config: bool, allow_data_change: bool) -> None:
        self.checkpoints = Checkpoints(
            os.path.join(self.workdir, "checkpoints"), keep=self.cfg.train.keep_checkpoints
        )
        closing.callback(self.checkpoints.close)
        self.data_record = data_record(self.data.provenance)
        latest = self.checkpoints.latest_step()
        if latest:
            self._check_saved(self.checkpoints.meta(latest), latest, had_config, allow_data_change)

    def _restore(self, tx, abstract_state, shardings) -> None:
        """``start`` and ``state``: the latest checkpoint's (with the data iterator's state),
        or step 0 and a new model."""
        reporter = self.reporter
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            abstract_state,
            shardings,
        )
        self.start, self.state = self.checkpoints.restore_latest(target, message=reporter.message)
        if self.start:
            reporter.message(f"resuming from step {self.start} ({self.checkpoints.directory})")
            if self.data.stateful:  # a loader with a state (Grain)
                data_state = self.checkpoints.data_state(self.start)
                if data_state is None:
                    raise RunError(
                        f"checkpoint step {self.start} in {self.checkpoints.directory} holds no "
                        "data iterator state, which config.data's loader needs to resume"
                    )
                self.data.restore_iterator(data_state)
        else:
            model, optimizer = build_model(self.cfg, tx)
            if self.cfg.train.init_from:
                initialize_from(model, self.cfg.train.init_from)
                reporter.message(f"parameters from {self.cfg.train.init_from} (init_from)")
            self.state = jax.device_put(nnx.state((model, optimizer)), shardings)

    def _start_session(self, closing) -> None:
        """What the loop carries, ``config.json``, the metrics writers and the profiler."""
        cfg, workdir, reporter = self.cfg, self.workdir, self.reporter
        meta = self.checkpoints.meta(self.start) if self.start else {}
        self.throughput = Throughput(cfg.tokens_per_step, meta.get("timings"), started=self.started)
        self.done, self.stopped_early = self.start, False
        self.record, self.last_train = {}, {}
        self.pending, self.since_log = [], []  # device metrics not yet checked; host ones
        self.key = jax.random.key(cfg.seed)

        if self.lead:  # only once the config is known to fit the saved run
            write_json(os.path.join(workdir, "config.json"), self.config_dict)
        self.writers = []
        if self.lead:
            metrics_path = os.path.join(workdir, "metrics.jsonl")
            self.writers = [
                MetricsWriter(metrics_path, resume_step=self.start, message=reporter.message),
                TensorBoardWriter(workdir, resume_step=self.start),
            ]
        for writer in self.writers:
            closing.callback(writer.close)
        self.profiler = Profiler(workdir, first=self.start + 1, num_steps=cfg.train.profile_steps)
        closing.callback(self.profiler.close)

    def _announce(self) -> None:
        cfg, mesh, reporter = self.cfg, self.mesh, self.reporter
        reporter.message(
            f"{self.param_count:,} parameters, {mesh.devices.size} device(s) "
            f"(data {mesh.shape['data']} × seq {mesh.shape['seq']} × model "
            f"{mesh.shape['model']}), "
            f"steps {self.start}..{cfg.train.num_steps}"
        )
        if cfg.mesh.target:  # the slice --dry_run sized the run for; a run uses what it sees
            reporter.message(
                f"config.mesh.target = {cfg.mesh.target!r} is what --dry_run compiles for; this "
                f"run trains on the visible {jax.devices()[0].device_kind} device(s)"
            )
        if self.flops is not None:
            parts = ", ".join(f"{k} {v:.3g}" for k, v in self.flops.items() if k != "total")
            reporter.message(f"{self.flops['total']:.4g} train FLOPs per token ({parts})")

    def _check_saved(self, meta: dict, step: int, had_config: bool, allow_data_change: bool):
        """What checkpoint ``step`` records (its ``meta``) against this run: the config, when
        ``config.json`` is gone, and the data (`data_changes`), which stop the run unless
        ``allow_data_change``."""
        where = f"checkpoint step {step} in {self.checkpoints.directory}"
        if not had_config:
            if not isinstance(meta.get("config"), dict):
                raise RunError(
                    f"{self.workdir} holds checkpoints but no config.json, and {where} records "
                    "no config to check this one against: restore config.json, or use another "
                    "workdir"
                )
            compare_fixed(meta["config"], self.fixed, self.cfg, self.workdir)
            if self.lead:  # (a finished run returns before the usual write)
                write_json(os.path.join(self.workdir, "config.json"), self.config_dict)
            self.reporter.message(
                f"{self.workdir}/config.json is missing: checked the config against {where} "
                "and wrote it again"
            )
        saved = meta.get("data")
        if not isinstance(saved, dict) or self.data_record is None:
            return
        changes = data_changes(saved, self.data_record)
        if not changes:
            return
        if not allow_data_change:
            raise RunError(
                f"the data changed since {where} was saved: {'; '.join(changes)}; resume on "
                "the same data, or pass --allow_data_change to go on with these data"
            )
        self.reporter.message(
            f"going on with changed data (--allow_data_change): {'; '.join(changes)}"
        )

    def _finished_summary(self) -> dict | None:
        """The summary of a run that is already finished (nothing to train), else None:
        trained to num_steps, or stopped early at its latest step by a criterion that still
        holds (a raised or disabled threshold trains on). A run past num_steps raises."""
        tc, workdir = self.cfg.train, self.workdir
        latest = self.checkpoints.latest_step() or 0
        if latest > tc.num_steps:
            raise RunError(
                f"{workdir!r} holds a checkpoint at step {latest}, past config.train.num_steps = "
                f"{tc.num_steps}: this run is already past num_steps (rerun with num_steps >= "
                f"{latest} to continue it, or use another workdir)"
            )
        summary = None
        if latest and self.checkpoints.verify(latest) is None:
            summary = read_summary(os.path.join(workdir, "summary.json"), self.reporter)
        if summary is None or summary.get("step") != latest:
            return None
        stopped = summary.get("stopped_early") and tc.should_stop(summary)
        if latest != tc.num_steps and not stopped:
            return None
        # The finished run's summary (and its timings) stay as they are.
        self.reporter.message(
            f"{workdir} is already trained to step {latest} (config.train.num_steps = "
            f"{tc.num_steps}{', stopped early' if latest < tc.num_steps else ''}): "
            "nothing to do; its summary.json is kept"
        )
        return summary

    # ------------------------------------------------------------------ the loop
    def loop(self, stop: StopSignals) -> None:
        """Steps `start`..num_steps: log, evaluate, checkpoint, stop early or on a signal."""
        tc = self.cfg.train
        for s in range(self.start, tc.num_steps):
            self._step(s)
            done = self.done = s + 1
            final = done == tc.num_steps
            do_log = done % tc.log_every == 0 or final
            do_eval = done % tc.eval_every == 0 or final
            # A stop signal: check and save what was trained, then stop (no extra log record,
            # so the resumed run's metrics.jsonl matches an uninterrupted one's).
            stop.announce()
            interrupted = stop.received is not None and not final
            do_ckpt = done % tc.checkpoint_every == 0 or final or interrupted
            if not (do_log or do_eval or do_ckpt):
                continue
            self._flush()
            self.record = {"step": done}
            if do_log:
                self.record.update(self._train_record())
            if do_eval:
                self.record.update(self.evaluate())
                self.stopped_early = not final and tc.should_stop(self.record)
            if do_log or do_eval:
                for writer in self.writers:
                    writer.write(self.record)
                self.reporter.record(self.record)
            if do_ckpt or self.stopped_early:
                self.save()
            if interrupted:
                raise Interrupted(done, stop.received)
            if self.stopped_early:
                self.reporter.message(
                    f"early stop at step {done}: {tc.stop_metric} meets {tc.stop_at}"
                )
                break
            self.throughput.restart()  # eval and checkpoint time is not training time
        if self.start >= tc.num_steps:  # already complete: just report the final evaluation
            self.record = {"step": tc.num_steps, **self.evaluate()}
            self.reporter.record(self.record)

    def _step(self, s: int) -> None:
        """Step index ``s`` (completing step s + 1): the favor redraw when due, the batch of
        step s, the update; its metrics stay on the device until the next flush."""
        redraw = self.cfg.model.redraw_interval
        if redraw and s > 0 and s % redraw == 0:
            key = jax.random.fold_in(jax.random.fold_in(self.key, _REDRAW_STREAM), s)
            self.state = redraw_step(
                self.state, key, graphdef=self.graphdef, mesh=self.mesh, fsdp=self.fsdp
            )
        batch = self.data.train_batch(s, self.cfg.train.batch_size)
        batch = checked(batch, self.cfg.model, f"the batch of step {s + 1}")
        if self.data.process_local:  # each process holds its own rows
            batch = shard_local_batch(batch, self.mesh)
        else:
            batch = shard_batch(batch, self.mesh)
        self.profiler.before_step(s)
        self.state, metrics = train_step(
            self.state,
            batch,
            graphdef=self.graphdef,
            mesh=self.mesh,
            fsdp=self.fsdp,
            accum=self.cfg.train.grad_accum_steps,
            loss_chunks=self.cfg.loss_chunks,
        )
        self.pending.append((s + 1, metrics))
        traced = self.profiler.after_step(s + 1, metrics)
        if traced:
            self.reporter.message(traced)
        if s == self.start:  # the first step compiles: it is timed apart
            jax.block_until_ready(metrics)
        self.throughput.stepped()

    def _flush(self) -> None:
        """Fetch the pending steps' metrics and check them: a non-finite one stops the run
        before anything after it is saved."""
        values = jax.device_get([m for _, m in self.pending])
        self.throughput.lap()
        for (step, _), v in zip(self.pending, values, strict=True):
            bad = {k: float(x) for k, x in v.items() if not np.isfinite(x)}
            if bad:
                raise NonFiniteLossError(
                    f"non-finite {bad} at step {step}: stopped; the last good checkpoint "
                    f"(step {self.checkpoints.latest_step()}) is kept in "
                    f"{self.checkpoints.directory}"
                )
        self.since_log.extend(values)
        self.pending.clear()

    def _train_record(self) -> dict[str, float]:
        """The means of the train metrics since the last log record, the learning rate of the
        last update and the throughput since the last record."""
        since = self.since_log
        record = {k: float(np.mean([v[k] for v in since])) for k in since[0]}
        record["lr"] = float(self.schedule(self.done - 1))
        record.update(self._speed(self.throughput.interval()))
        self.last_train = {k: record[k] for k in ("train/loss", "train/accuracy")}
        self.since_log = []
        return record

    def _speed(self, timings: dict[str, float]) -> dict[str, float]:
        """``timings`` with tokens/s per device and, when `config.train.peak_flops` is set, the
        model FLOPs utilisation (FLOPs per token × tokens/s per device / peak)."""
        if "tokens_per_sec" not in timings:
            return timings
        out = dict(timings)
        out["tokens_per_sec_per_device"] = timings["tokens_per_sec"] / self.mesh.devices.size
        peak = self.cfg.train.peak_flops
        if peak and self.flops is not None:
            out["mfu"] = self.flops["total"] * out["tokens_per_sec_per_device"] / peak
        return out

    def evaluate(self) -> dict[str, float]:
        return evaluate(self.state, self.data, self.cfg, self.graphdef, self.mesh)

    def save(self) -> None:
        meta = {"timings": self.throughput.totals(), "config": self.fixed}
        if self.data_record is not None:
            meta["data"] = self.data_record
        self.checkpoints.save(
            self.done,
            self.state,
            meta,
            data_state=self.data.iterator_state(),
        )

    # ------------------------------------------------------------------ the end
    def finish(self) -> dict:
        """The summary (written to ``summary.json``): the last evaluation and train record,
        the run's timings over all sessions, the machine of this session, and a sample when
        asked for."""
        cfg = self.cfg
        summary = {k: v for k, v in self.record.items() if k.startswith("eval/")}
        summary.update(self.last_train)
        summary.update(step=self.done, steps_this_run=self.done - self.start)
        summary["stopped_early"] = self.stopped_early
        summary.update(self._speed(self.throughput.summary()))
        if self.flops is not None:
            summary["flops_per_token"] = self.flops["total"]
        summary.update(
            workdir=os.path.abspath(self.workdir),
            param_count=self.param_count,
            num_devices=int(self.mesh.devices.size),
            resumed_from_step=self.start,
        )
        # which processor and jax: XLA's CPU rounding differs between them, so a rerun
        # elsewhere can differ in its last digits (docs/studies/state_tracking.md,
        # "Modular arithmetic")
        machine = machine_info()
        machine["load_avg_end"] = machine.pop("load_avg_start")  # (taken now, at the end)
        summary["machine"] = machine
        if self.data.provenance:  # what the corpus was: LM figures depend on it
            summary["corpus"] = self.data.provenance
        if cfg.train.sample_tokens:
            summary["sample"] = _sample(self.state, self.graphdef, cfg, self.data.tokenizer)
            self.reporter.message(f"sample:\n{summary['sample']}")
        if self.lead:
            write_json(os.path.join(self.workdir, "summary.json"), summary)
        return summary
