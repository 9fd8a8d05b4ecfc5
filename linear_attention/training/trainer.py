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

import contextlib
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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from linear_attention.data import IGNORE_INDEX
from linear_attention.data.protocol import DataSource
from linear_attention.data.tokenizers import bits_per_byte, label_bytes
from linear_attention.models import LanguageModel, ModelConfig, generate, redraw_features
from linear_attention.models.tokens import check_token_ids
from linear_attention.training.checkpoint import Checkpoints
from linear_attention.training.config import (
    ExperimentConfig,
    config_difference,
    experiment_config,
)
from linear_attention.training.data_kinds import DATA_KINDS
from linear_attention.training.flops import flops_per_token
from linear_attention.training.machine import machine_info
from linear_attention.training.mesh import (
    DATA_AXIS,
    check_train_batches,
    initialize_distributed,
    make_mesh,
    sequence_parallel_stats,
    shard_batch,
    shard_local_batch,
    state_shardings,
)
from linear_attention.training.metrics import MetricsWriter, Reporter, Throughput, write_json
from linear_attention.training.optim import make_optimizer
from linear_attention.training.scores import (
    class_macro_accuracy,
    class_token_stats,
    length_metrics,
)
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


def build_data(
    config: ExperimentConfig, *, cache_dir: str | None = None, message=None
) -> DataSource:
    """The data source of ``config.data``, by its kind's builder (`data_kinds.DATA_KINDS`;
    tokenized text is cached in ``cache_dir``)."""
    kind = DATA_KINDS[config.data.kind]
    return kind.build(config.data, config, cache_dir=cache_dir, message=message)


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
    jax.jit, static_argnames=("graphdef", "mesh", "fsdp", "accum"), donate_argnames=("state",)
)
def train_step(state, batch, *, graphdef, mesh, fsdp, accum: int = 1):
    """One optimizer step: ``(state, batch) -> (state, metrics)``; loss = mean cross-entropy
    over the labelled positions of the whole (global) batch. A batch with ``segment_ids``
    (packed documents) is run with them. ``accum > 1``: the batch is run as that many
    micro-batches (`summed_gradients`), the same update to float32 rounding."""
    model, optimizer = nnx.merge(graphdef, state)
    loss_sum, correct, count, grads = summed_gradients(model, batch, mesh, accum)
    count = jnp.maximum(count, 1.0)
    # (the mean gradient in the parameters' dtype: the optimizer state keeps that dtype)
    params = nnx.state(model, nnx.Param)
    grads = jax.tree.map(lambda g, p: (g / count).astype(p.dtype), grads, params)
    optimizer.update(model, grads)
    new_state = nnx.state((model, optimizer))
    new_state = jax.lax.with_sharding_constraint(new_state, state_shardings(new_state, mesh, fsdp))
    metrics = {
        "train/loss": loss_sum / count,
        "train/accuracy": correct / count,
        "grad_norm": optax.tree.norm(grads),
    }
    return new_state, metrics


def micro_batches(batch: dict, accum: int, mesh) -> dict:
    """``batch`` entries ``[B, ...]`` as ``[accum, B / accum, ...]``: micro-batch i holds rows
    i, i + accum, i + 2·accum, ..., so with rows split over the ``data`` axis every micro-batch
    keeps that split (each device runs its own rows; nothing moves between devices)."""

    def split(x):
        b = x.shape[0]
        x = jnp.swapaxes(x.reshape(b // accum, accum, *x.shape[1:]), 0, 1)
        spec = P(None, DATA_AXIS) if mesh is not None else None
        return x if spec is None else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return {k: split(v) for k, v in batch.items()}


def summed_gradients(model, batch, mesh, accum: int):
    """``(loss_sum, correct, count, grads)``: the `token_stats` sums of ``model`` on ``batch``
    and the gradient of ``loss_sum`` with respect to its `nnx.Param`s (float32, whatever the
    parameter dtype). With ``accum > 1`` the batch is split by `micro_batches` and run by
    `jax.lax.scan`, one micro-batch's activations alive at a time; the sums (of losses, counts
    and gradients) are those of the whole batch, since all three are sums over positions."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_sum(params, batch):
        loss, correct, count = model_stats(nnx.merge(graphdef, params, rest), batch, mesh)
        return loss, (correct, count)

    grad_fn = jax.value_and_grad(loss_sum, has_aux=True)
    as_f32 = lambda tree: jax.tree.map(lambda g: g.astype(jnp.float32), tree)  # noqa: E731
    if accum == 1:
        (loss, (correct, count)), grads = grad_fn(params, batch)
        return loss, correct, count, as_f32(grads)

    def add(carry, micro):
        (loss, (correct, count)), grads = grad_fn(params, micro)
        total = (loss, correct, count, as_f32(grads))
        return jax.tree.map(jnp.add, carry, total), None

    zeros = (0.0, 0.0, 0.0, jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    zeros = jax.tree.map(jnp.float32, zeros)
    sums, _ = jax.lax.scan(add, zeros, micro_batches(batch, accum, mesh))
    return sums


def model_stats(model, batch, mesh=None):
    """`token_stats` of the model on ``batch`` (with its ``segment_ids`` if packed); with a
    ``seq`` mesh axis over more than one device, time split over it (sequence parallelism).
    A model with ``method="pallas"`` on more than one device runs in `jax.shard_map` too (with
    ``seq`` 1: rows split over ``data``): XLA cannot partition a Mosaic kernel itself."""

    def stats(model, batch):
        return token_stats(model(batch["inputs"], batch.get("segment_ids")), batch["labels"])

    pallas = getattr(getattr(model, "config", None), "method", None) == "pallas"
    if mesh is None or (mesh.shape.get("seq", 1) == 1 and not (pallas and mesh.size > 1)):
        return stats(model, batch)
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


@functools.partial(jax.jit, static_argnames=("graphdef",))
def class_eval_step(state, batch, *, graphdef):
    """`scores.class_token_stats` of the model on ``batch`` (for class-macro accuracy)."""
    model, _ = nnx.merge(graphdef, state)
    return class_token_stats(model(batch["inputs"]), batch["labels"])


def evaluate(state, data: DataSource, config: ExperimentConfig, graphdef, mesh) -> dict[str, float]:
    """Mean loss and accuracy over every labelled position of the evaluation set (for MQAR:
    the query positions only); bits per byte for text. A source scored ``class_macro`` (MAD)
    reports that as eval/accuracy; one with ``eval_groups`` (state tracking) reports each
    group's accuracy and their mean (`scores`)."""
    batch_size = config.train.eval_batch
    macro = data.score == "class_macro"
    groups = data.eval_groups(batch_size)
    token_bytes = data.token_bytes  # None: no text (or no tokenizer)
    totals, num_bytes = {}, 0
    for name, batches in groups.items():
        sums = []
        for b in batches:
            if token_bytes is not None:
                num_bytes += label_bytes(b["labels"], token_bytes)
            b = shard_batch(checked(b, config.model, "an eval batch"), mesh)
            if macro:
                sums.append(class_eval_step(state, b, graphdef=graphdef))
            else:
                sums.append(eval_step(state, b, graphdef=graphdef, mesh=mesh))
        parts = zip(*jax.device_get(sums), strict=True)  # (loss sums, corrects, counts)
        totals[name] = [np.asarray(x, np.float64).sum(axis=0) for x in parts]
    if "" not in totals:
        return length_metrics(
            {name: [float(np.sum(x)) for x in t] for name, t in totals.items()}, data.chance
        )
    loss_sum, correct, count = totals[""]
    count_total = max(float(np.sum(count)), 1.0)
    out = {"eval/loss": float(loss_sum) / count_total}
    out["eval/accuracy"] = float(np.sum(correct)) / count_total
    if macro:  # MAD's score; the plain token accuracy is kept beside it
        out["eval/token_accuracy"] = out["eval/accuracy"]
        out["eval/accuracy"] = class_macro_accuracy(correct, count)
    if token_bytes is not None:  # over the bytes the predicted tokens cover
        out["eval/bits_per_byte"] = bits_per_byte(float(loss_sum), count_total, num_bytes)
    return out


def _check_resume_config(path: str, current: dict, cfg: ExperimentConfig) -> bool:
    """RunError if the run saved at ``path`` (its ``config.json``) has another seed, model or
    data config than ``current``; False when there is no ``config.json``."""
    if not os.path.exists(path):
        return False
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
    _compare_fixed(previous, current, cfg, os.path.dirname(path))
    return True


def _compare_fixed(previous: dict, current: dict, cfg: ExperimentConfig, workdir: str) -> None:
    # (a field added to the code since the run was saved, at its default, is no difference)
    fixed = {section: previous.get(section) for section in _FIXED_SECTIONS}
    diff = config_difference(fixed, {section: current[section] for section in _FIXED_SECTIONS}, cfg)
    if diff:
        name, old, new = diff
        raise ResumeConfigError(
            f"{workdir} holds a run with config.{name} = {old!r}, but this config "
            f"has {new!r}; resume with the same {'/'.join(_FIXED_SECTIONS)} or use another workdir"
        )


# What a run's data are, compared on resume (`data_record`): each key of a source's provenance
# that identifies its content, and how a message names it.
_DATA_KEYS = {
    "sha256": "the corpus",
    "digest": "the token file",
    "tokenizer_sha256": "the tokenizer file",
    "vocab_size": "the tokenizer's vocabulary",
}


def data_record(provenance: dict | None) -> dict | None:
    """The part of a source's ``provenance`` that identifies its content (saved with every
    checkpoint; None for synthetic data): the corpus's SHA-256 (text), the token file's digest
    (`data.files.file_digest`: whole, or size + samples for files over 1 GiB), the tokenizer's
    SHA-256 and vocabulary, and the paths for the messages."""
    if not provenance:
        return None
    record = {k: provenance[k] for k in (*_DATA_KEYS, "path", "tokenizer") if k in provenance}
    return json.loads(json.dumps(record))


def data_changes(saved: dict, now: dict) -> list[str]:
    """What differs between two `data_record`s, in words (empty: the same data)."""
    out = []
    for key, name in _DATA_KEYS.items():
        if key in saved and saved[key] != now.get(key):
            old, new = saved[key], now.get(key)
            if isinstance(old, dict) or isinstance(new, dict):  # a file digest
                old, new = (
                    f"{d.get('bytes')} bytes, {str(d.get('sha256', d.get('sampled_sha256')))[:12]}"
                    if isinstance(d, dict)
                    else d
                    for d in (old, new)
                )
            elif isinstance(old, str) and len(old) == 64:
                old, new = old[:12], str(new)[:12]
            where = saved.get("tokenizer" if key.startswith(("tokenizer", "vocab")) else "path")
            out.append(f"{name}{f' {where!r}' if where else ''} ({old} then, {new} now)")
    return out


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
        mesh = make_mesh(cfg.mesh.num_devices, cfg.mesh.seq)
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
        with _StopSignals(reporter) as stop:
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
        tc = cfg.train
        self.cfg, self.workdir, self.mesh, self.reporter = cfg, workdir, mesh, reporter
        self.fsdp, self.lead = cfg.mesh.fsdp, jax.process_index() == 0
        self.started = started
        config_dict = json.loads(json.dumps(cfg.to_dict()))
        self.fixed = {section: config_dict[section] for section in _FIXED_SECTIONS}
        self.config_dict = config_dict
        had_config = _check_resume_config(os.path.join(workdir, "config.json"), config_dict, cfg)
        try:
            cache = os.path.join(workdir, "token_cache")
            self.data = build_data(cfg, cache_dir=cache, message=reporter.message)
        except ValueError as e:
            raise RunError(f"config.data: {e}") from None

        tx, self.schedule = make_optimizer(cfg.optimizer, tc.num_steps)
        abstract_model, abstract_opt = nnx.eval_shape(lambda: build_model(cfg, tx))
        self.graphdef, abstract_state = nnx.split((abstract_model, abstract_opt))
        shardings = state_shardings(abstract_state, mesh, self.fsdp)
        self.param_count = _param_count(abstract_model)
        try:
            self.flops = flops_per_token(abstract_model, cfg.data.seq_len)
        except ValueError as e:  # a mixer without a count: no FLOPs or MFU, said once
            self.flops = None
            reporter.message(f"FLOPs per token and MFU are not logged: {e}")

        self.checkpoints = Checkpoints(
            os.path.join(workdir, "checkpoints"), keep=tc.keep_checkpoints
        )
        closing.callback(self.checkpoints.close)
        self.data_record = data_record(self.data.provenance)
        latest = self.checkpoints.latest_step()
        if latest:
            self._check_saved(self.checkpoints.meta(latest), latest, had_config, allow_data_change)
        self.finished = self._finished_summary()
        if self.finished is not None:
            return
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
            self.state = jax.device_put(nnx.state(build_model(cfg, tx)), shardings)
        meta = self.checkpoints.meta(self.start) if self.start else {}
        self.throughput = Throughput(cfg.tokens_per_step, meta.get("timings"), started=started)
        self.done, self.stopped_early = self.start, False
        self.record, self.last_train = {}, {}
        self.pending, self.since_log = [], []  # device metrics not yet checked; host ones
        self.key = jax.random.key(cfg.seed)

        if self.lead:  # only once the config is known to fit the saved run
            write_json(os.path.join(workdir, "config.json"), config_dict)
        self.writers = []
        if self.lead:
            metrics_path = os.path.join(workdir, "metrics.jsonl")
            self.writers = [
                MetricsWriter(metrics_path, resume_step=self.start, message=reporter.message),
                TensorBoardWriter(workdir, resume_step=self.start),
            ]
        for writer in self.writers:
            closing.callback(writer.close)
        self.profiler = Profiler(workdir, first=self.start + 1, num_steps=tc.profile_steps)
        closing.callback(self.profiler.close)
        reporter.message(
            f"{self.param_count:,} parameters, {mesh.devices.size} device(s) "
            f"(data {mesh.shape['data']} × seq {mesh.shape['seq']}), "
            f"steps {self.start}..{tc.num_steps}"
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
            _compare_fixed(meta["config"], self.fixed, self.cfg, self.workdir)
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
            summary = _read_summary(os.path.join(workdir, "summary.json"), self.reporter)
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
    def loop(self, stop: _StopSignals) -> None:
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
        # elsewhere can differ in its last digits (EXPERIMENTS 7.7)
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
