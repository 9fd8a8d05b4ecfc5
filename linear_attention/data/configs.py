"""The data sections' frozen configs, one per ``config.data.kind``: `MQARDataConfig`,
`TextDataConfig`, `TokenDataConfig`, `MADDataConfig`, `StateTrackingDataConfig`,
`NeedleDataConfig` (the registry
entry that pairs each with its builder is `training.data_kinds`).

A data config is checked when it is made (`fields.check_fields`: every field against its
annotation and `Spec`, then its own cross-field rules in `check`), and answers what the other
sections need of it: its vocabulary (`tokens`), its longest sequence (`longest`), whether it
has text to sample and score in bits per byte (`has_text`), whether it can be split over time
(`time_split`) and how many training examples it holds (`train_examples`). `check_run` holds
the rules between the data and the model, train and mesh sections, each once. The sources
take their config (`sources.text_source`, `sources.token_file_source`).
"""

from __future__ import annotations

import codecs
import dataclasses
import os
from typing import ClassVar

from linear_attention.data.corpus import TOKEN_DTYPES
from linear_attention.data.forgetting_mqar import check_forgetting_settings
from linear_attention.data.mad import OPTION_DEFAULTS, check_mad_settings, mad_num_tokens
from linear_attention.data.mqar import check_mqar_settings
from linear_attention.data.needles import NEEDLE_TASKS
from linear_attention.data.state_tracking import check_state_tracking_settings, task_vocab_size
from linear_attention.data.tokenizers import check_tokenizer_spec, load_tokenizer
from linear_attention.fields import POSITIVE, broken, check_choice, check_fields, spec_field

# The loaders of text (`sources`): random windows, or the Grain pipeline.
LOADERS = ("windows", "grain")
PREFIX = "config.data."
# The validation share of a corpus: above 0, at most half.
VAL_FRACTION = dict(low=0.0, high=0.5, low_open=True)


class DataConfig:
    """Base of the data sections (frozen dataclasses with ``kind`` and ``seq_len``)."""

    KIND: ClassVar[str] = ""
    # Whether the data are text (samples, bits per byte), and the data's name in messages.
    TEXT: ClassVar[bool] = False
    LABEL: ClassVar[str] = ""
    # The metric a run of this kind is judged by (sweeps select by it), and whether larger
    # is better.
    METRIC: ClassVar[tuple[str, bool]] = ("eval/accuracy", True)
    # Whether the time axis may be split over devices (config.mesh.seq > 1).
    TIME_SPLIT: ClassVar[bool] = True
    # What a sweep of this kind reports (`training.sweep.runner.SWEEP_REPORTS`): "recall"
    # (accuracy against width and state size), "tasks" (a mixer × task table and heat map),
    # "lengths" (that table and accuracy per evaluation length) or "language" (bits per byte,
    # throughput, decoding speed and loss curves).
    SWEEP_REPORT: ClassVar[str] = ""

    kind: str
    seq_len: int

    def __post_init__(self):
        check_fields(self, PREFIX)
        check_choice(PREFIX + "kind", self.kind, (self.KIND,))
        self.check()

    def check(self) -> None:
        """The rules between this section's own fields (after each field's own check)."""

    def _settings(self, check, **settings) -> None:
        """Run a data module's settings check; its message, prefixed by ``config.data:``."""
        try:
            check(**settings)
        except ValueError as e:
            raise ValueError(f"config.data: {e}") from None

    @property
    def tokens(self) -> int:
        """The vocabulary the data needs (`config.model.vocab_size` must hold it)."""
        raise NotImplementedError

    @property
    def longest(self) -> int:
        return self.seq_len

    @property
    def has_text(self) -> bool:
        return self.TEXT

    @property
    def packed(self) -> bool:
        """Whether batches carry ``segment_ids`` (documents packed into rows)."""
        return False

    @property
    def train_examples(self) -> int | None:
        """The size of a fixed training set (None: a stream)."""
        return None

    def check_run(self, model, train, mesh) -> None:
        """The rules between the data and the model, train and mesh sections."""
        if model.vocab_size < self.tokens:
            broken(
                "model.vocab_size",
                f"= {model.vocab_size} is smaller than the data's vocabulary ({self.tokens})",
            )
        if model.max_length < self.seq_len:
            broken(
                "model.max_length",
                f"= {model.max_length} is shorter than config.data.seq_len = {self.seq_len}",
            )
        if model.max_length < self.longest:
            broken(
                "model.max_length",
                f"= {model.max_length} is shorter than the longest of config.data.eval_lengths "
                f"= {self.longest}",
            )
        if self.seq_len % mesh.seq:
            broken("mesh.seq", f"= {mesh.seq} must divide config.data.seq_len = {self.seq_len}")
        if not self.TIME_SPLIT and mesh.seq > 1:
            broken("mesh.seq", f"= {mesh.seq}: {self.kind} is evaluated on one time shard (use 1)")
        if self.train_examples is not None and train.batch_size > self.train_examples:
            broken(
                "train.batch_size",
                f"= {train.batch_size} exceeds config.data.num_train_examples = "
                f"{self.train_examples}",
            )
        if not self.has_text:
            name = self.LABEL or self.kind
            if train.sample_tokens:
                broken("train.sample_tokens", f"must be 0 for {name} (there is no text to sample)")
            if train.stop_metric == "eval/bits_per_byte":
                broken("train.stop_metric", f"= 'eval/bits_per_byte' is for text data, not {name}")


@dataclasses.dataclass(frozen=True)
class MQARDataConfig(DataConfig):
    """Zoology's multi-query associative recall (see `linear_attention.data.mqar`)."""

    KIND: ClassVar[str] = "mqar"
    LABEL: ClassVar[str] = "MQAR"
    SWEEP_REPORT: ClassVar[str] = "recall"

    kind: str
    vocab_size: int = spec_field(minimum=None)
    seq_len: int = spec_field(minimum=None)
    num_kv_pairs: int = spec_field(minimum=None)
    power_a: float = spec_field(0.01, **POSITIVE)
    num_train_examples: int = 100_000
    num_test_examples: int = 3_000
    random_non_queries: bool = True
    # > 0: forgetting MQAR (keys reassigned before the queries)
    num_reassignments: int = spec_field(0, minimum=0)

    def check(self):
        common = dict(
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            num_kv_pairs=self.num_kv_pairs,
            power_a=self.power_a,
        )
        self._settings(check_mqar_settings, **common)
        if self.num_reassignments:
            self._settings(
                check_forgetting_settings, num_reassignments=self.num_reassignments, **common
            )

    @property
    def tokens(self) -> int:
        return self.vocab_size

    @property
    def train_examples(self) -> int:
        return self.num_train_examples


@dataclasses.dataclass(frozen=True)
class TextDataConfig(DataConfig):
    """Byte-level text (see `linear_attention.data.text`); ``path=""`` is the built-in corpus,
    ``max_bytes=0`` reads it all. ``pack``: rows carry ``segment_ids`` (documents: each file,
    or the pieces ending with ``separator`` when it is not empty) and the model keeps the
    documents apart. Backslash escapes in ``separator`` are decoded (`separator_bytes`), so
    ``--config.data.separator='\\n\\n\\n'`` on a command line is three newlines."""

    KIND: ClassVar[str] = "text"
    TEXT: ClassVar[bool] = True
    METRIC: ClassVar[tuple[str, bool]] = ("eval/bits_per_byte", False)
    SWEEP_REPORT: ClassVar[str] = "language"

    kind: str
    seq_len: int
    path: str = ""
    max_bytes: int = spec_field(0, minimum=0)
    val_fraction: float = spec_field(0.02, **VAL_FRACTION)
    num_val_windows: int = 512
    pack: bool = False
    separator: str = ""
    tokenizer: str = "bytes"  # or a tokenizer.json / sentencepiece .model file
    text_field: str = "text"  # the field of a JSONL record / column of a Parquet file
    # or "grain": the Grain pipeline, its state in each checkpoint
    loader: str = spec_field("windows", choices=LOADERS)

    def check(self):
        try:
            check_tokenizer_spec(self.tokenizer)
        except ValueError as e:
            broken("data.tokenizer", str(e))
        if self.loader == "grain" and not self.pack:
            broken("data.loader", "= 'grain' packs documents: needs config.data.pack = True")
        if not self.text_field:
            broken("data.text_field", "must be a non-empty field name")
        if self.path and not os.path.exists(self.path):
            broken("data.path", f"{self.path!r} does not exist")
        if self.separator and not self.pack:
            broken("data.separator", f"= {self.separator!r} needs config.data.pack = True")
        try:
            _ = self.separator_bytes
        except ValueError as e:
            broken("data.separator", f"= {self.separator!r} has a bad escape: {e}")

    @property
    def packed(self) -> bool:
        return self.pack

    @property
    def separator_bytes(self) -> bytes:
        """``separator`` as UTF-8 bytes, backslash escapes (``\\n``, ``\\xNN``, …) decoded."""
        return codecs.escape_decode(self.separator.encode())[0]

    @property
    def tokens(self) -> int:
        return load_tokenizer(self.tokenizer).vocab_size


@dataclasses.dataclass(frozen=True)
class TokenDataConfig(DataConfig):
    """Pre-tokenized data (see `linear_attention.data.sources.token_file_source`): a flat
    binary file of ``token_dtype`` ids (``.bin``, memory-mapped; nanoGPT / Megatron) or a
    ``.npy``, trained through the Grain pipeline. ``tokenizer``: the file that made the tokens
    ("" if unknown: no bits per byte and no samples then). ``eos_id``: the token that ends each
    document (kept as its last token; packed rows restart their segment ids after it), or -1:
    the file is one stream with no document boundary."""

    KIND: ClassVar[str] = "tokens"
    METRIC: ClassVar[tuple[str, bool]] = ("eval/loss", False)
    SWEEP_REPORT: ClassVar[str] = "language"

    kind: str
    seq_len: int
    path: str
    token_dtype: str = spec_field("uint16", choices=TOKEN_DTYPES)
    val_fraction: float = spec_field(0.02, **VAL_FRACTION)
    num_val_windows: int = 512
    tokenizer: str = ""
    eos_id: int = spec_field(-1, minimum=-1)

    def check(self):
        if not os.path.isfile(self.path):
            broken("data.path", f"= {self.path!r} is not a file (a .bin or .npy of token ids)")
        if self.tokenizer:
            try:
                check_tokenizer_spec(self.tokenizer)
            except ValueError as e:
                broken("data.tokenizer", str(e))

    @property
    def has_text(self) -> bool:
        return bool(self.tokenizer)

    @property
    def packed(self) -> bool:
        return True  # (segment ids restart after each eos_id; one segment without one)

    @property
    def tokens(self) -> int:
        """The tokenizer's vocabulary (the ids themselves are checked when the file is read)."""
        return load_tokenizer(self.tokenizer).vocab_size if self.tokenizer else 1

    def check_run(self, model, train, mesh) -> None:
        if self.eos_id >= model.vocab_size:
            broken(
                "data.eos_id",
                f"= {self.eos_id} is outside the vocabulary [0, {model.vocab_size}) "
                "(config.model.vocab_size)",
            )
        if not self.tokenizer:
            if train.sample_tokens:
                broken("train.sample_tokens", "must be 0 without config.data.tokenizer (no text)")
            if train.stop_metric == "eval/bits_per_byte":
                broken("train.stop_metric", "= 'eval/bits_per_byte' needs config.data.tokenizer")
        super().check_run(model, train, mesh)


@dataclasses.dataclass(frozen=True)
class MADDataConfig(DataConfig):
    """One of MAD's six tasks (see `linear_attention.data.mad`): a fixed training and test set,
    scored by class-macro accuracy. The task options must stay at their defaults on a task that
    does not read them."""

    KIND: ClassVar[str] = "mad"
    TIME_SPLIT: ClassVar[bool] = False
    SWEEP_REPORT: ClassVar[str] = "tasks"

    kind: str
    task: str
    vocab_size: int = spec_field(minimum=None)
    seq_len: int = spec_field(minimum=None)
    num_train_examples: int = 12_800
    num_test_examples: int = 1_280
    multi_query: bool = OPTION_DEFAULTS["multi_query"]
    noise_vocab_size: int = spec_field(OPTION_DEFAULTS["noise_vocab_size"], minimum=None)
    noise_fraction: float = spec_field(OPTION_DEFAULTS["noise_fraction"])
    max_key_len: int = spec_field(OPTION_DEFAULTS["max_key_len"], minimum=None)
    max_value_len: int = spec_field(OPTION_DEFAULTS["max_value_len"], minimum=None)
    num_tokens_to_copy: int = spec_field(OPTION_DEFAULTS["num_tokens_to_copy"], minimum=None)
    selective: bool = OPTION_DEFAULTS["selective"]

    @property
    def options(self) -> dict:
        return {name: getattr(self, name) for name in OPTION_DEFAULTS}

    def check(self):
        self._settings(
            check_mad_settings,
            task=self.task,
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            **self.options,
        )

    @property
    def tokens(self) -> int:
        return mad_num_tokens(self.task, self.vocab_size, self.seq_len, **self.options)

    @property
    def train_examples(self) -> int:
        return self.num_train_examples


@dataclasses.dataclass(frozen=True)
class StateTrackingDataConfig(DataConfig):
    """Parity, modular arithmetic and group word problems (see
    `linear_attention.data.state_tracking`): training lengths in ``[min_len, seq_len]``, a fixed
    evaluation set of ``num_eval_examples`` sequences per length in ``eval_lengths``."""

    KIND: ClassVar[str] = "state_tracking"
    TIME_SPLIT: ClassVar[bool] = False
    SWEEP_REPORT: ClassVar[str] = "lengths"

    kind: str
    task: str
    # the longest training sequence (the width of a training batch)
    seq_len: int = spec_field(minimum=None)
    min_len: int = spec_field(3, minimum=None)
    eval_lengths: tuple[int, ...] = (40, 64, 128, 256)
    num_eval_examples: int = spec_field(512, minimum=None)

    def check(self):
        self._settings(
            check_state_tracking_settings,
            task=self.task,
            min_len=self.min_len,
            max_len=self.seq_len,
            eval_lengths=self.eval_lengths,
            num_eval_examples=self.num_eval_examples,
        )

    @property
    def longest(self) -> int:
        return max(self.seq_len, *self.eval_lengths)

    @property
    def tokens(self) -> int:
        return task_vocab_size(self.task)


@dataclasses.dataclass(frozen=True)
class NeedleDataConfig(DataConfig):
    """RULER-style needle prompts (see `linear_attention.data.needles`): rows of ``seq_len``
    tokens of ``tokenizer``, one prompt of ``task`` each, the answer (at most ``answer_len``
    tokens) the only labelled part. The corpus haystack is read from ``path`` (empty: the
    built-in corpus; the ``text_field`` of JSONL or Parquet records)."""

    KIND: ClassVar[str] = "needles"
    SWEEP_REPORT: ClassVar[str] = "recall"

    kind: str
    task: str
    seq_len: int = spec_field(minimum=None)
    answer_len: int = 32
    tokenizer: str = "bytes"
    path: str = ""
    text_field: str = "text"
    num_test_examples: int = 256

    def check(self):
        check_choice(PREFIX + "task", self.task, tuple(NEEDLE_TASKS))
        if self.seq_len <= self.answer_len:
            broken(
                "data.seq_len", f"= {self.seq_len} leaves no room past answer_len {self.answer_len}"
            )
        try:
            check_tokenizer_spec(self.tokenizer)
        except ValueError as e:
            broken("data.tokenizer", str(e))
        if self.path and not os.path.exists(self.path):
            broken("data.path", f"{self.path!r} does not exist")

    @property
    def tokens(self) -> int:
        return load_tokenizer(self.tokenizer).vocab_size
