"""The boundary between ConfigDicts and the code: frozen, validated dataclasses.

`experiment_config(config)` turns a ConfigDict (or a nested dict) into an `ExperimentConfig`.
Every unknown field, missing field, wrong type or bad value raises `ValueError` naming it as
``config.<section>.<field>``, before any data is built or anything is compiled.
"""

from __future__ import annotations

import codecs
import dataclasses
import math
import os
import typing
from collections.abc import Mapping
from typing import Any

import ml_collections
from ml_collections import config_dict

from linear_attention.data import check_mqar_settings
from linear_attention.data.corpus import TOKEN_DTYPES
from linear_attention.data.forgetting_mqar import check_forgetting_settings
from linear_attention.data.mad import OPTION_DEFAULTS, check_mad_settings, mad_num_tokens
from linear_attention.data.sources import LOADERS
from linear_attention.data.state_tracking import (
    check_state_tracking_settings,
    task_vocab_size,
)
from linear_attention.data.tokenizers import check_tokenizer_spec, load_tokenizer
from linear_attention.models.config import FIELD_TYPES, ModelConfig
from linear_attention.training.tpu_target import parse_target

SCHEDULES = ("cosine", "linear", "constant")
# Metrics an early stop can watch, and whether larger is better.
STOP_METRICS = {"eval/accuracy": True, "eval/loss": False, "eval/bits_per_byte": False}
DATA_KINDS = ("mqar", "text", "tokens", "mad", "state_tracking")


def _fail(path: str, message: str):
    raise ValueError(f"config.{path} {message}")


def _need_int(path: str, value: int, minimum: int = 1):
    if value < minimum:
        _fail(path, f"must be an integer >= {minimum}, got {value}")


def _need_range(path: str, value: float, low: float, high: float, *, closed_low=True):
    ok = (low <= value if closed_low else low < value) and value <= high and math.isfinite(value)
    if not ok:
        bracket = "[" if closed_low else "("
        _fail(path, f"must be in {bracket}{low}, {high}], got {value}")


@dataclasses.dataclass(frozen=True)
class MQARDataConfig:
    """Zoology's multi-query associative recall (see `linear_attention.data.mqar`)."""

    kind: str
    vocab_size: int
    seq_len: int
    num_kv_pairs: int
    power_a: float = 0.01
    num_train_examples: int = 100_000
    num_test_examples: int = 3_000
    random_non_queries: bool = True
    num_reassignments: int = 0  # > 0: forgetting MQAR (keys reassigned before the queries)

    def validate(self, path: str):
        _need_int(f"{path}.num_train_examples", self.num_train_examples)
        _need_int(f"{path}.num_test_examples", self.num_test_examples)
        _need_int(f"{path}.num_reassignments", self.num_reassignments, minimum=0)
        try:
            check_mqar_settings(
                vocab_size=self.vocab_size,
                seq_len=self.seq_len,
                num_kv_pairs=self.num_kv_pairs,
                power_a=self.power_a,
            )
            if self.num_reassignments:
                check_forgetting_settings(
                    vocab_size=self.vocab_size,
                    seq_len=self.seq_len,
                    num_kv_pairs=self.num_kv_pairs,
                    num_reassignments=self.num_reassignments,
                    power_a=self.power_a,
                )
        except ValueError as e:
            raise ValueError(f"config.{path}: {e}") from None

    @property
    def tokens(self) -> int:
        return self.vocab_size


@dataclasses.dataclass(frozen=True)
class TextDataConfig:
    """Byte-level text (see `linear_attention.data.text`); ``path=""`` is the built-in corpus,
    ``max_bytes=0`` reads it all. ``pack``: rows carry ``segment_ids`` (documents: each file,
    or the pieces ending with ``separator`` when it is not empty) and the model keeps the
    documents apart. Backslash escapes in ``separator`` are decoded (`separator_bytes`), so
    ``--config.data.separator='\\n\\n\\n'`` on a command line is three newlines."""

    kind: str
    seq_len: int
    path: str = ""
    max_bytes: int = 0
    val_fraction: float = 0.02
    num_val_windows: int = 512
    pack: bool = False
    separator: str = ""
    tokenizer: str = "bytes"  # or a tokenizer.json / sentencepiece .model file
    text_field: str = "text"  # the field of a JSONL record / column of a Parquet file
    loader: str = "windows"  # or "grain": the Grain pipeline, its state in each checkpoint

    def validate(self, path: str):
        try:
            check_tokenizer_spec(self.tokenizer)
        except ValueError as e:
            _fail(f"{path}.tokenizer", str(e))
        if self.loader not in LOADERS:
            _fail(f"{path}.loader", f"must be one of {LOADERS}, got {self.loader!r}")
        if self.loader == "grain" and not self.pack:
            _fail(f"{path}.loader", f"= 'grain' packs documents: needs config.{path}.pack = True")
        if not self.text_field:
            _fail(f"{path}.text_field", "must be a non-empty field name")
        _need_int(f"{path}.seq_len", self.seq_len)
        _need_int(f"{path}.max_bytes", self.max_bytes, minimum=0)
        _need_range(f"{path}.val_fraction", self.val_fraction, 0.0, 0.5, closed_low=False)
        _need_int(f"{path}.num_val_windows", self.num_val_windows)
        if self.path and not os.path.exists(self.path):
            _fail(f"{path}.path", f"{self.path!r} does not exist")
        if self.separator and not self.pack:
            _fail(f"{path}.separator", f"= {self.separator!r} needs config.{path}.pack = True")
        try:
            _ = self.separator_bytes
        except ValueError as e:
            _fail(f"{path}.separator", f"= {self.separator!r} has a bad escape: {e}")

    @property
    def separator_bytes(self) -> bytes:
        """``separator`` as UTF-8 bytes, backslash escapes (``\\n``, ``\\xNN``, …) decoded."""
        return codecs.escape_decode(self.separator.encode())[0]

    @property
    def tokens(self) -> int:
        return load_tokenizer(self.tokenizer).vocab_size


@dataclasses.dataclass(frozen=True)
class TokenDataConfig:
    """Pre-tokenized data (see `linear_attention.data.sources.token_file_source`): a flat
    binary file of ``token_dtype`` ids (``.bin``, memory-mapped; nanoGPT / Megatron) or a
    ``.npy``, trained through the Grain pipeline. ``tokenizer``: the file that made the tokens
    ("" if unknown: no bits per byte and no samples then). ``eos_id``: the token that ends each
    document (kept as its last token; packed rows restart their segment ids after it), or -1:
    the file is one stream with no document boundary."""

    kind: str
    seq_len: int
    path: str
    token_dtype: str = "uint16"
    val_fraction: float = 0.02
    num_val_windows: int = 512
    tokenizer: str = ""
    eos_id: int = -1

    def validate(self, path: str):
        _need_int(f"{path}.seq_len", self.seq_len)
        _need_range(f"{path}.val_fraction", self.val_fraction, 0.0, 0.5, closed_low=False)
        _need_int(f"{path}.num_val_windows", self.num_val_windows)
        if not os.path.isfile(self.path):
            _fail(f"{path}.path", f"= {self.path!r} is not a file (a .bin or .npy of token ids)")
        if self.token_dtype not in TOKEN_DTYPES:
            _fail(f"{path}.token_dtype", f"must be one of {TOKEN_DTYPES}, got {self.token_dtype!r}")
        _need_int(f"{path}.eos_id", self.eos_id, minimum=-1)
        if self.tokenizer:
            try:
                check_tokenizer_spec(self.tokenizer)
            except ValueError as e:
                _fail(f"{path}.tokenizer", str(e))

    @property
    def tokens(self) -> int:
        """The tokenizer's vocabulary (the ids themselves are checked when the file is read)."""
        return load_tokenizer(self.tokenizer).vocab_size if self.tokenizer else 1


@dataclasses.dataclass(frozen=True)
class MADDataConfig:
    """One of MAD's six tasks (see `linear_attention.data.mad`): a fixed training and test set,
    scored by class-macro accuracy. The task options must stay at their defaults on a task that
    does not read them."""

    kind: str
    task: str
    vocab_size: int
    seq_len: int
    num_train_examples: int = 12_800
    num_test_examples: int = 1_280
    multi_query: bool = OPTION_DEFAULTS["multi_query"]
    noise_vocab_size: int = OPTION_DEFAULTS["noise_vocab_size"]
    noise_fraction: float = OPTION_DEFAULTS["noise_fraction"]
    max_key_len: int = OPTION_DEFAULTS["max_key_len"]
    max_value_len: int = OPTION_DEFAULTS["max_value_len"]
    num_tokens_to_copy: int = OPTION_DEFAULTS["num_tokens_to_copy"]
    selective: bool = OPTION_DEFAULTS["selective"]

    @property
    def options(self) -> dict:
        return {name: getattr(self, name) for name in OPTION_DEFAULTS}

    def validate(self, path: str):
        _need_int(f"{path}.num_train_examples", self.num_train_examples)
        _need_int(f"{path}.num_test_examples", self.num_test_examples)
        try:
            check_mad_settings(
                task=self.task, vocab_size=self.vocab_size, seq_len=self.seq_len, **self.options
            )
        except ValueError as e:
            raise ValueError(f"config.{path}: {e}") from None

    @property
    def tokens(self) -> int:
        return mad_num_tokens(self.task, self.vocab_size, self.seq_len, **self.options)


@dataclasses.dataclass(frozen=True)
class StateTrackingDataConfig:
    """Parity, modular arithmetic and group word problems (see
    `linear_attention.data.state_tracking`): training lengths in ``[min_len, seq_len]``, a fixed
    evaluation set of ``num_eval_examples`` sequences per length in ``eval_lengths``."""

    kind: str
    task: str
    seq_len: int  # the longest training sequence (the width of a training batch)
    min_len: int = 3
    eval_lengths: tuple[int, ...] = (40, 64, 128, 256)
    num_eval_examples: int = 512

    def validate(self, path: str):
        try:
            check_state_tracking_settings(
                task=self.task,
                min_len=self.min_len,
                max_len=self.seq_len,
                eval_lengths=self.eval_lengths,
                num_eval_examples=self.num_eval_examples,
            )
        except ValueError as e:
            raise ValueError(f"config.{path}: {e}") from None

    @property
    def longest(self) -> int:
        return max(self.seq_len, *self.eval_lengths)

    @property
    def tokens(self) -> int:
        return task_vocab_size(self.task)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with global-norm clipping and a warmup + decay schedule (see `optim.py`)."""

    learning_rate: float
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "cosine"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def validate(self, path: str):
        _need_range(f"{path}.learning_rate", self.learning_rate, 0.0, 1e3, closed_low=False)
        _need_range(f"{path}.weight_decay", self.weight_decay, 0.0, 1e3)
        _need_int(f"{path}.warmup_steps", self.warmup_steps, minimum=0)
        if self.schedule not in SCHEDULES:
            _fail(f"{path}.schedule", f"must be one of {SCHEDULES}, got {self.schedule!r}")
        _need_range(f"{path}.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _need_range(f"{path}.grad_clip", self.grad_clip, 0.0, math.inf)
        for name in ("b1", "b2"):
            _need_range(f"{path}.{name}", getattr(self, name), 0.0, 1.0)
        _need_range(f"{path}.eps", self.eps, 0.0, 1.0, closed_low=False)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Loop lengths and intervals, counted in optimizer steps."""

    num_steps: int
    batch_size: int
    eval_batch_size: int = 0  # 0: batch_size
    eval_every: int = 1000
    log_every: int = 100
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    sample_tokens: int = 0
    sample_prompt: str = ""
    sample_temperature: float = 1.0
    sample_top_k: int = 0  # 0: no truncation
    profile_steps: int = 0  # trace this many steps (after the compiling one) with jax.profiler
    # Early stop: end the run after an evaluation whose `stop_metric` reaches `stop_at`
    # (>= for accuracy, <= for losses); 0: off, every run trains num_steps.
    stop_at: float = 0.0
    stop_metric: str = "eval/accuracy"
    # The batch of a step is split into this many micro-batches, run one after another with
    # their gradients summed (memory of one micro-batch; the same update to float32 rounding).
    grad_accum_steps: int = 1
    # Peak FLOP/s of one device (e.g. 989e12: H100 bfloat16 dense); > 0 logs MFU.
    peak_flops: float = 0.0

    def validate(self, path: str):
        for name in ("num_steps", "batch_size", "eval_every", "log_every", "checkpoint_every"):
            _need_int(f"{path}.{name}", getattr(self, name))
        _need_int(f"{path}.eval_batch_size", self.eval_batch_size, minimum=0)
        _need_int(f"{path}.keep_checkpoints", self.keep_checkpoints)
        _need_int(f"{path}.sample_tokens", self.sample_tokens, minimum=0)
        _need_int(f"{path}.sample_top_k", self.sample_top_k, minimum=0)
        _need_int(f"{path}.profile_steps", self.profile_steps, minimum=0)
        _need_int(f"{path}.grad_accum_steps", self.grad_accum_steps)
        if self.batch_size % self.grad_accum_steps:
            _fail(
                f"{path}.grad_accum_steps",
                f"= {self.grad_accum_steps} must divide config.{path}.batch_size = "
                f"{self.batch_size}",
            )
        _need_range(f"{path}.peak_flops", self.peak_flops, 0.0, math.inf)
        _need_range(f"{path}.sample_temperature", self.sample_temperature, 0.0, 1e3)
        if self.sample_tokens and not self.sample_prompt:
            _fail(f"{path}.sample_prompt", "must be non-empty when sample_tokens > 0")
        if self.stop_metric not in STOP_METRICS:
            _fail(
                f"{path}.stop_metric",
                f"must be one of {tuple(STOP_METRICS)}, got {self.stop_metric!r}",
            )
        high = 1.0 if STOP_METRICS[self.stop_metric] else math.inf
        if not (0.0 <= self.stop_at <= high) or math.isnan(self.stop_at):
            _fail(f"{path}.stop_at", f"must be in [0, {high}] (0: off), got {self.stop_at}")

    def should_stop(self, record: Mapping[str, float]) -> bool:
        """Whether an evaluation ``record`` meets the early-stop threshold (never when off)."""
        if not self.stop_at or self.stop_metric not in record:
            return False
        value = record[self.stop_metric]
        return value >= self.stop_at if STOP_METRICS[self.stop_metric] else value <= self.stop_at

    @property
    def eval_batch(self) -> int:
        return self.eval_batch_size or self.batch_size


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Devices: a mesh over ``num_devices`` (0: all) with axes ``data`` (batch rows) and ``seq``
    (``seq`` devices split the time axis: sequence parallelism). With ``multi_host`` the run is
    one of ``num_processes`` processes joined by ``jax.distributed.initialize``; an empty
    address and ``num_processes = 0`` are taken from the environment or the cluster.
    ``target``: the slice the run is sized for, ``""`` (the visible devices) or
    ``"tpu:<gen>:<topology>"`` (`training.tpu_target`): ``la-train --dry_run`` compiles the
    train step for it from any machine; training runs on the visible devices."""

    num_devices: int = 0
    fsdp: bool = False  # shard parameters and optimizer state over the data axis
    seq: int = 1  # devices splitting the time axis; the others split the batch
    multi_host: bool = False  # call jax.distributed.initialize() first
    coordinator_address: str = ""  # "host:port" of process 0
    num_processes: int = 0
    process_id: int = 0  # read when num_processes > 0
    target: str = ""  # "tpu:v5e:4x4": the slice --dry_run compiles for ("": visible devices)

    def validate(self, path: str):
        parse_target(self.target, f"config.{path}.target")
        _need_int(f"{path}.num_devices", self.num_devices, minimum=0)
        _need_int(f"{path}.seq", self.seq)
        if self.num_devices and self.num_devices % self.seq:
            _fail(f"{path}.seq", f"= {self.seq} must divide num_devices = {self.num_devices}")
        _need_int(f"{path}.num_processes", self.num_processes, minimum=0)
        _need_int(f"{path}.process_id", self.process_id, minimum=0)
        if self.num_processes and self.process_id >= self.num_processes:
            _fail(
                f"{path}.process_id",
                f"= {self.process_id} must be < num_processes = {self.num_processes}",
            )
        if not self.multi_host:
            for name in ("coordinator_address", "num_processes", "process_id"):
                if getattr(self, name):
                    _fail(f"{path}.{name}", "is set but multi_host is False")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    seed: int
    model: ModelConfig
    data: (
        MQARDataConfig | TextDataConfig | TokenDataConfig | MADDataConfig | StateTrackingDataConfig
    )
    optimizer: OptimizerConfig
    train: TrainConfig
    mesh: MeshConfig

    @property
    def tokens_per_step(self) -> int:
        return self.train.batch_size * self.data.seq_len

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a bool", str: "a string"}


def _convert(path: str, value, annotation):
    """Check ``value`` against a scalar annotation (int / float / bool / str)."""
    base = annotation
    if typing.get_origin(annotation) is tuple:  # tuple[int, ...]: a list or tuple of ints
        if isinstance(value, (list, tuple)) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            return tuple(value)
        _fail(path, f"must be a tuple of integers, got {value!r} ({type(value).__name__})")
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, base) and not (base is int and isinstance(value, bool)):
        return value
    _fail(path, f"must be {_TYPE_NAMES[base]}, got {value!r} ({type(value).__name__})")


def _build(cls, values: Mapping, path: str):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        _fail(f"{path}.{unknown[0]}", f"is not a field; known fields: {', '.join(fields)}")
    kwargs = {}
    for name, field in fields.items():
        if name not in values:
            if field.default is dataclasses.MISSING:
                _fail(f"{path}.{name}", "is required")
            continue
        kwargs[name] = _convert(f"{path}.{name}", values[name], hints[name])
    obj = cls(**kwargs)
    obj.validate(path)
    return obj


def _mixer_names(mixer):
    """A hybrid given on the command line as a string, ``"gated,softmax"`` or
    ``"('gated', 'softmax')"``, becomes a tuple of names; anything else is left as is."""
    if isinstance(mixer, str) and "," in mixer:
        return tuple(name.strip(" '\"") for name in mixer.strip("()[] ").split(",") if name.strip())
    return mixer


def _model_config(values: Mapping) -> ModelConfig:
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        _fail(f"model.{unknown[0]}", f"is not a field; known fields: {', '.join(sorted(known))}")
    values = dict(values)
    if "mixer" in values:
        values["mixer"] = _mixer_names(values["mixer"])
    try:
        return ModelConfig(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config.model: {e}") from None


def section(cls, path: str, **fields) -> ml_collections.ConfigDict:
    """A config file's section for the frozen dataclass ``cls`` (``ModelConfig``,
    `OptimizerConfig`, `TrainConfig`, `MeshConfig`): every field, at its default unless given
    in `fields` (a value or a `FieldReference`), so that a config file lists only what it
    changes and every field can still be overridden from the command line
    (`--config.train.stop_at=0.99`). A field without a default must be given. A field whose
    default is None is a typed placeholder (its type from `FIELD_TYPES`)."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ValueError(f"{path}.{unknown[0]} is not a field; known fields: {', '.join(known)}")
    section = ml_collections.ConfigDict()
    for name, field in known.items():
        if name in fields:
            section[name] = fields[name]
        elif field.default is None:
            kind = next(k for k in FIELD_TYPES[name] if k is not type(None))
            section[name] = config_dict.placeholder(int if name == "conv" else kind)
        elif field.default is not dataclasses.MISSING:
            section[name] = field.default
        else:
            raise ValueError(f"{path}.{name} has no default: give it")
    return section


def model_section(**fields) -> ml_collections.ConfigDict:
    """`config.model`: every `ModelConfig` field (each mixer's options included), see `section`."""
    return section(ModelConfig, "model", **fields)


def optimizer_section(**fields) -> ml_collections.ConfigDict:
    """`config.optimizer`: every `OptimizerConfig` field; ``learning_rate`` must be given."""
    return section(OptimizerConfig, "optimizer", **fields)


def train_section(**fields) -> ml_collections.ConfigDict:
    """`config.train`: every `TrainConfig` field; ``num_steps`` and ``batch_size`` must be
    given."""
    return section(TrainConfig, "train", **fields)


def mesh_section(**fields) -> ml_collections.ConfigDict:
    """`config.mesh`: every `MeshConfig` field (one process over every device by default)."""
    return section(MeshConfig, "mesh", **fields)


def _as_dict(config) -> dict:
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return {k: _as_dict(v) if isinstance(v, Mapping) else v for k, v in dict(config).items()}


SECTIONS = ("seed", "model", "data", "optimizer", "train", "mesh")


def experiment_config(config) -> ExperimentConfig:
    """Validate a ConfigDict (or nested mapping) and freeze it into an `ExperimentConfig`."""
    if isinstance(config, ExperimentConfig):
        return config
    values = _as_dict(config)
    unknown = sorted(set(values) - set(SECTIONS))
    if unknown:
        _fail(unknown[0], f"is not a section; known: {', '.join(SECTIONS)}")
    for name in SECTIONS:
        if name not in values:
            _fail(name, "is required")
        if name != "seed" and not isinstance(values[name], Mapping):
            _fail(name, f"must be a ConfigDict, got {values[name]!r}")
    seed = _convert("seed", values["seed"], int)
    _need_int("seed", seed, minimum=0)

    kind = values["data"].get("kind")
    if kind not in DATA_KINDS:
        _fail("data.kind", f"must be one of {DATA_KINDS}, got {kind!r}")
    data_cls = {
        "mqar": MQARDataConfig,
        "text": TextDataConfig,
        "tokens": TokenDataConfig,
        "mad": MADDataConfig,
        "state_tracking": StateTrackingDataConfig,
    }[kind]
    data = _build(data_cls, values["data"], "data")
    optimizer = _build(OptimizerConfig, values["optimizer"], "optimizer")
    train = _build(TrainConfig, values["train"], "train")
    mesh = _build(MeshConfig, values["mesh"], "mesh")
    model = _model_config(values["model"])

    # Cross-section checks.
    if model.vocab_size < data.tokens:
        _fail(
            "model.vocab_size",
            f"= {model.vocab_size} is smaller than the data's vocabulary ({data.tokens})",
        )
    if kind == "tokens" and data.eos_id >= model.vocab_size:
        _fail(
            "data.eos_id",
            f"= {data.eos_id} is outside the vocabulary [0, {model.vocab_size}) "
            "(config.model.vocab_size)",
        )
    if model.max_length < data.seq_len:
        _fail(
            "model.max_length",
            f"= {model.max_length} is shorter than config.data.seq_len = {data.seq_len}",
        )
    if kind == "state_tracking" and model.max_length < data.longest:
        _fail(
            "model.max_length",
            f"= {model.max_length} is shorter than the longest of config.data.eval_lengths "
            f"= {data.longest}",
        )
    if train.sample_tokens:
        total = len(train.sample_prompt.encode()) + train.sample_tokens
        if total > model.max_length:
            _fail(
                "train.sample_tokens",
                f"= {train.sample_tokens} plus the prompt's {total - train.sample_tokens} bytes "
                f"exceeds config.model.max_length = {model.max_length}",
            )
    if data.seq_len % mesh.seq:
        _fail("mesh.seq", f"= {mesh.seq} must divide config.data.seq_len = {data.seq_len}")
    if optimizer.warmup_steps > train.num_steps:
        _fail(
            "optimizer.warmup_steps",
            f"= {optimizer.warmup_steps} exceeds config.train.num_steps = {train.num_steps}",
        )
    if kind == "tokens" and not data.tokenizer:
        if train.sample_tokens:
            _fail("train.sample_tokens", "must be 0 without config.data.tokenizer (no text)")
        if train.stop_metric == "eval/bits_per_byte":
            _fail("train.stop_metric", "= 'eval/bits_per_byte' needs config.data.tokenizer")
    if kind not in ("text", "tokens", "mqar"):  # (MQAR says so below, in its own words)
        if train.sample_tokens:
            _fail("train.sample_tokens", f"must be 0 for {kind} (there is no text to sample)")
        if train.stop_metric == "eval/bits_per_byte":
            _fail("train.stop_metric", f"= 'eval/bits_per_byte' is for text data, not {kind}")
    if kind in ("mad", "state_tracking") and mesh.seq > 1:
        _fail("mesh.seq", f"= {mesh.seq}: {kind} is evaluated on one time shard (use 1)")
    if kind in ("mqar", "mad"):
        if train.batch_size > data.num_train_examples:
            _fail(
                "train.batch_size",
                f"= {train.batch_size} exceeds config.data.num_train_examples = "
                f"{data.num_train_examples}",
            )
        if train.sample_tokens:
            _fail("train.sample_tokens", "must be 0 for MQAR (there is no text to sample)")
        if train.stop_metric == "eval/bits_per_byte":
            _fail("train.stop_metric", "= 'eval/bits_per_byte' is for text data, not MQAR")
    return ExperimentConfig(
        seed=seed, model=model, data=data, optimizer=optimizer, train=train, mesh=mesh
    )


def config_difference(old: Mapping, new: Mapping, cfg: ExperimentConfig):
    """The first ``(path, old value, new value)`` where a saved config dict ``old`` differs
    from ``new`` (``cfg.to_dict()`` through JSON), or None. A field missing from ``old`` (added
    to the code after that run was saved) is no difference while ``new`` holds its default."""
    defaults = {
        section.name: {
            f.name: f.default
            for f in dataclasses.fields(getattr(cfg, section.name))
            if f.default is not dataclasses.MISSING
        }
        for section in dataclasses.fields(cfg)
        if dataclasses.is_dataclass(getattr(cfg, section.name))
    }
    return _difference(old, new, defaults, "")


_ABSENT = object()


def _difference(old, new, defaults, prefix):
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        defaults = defaults if isinstance(defaults, Mapping) else {}
        for key in sorted(set(old) | set(new)):
            if key not in old and defaults.get(key, _ABSENT) == new[key]:
                continue
            diff = _difference(old.get(key), new.get(key), defaults.get(key), f"{prefix}{key}.")
            if diff:
                return diff
        return None
    return None if old == new else (prefix.rstrip("."), old, new)
