"""The boundary between ConfigDicts and the code: frozen, validated dataclasses.

`experiment_config(config)` turns a ConfigDict (or a nested dict) into an `ExperimentConfig`.
Every unknown field, missing field, wrong type or bad value raises `ValueError` naming it as
``config.<section>.<field>``, before any data is built or anything is compiled.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from collections.abc import Mapping
from typing import Any

import ml_collections
from ml_collections import config_dict

from linear_attention.fields import (
    broken,
    build,
    check_fields,
    check_int,
    kinds,
    spec_field,
    unknown_field,
)
from linear_attention.layers import get_mixer
from linear_attention.models.config import ModelConfig
from linear_attention.models.legacy import move_options
from linear_attention.models.options import option_classes
from linear_attention.training.chunked_loss import CHUNKED_LOSS_MODES, loss_chunks
from linear_attention.training.data_kinds import (
    DATA_CONFIGS,
    MADDataConfig,
    MQARDataConfig,
    StateTrackingDataConfig,
    TextDataConfig,
    TokenDataConfig,
    data_kind,
)
from linear_attention.training.targets import parse_target

SCHEDULES = ("cosine", "linear", "constant")
# Metrics an early stop can watch, and whether larger is better.
STOP_METRICS = {"eval/accuracy": True, "eval/loss": False, "eval/bits_per_byte": False}
# A rate or a fraction: a number in [0, 1].
UNIT = dict(low=0.0, high=1.0)
NON_NEGATIVE = dict(low=0.0)


class Section:
    """Base of the sections: `PREFIX` names the fields in messages; `check` holds the rules
    between a section's own fields (after each field's own check, `fields.check_fields`)."""

    PREFIX: typing.ClassVar[str] = ""

    def __post_init__(self):
        check_fields(self, self.PREFIX)
        self.check()

    def check(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Section):
    """AdamW with global-norm clipping and a warmup + decay schedule (see `optim.py`)."""

    PREFIX: typing.ClassVar[str] = "config.optimizer."

    learning_rate: float = spec_field(low=0.0, high=1e3, low_open=True)
    weight_decay: float = spec_field(0.0, low=0.0, high=1e3)
    warmup_steps: int = spec_field(0, minimum=0)
    schedule: str = spec_field("cosine", choices=SCHEDULES)
    min_lr_ratio: float = spec_field(0.0, **UNIT)
    grad_clip: float = spec_field(1.0, **NON_NEGATIVE)
    b1: float = spec_field(0.9, **UNIT)
    b2: float = spec_field(0.999, **UNIT)
    eps: float = spec_field(1e-8, low=0.0, high=1.0, low_open=True)


@dataclasses.dataclass(frozen=True)
class TrainConfig(Section):
    """Loop lengths and intervals, counted in optimizer steps."""

    PREFIX: typing.ClassVar[str] = "config.train."

    num_steps: int
    batch_size: int
    eval_batch_size: int = spec_field(0, minimum=0)  # 0: batch_size
    eval_every: int = 1000
    log_every: int = 100
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    sample_tokens: int = spec_field(0, minimum=0)
    sample_prompt: str = ""
    sample_temperature: float = spec_field(1.0, low=0.0, high=1e3)
    sample_top_k: int = spec_field(0, minimum=0)  # 0: no truncation
    # trace this many steps (after the compiling one) with jax.profiler
    profile_steps: int = spec_field(0, minimum=0)
    # Early stop: end the run after an evaluation whose `stop_metric` reaches `stop_at`
    # (>= for accuracy, <= for losses); 0: off, every run trains num_steps.
    stop_at: float = spec_field(0.0, **NON_NEGATIVE)
    stop_metric: str = spec_field("eval/accuracy", choices=tuple(STOP_METRICS))
    # The batch of a step is split into this many micro-batches, run one after another with
    # their gradients summed (memory of one micro-batch; the same update to float32 rounding).
    grad_accum_steps: int = 1
    # Peak FLOP/s of one device (e.g. 989e12: H100 bfloat16 dense); > 0 logs MFU.
    peak_flops: float = spec_field(0.0, **NON_NEGATIVE)
    # A run workdir (e.g. `la-convert --from-hf`'s) whose latest checkpoint's parameters start
    # this run, with a fresh optimizer: fine-tuning. "": a new model from config.seed. Used
    # only when this run has no checkpoint yet (a resumed run continues its own).
    init_from: str = ""
    # The loss by token and vocabulary chunks, never holding the [B, T, V] logits
    # (`training.chunked_loss`): "auto" when model.vocab_size >= CHUNKED_LOSS_MIN_VOCAB.
    chunked_loss: str = spec_field("auto", choices=CHUNKED_LOSS_MODES)
    loss_chunk_tokens: int = 1024
    loss_chunk_vocab: int = 16384

    def check(self):
        if self.batch_size % self.grad_accum_steps:
            broken(
                "train.grad_accum_steps",
                f"= {self.grad_accum_steps} must divide config.train.batch_size = "
                f"{self.batch_size}",
            )
        if self.init_from and not os.path.isfile(os.path.join(self.init_from, "config.json")):
            broken("train.init_from", f"= {self.init_from!r} is not a run workdir (no config.json)")
        if self.sample_tokens and not self.sample_prompt:
            broken("train.sample_prompt", "must be non-empty when sample_tokens > 0")
        high = 1.0 if STOP_METRICS[self.stop_metric] else math.inf
        if self.stop_at > high:
            broken("train.stop_at", f"must be in [0, {high}] (0: off), got {self.stop_at}")

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
class MeshConfig(Section):
    """Devices: a mesh over ``num_devices`` (0: all) with axes ``data`` (batch rows), ``seq``
    (``seq`` devices split the time axis: sequence parallelism) and ``model`` (``model``
    devices split every block's heads and MLP hidden units: tensor parallelism,
    `training.mesh`). With ``multi_host`` the run is
    one of ``num_processes`` processes joined by ``jax.distributed.initialize``; an empty
    address and ``num_processes = 0`` are taken from the environment or the cluster.
    ``target``: the accelerators the run is sized for, ``""`` (the visible devices),
    ``"tpu:<gen>:<topology>"`` or ``"gpu:<chip>:<count>"`` (`training.targets`): ``la-train
    --dry_run`` compiles the train step for them from any machine; training runs on the visible
    devices."""

    PREFIX: typing.ClassVar[str] = "config.mesh."

    num_devices: int = spec_field(0, minimum=0)
    fsdp: bool = False  # shard parameters and optimizer state over the data axis
    seq: int = 1  # devices splitting the time axis; the others split the batch
    model: int = spec_field(1, minimum=1)  # devices splitting heads and MLP hidden units
    multi_host: bool = False  # call jax.distributed.initialize() first
    coordinator_address: str = ""  # "host:port" of process 0
    num_processes: int = spec_field(0, minimum=0)
    process_id: int = spec_field(0, minimum=0)  # read when num_processes > 0
    target: str = ""  # "tpu:v5e:4x4", "gpu:h100:8": what --dry_run compiles for ("": visible)

    def check(self):
        parse_target(self.target, "config.mesh.target")
        if self.num_devices and self.num_devices % self.seq:
            broken("mesh.seq", f"= {self.seq} must divide num_devices = {self.num_devices}")
        if self.num_devices and self.num_devices % (self.seq * self.model):
            broken(
                "mesh.model",
                f"= {self.model} times mesh.seq = {self.seq} must divide num_devices = "
                f"{self.num_devices}",
            )
        if self.num_processes and self.process_id >= self.num_processes:
            broken(
                "mesh.process_id",
                f"= {self.process_id} must be < num_processes = {self.num_processes}",
            )
        if not self.multi_host:
            for name in ("coordinator_address", "num_processes", "process_id"):
                if getattr(self, name):
                    broken(f"mesh.{name}", "is set but multi_host is False")


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

    @property
    def loss_chunks(self) -> tuple[int, int] | None:
        """The train and eval steps' ``loss_chunks`` (None: the plain loss; `chunked_loss`)."""
        t = self.train
        return loss_chunks(
            t.chunked_loss, self.model.vocab_size, t.loss_chunk_tokens, t.loss_chunk_vocab
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _build(cls, values: Mapping, path: str):
    """The section ``cls`` of ``config.<path>`` from its values (checked as it is made)."""
    return build(cls, values, prefix=f"config.{path}.", owner=f"config.{path}")


def _mixer_names(mixer):
    """A hybrid given on the command line as a string, ``"gated,softmax"`` or
    ``"('gated', 'softmax')"``, becomes a tuple of names; anything else is left as is."""
    if isinstance(mixer, str) and "," in mixer:
        names = [name.strip(" '\"") for name in mixer.strip("()[] ").split(",")]
        if not all(names):  # "kda," would otherwise be the one-layer hybrid ("kda",)
            broken("model.mixer", f"has an empty name in {mixer!r}; give NAME or NAME,NAME,...")
        return tuple(names)
    return mixer


def _model_config(values: Mapping) -> ModelConfig:
    values = move_options(values, "config.model", stacklevel=5, strict=True)
    if "mixer" in values:
        values["mixer"] = _mixer_names(values["mixer"])
    known = sorted(f.name for f in dataclasses.fields(ModelConfig))
    for name, value in values.items():
        if name not in known:
            raise unknown_field(f"config.model.{name}", name, value, "config.model", known)
    try:
        return ModelConfig(**values)
    except ValueError as e:
        raise ValueError(f"config.model: {e}") from None


def field_type(cls, name: str) -> type:
    """The scalar type a command line gives field ``name`` of ``cls`` (a placeholder's type
    when its value is None): int for a field that may be a bool or an int (``conv``)."""
    allowed = [k for k in kinds(typing.get_type_hints(cls).get(name, str)) if k is not type(None)]
    if int in allowed:
        return int
    return next((k for k in allowed if k in (float, bool, str)), str)


# The dataclasses behind each section, for --help and for typing config.json's None fields.
SECTION_CLASSES: dict[str, tuple[type, ...]] = {
    "model": (ModelConfig,),
    "data": DATA_CONFIGS,
    "optimizer": (OptimizerConfig,),
    "train": (TrainConfig,),
    "mesh": (MeshConfig,),
}


def section(cls, path: str, **fields) -> ml_collections.ConfigDict:
    """A config file's section for the frozen dataclass ``cls`` (``ModelConfig``,
    `OptimizerConfig`, `TrainConfig`, `MeshConfig`): every field, at its default unless given
    in `fields` (a value or a `FieldReference`), so that a config file lists only what it
    changes and every field can still be overridden from the command line
    (`--config.train.stop_at=0.99`). A field without a default must be given. A field whose
    default is None is a typed placeholder (its type from `field_type`)."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ValueError(f"{path}.{unknown[0]} is not a field; known fields: {', '.join(known)}")
    section = ml_collections.ConfigDict()
    for name, field in known.items():
        if name in fields:
            section[name] = fields[name]
        elif field.default is None:
            section[name] = config_dict.placeholder(field_type(cls, name))
        elif field.default is not dataclasses.MISSING:
            section[name] = field.default
        else:
            raise ValueError(f"{path}.{name} has no default: give it")
    return section


def model_section(**fields) -> ml_collections.ConfigDict:
    """`config.model`: every `ModelConfig` field, see `section`; `options` (a mapping) is
    `options_section`, so that every mixer option can be overridden from the command line
    (`--config.model.options.state_dim=16`). An old flat mixer option (``chunk_size=32``) is
    moved into `options`, warned (`models.legacy`)."""
    fields = move_options(fields, "config.model", stacklevel=4, strict=True)
    options = options_section(fields.pop("options", None))
    model = section(ModelConfig, "model", **fields)
    model.options = options
    return model


def options_section(given: Mapping | None = None) -> ml_collections.ConfigDict:
    """`config.model.options`: a typed placeholder (None: the mixer's default) for every option
    of the registered mixers' `Config` classes (`models.options.option_classes`), with the
    `given` ones set (values or `FieldReference`s; a name no mixer takes is kept, for
    `ModelConfig` to refuse with the closest known one)."""
    options = ml_collections.ConfigDict()
    for name, classes in option_classes().items():
        options[name] = config_dict.placeholder(field_type(classes[0], name))
    for name, value in dict(given or {}).items():
        try:
            options[name] = value
        except TypeError:  # (a value of another type: ModelConfig's check names it)
            with options.ignore_type():
                options[name] = value
    return options


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
        broken(unknown[0], f"is not a section; known: {', '.join(SECTIONS)}")
    for name in SECTIONS:
        if name not in values:
            broken(name, "is required")
        if name != "seed" and not isinstance(values[name], Mapping):
            broken(name, f"must be a ConfigDict, got {values[name]!r}")
    seed = check_int("config.seed", values["seed"], minimum=0)
    data = _build(data_kind(values["data"].get("kind")).config, values["data"], "data")
    optimizer = _build(OptimizerConfig, values["optimizer"], "optimizer")
    train = _build(TrainConfig, values["train"], "train")
    mesh = _build(MeshConfig, values["mesh"], "mesh")
    model = _model_config(values["model"])
    _check_sections(model, data, optimizer, train, mesh)
    return ExperimentConfig(
        seed=seed, model=model, data=data, optimizer=optimizer, train=train, mesh=mesh
    )


def _check_sections(model, data, optimizer, train, mesh) -> None:
    """The rules between sections: the data's own (`DataConfig.check_run`), then the rest."""
    data.check_run(model, train, mesh)
    if train.sample_tokens:
        total = len(train.sample_prompt.encode()) + train.sample_tokens
        if total > model.max_length:
            broken(
                "train.sample_tokens",
                f"= {train.sample_tokens} plus the prompt's {total - train.sample_tokens} bytes "
                f"exceeds config.model.max_length = {model.max_length}",
            )
    unsplit = [m for m in dict.fromkeys(model.layer_mixers) if not get_mixer(m).SEQUENCE_PARALLEL]
    if mesh.seq > 1 and unsplit:
        broken(
            "mesh.seq",
            f"= {mesh.seq} splits the time axis, which mixer(s) {', '.join(unsplit)} cannot take "
            "(no sequence-parallel form); use mesh.seq = 1",
        )
    if mesh.model > 1:
        check_tensor_parallel(model, mesh.model)
    if optimizer.warmup_steps > train.num_steps:
        broken(
            "optimizer.warmup_steps",
            f"= {optimizer.warmup_steps} exceeds config.train.num_steps = {train.num_steps}",
        )


def check_tensor_parallel(model: ModelConfig, n: int) -> None:
    """`ValueError` (naming config.mesh.model) unless ``n`` devices can split ``model``'s
    heads, grouped value and key/value heads and MLP hidden units evenly (`training.mesh`),
    and its layers are ones XLA partitions: no Pallas kernel (a Mosaic call is opaque to the
    partitioner) and no experts (expert parallelism is a separate axis, not built yet)."""
    why = f"= {n} splits heads and MLP hidden units over {n} devices"
    if model.uses_pallas:
        broken(
            "mesh.model",
            f"{why}; the Pallas kernels cannot be split so (use method != "
            "'pallas' or mesh.model = 1)",
        )
    if model.num_experts:
        broken(
            "mesh.model",
            f"{why}; a mixture of experts is not split over it yet (use "
            "num_experts = 0 or mesh.model = 1)",
        )
    widths = {"model.num_heads": model.num_heads}
    if model.mlp:
        widths["model.mlp_dim"] = model.mlp_dim or int(model.mlp_ratio * model.d_model)
    for name in dict.fromkeys(model.layer_mixers):
        mixer = model.mixer_config(name)
        for field in ("num_value_heads", "num_kv_heads"):
            if getattr(mixer, field, None):
                widths[f"model.options.{field} ({name})"] = getattr(mixer, field)
    for field, width in widths.items():
        if width % n:
            allowed = [d for d in range(1, width + 1) if width % d == 0]
            broken(
                "mesh.model",
                f"{why} but {field} = {width} is not divisible by it "
                f"(allowed: {', '.join(map(str, allowed))})",
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
    if isinstance(old.get("model"), Mapping):  # (a run saved before mixer options moved)
        old = {**old, "model": move_options(old["model"], "config.model")}
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
