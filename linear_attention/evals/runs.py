"""What an evaluation reads of a run: its model at a checkpoint, its tokenizer, the token that
ends a text, and the longest input. A run is a ``la-train`` workdir or one ``la-convert
--from-hf`` wrote (whose tokenizer is the checkpoint's own ``tokenizer.json`` or
``tokenizer.model``, with the special tokens of its ``tokenizer_config.json``)."""

from __future__ import annotations

import json
import os
from typing import NamedTuple

from flax import nnx

from linear_attention.data.tokenizers import BYTES, load_tokenizer
from linear_attention.training.cli_args import validate, workdir_config
from linear_attention.training.load import restore_run


class TextRun(NamedTuple):
    model: object  # LanguageModel
    tokenizer: object  # data.tokenizers: encode, decode, vocab_size
    eot_token_id: int | None  # the tokenizer's end-of-text token; None if it has none
    max_length: int
    step: int


def text_run_config(workdir: str):
    """The validated config of the run in ``workdir``; ValueError when the run reads no text
    (an MQAR or state-tracking run, or token files without ``config.data.tokenizer``). Cheap:
    only ``config.json`` is read."""
    config = validate(workdir_config(workdir, ""))
    # (a needles run reads prompts with its tokenizer: text too, without bits per byte)
    if not (config.data.has_text or getattr(config.data, "tokenizer", "")):
        raise ValueError(
            f"{workdir} is a {config.data.kind!r} run with no tokenizer for text: lm-eval tasks "
            "and perplexity on text need a text run (config.data.kind 'text', 'needles', or "
            "'tokens' with config.data.tokenizer)"
        )
    return config


def end_of_text(tokenizer) -> int | None:
    """The id of the tokenizer's end-of-text token: a sentencepiece model's ``eos_id``, or the
    ``eos_token`` of the ``tokenizer_config.json`` beside a ``tokenizer.json``; None for bytes
    and a tokenizer that names none."""
    if tokenizer.name == BYTES:
        return None
    sp = getattr(tokenizer, "_sp", None)
    if sp is not None:
        eos = int(sp.eos_id())
        return eos if eos >= 0 else None
    path = os.path.join(os.path.dirname(tokenizer.name), "tokenizer_config.json")
    try:
        with open(path) as f:
            token = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(token, dict):  # (the older form {"content": ...})
        token = token.get("content")
    found = tokenizer._tok.token_to_id(token) if isinstance(token, str) else None
    return None if found is None else int(found)


def load_text_run(workdir: str, *, step: int | None = None) -> TextRun:
    """The model of checkpoint ``step`` (default: the latest) of the text run in ``workdir``
    with its tokenizer; ValueError for a run without text (`text_run_config`)."""
    tokenizer = load_tokenizer(text_run_config(workdir).data.tokenizer)
    run = restore_run(workdir, step=step)
    model, _ = nnx.merge(run.graphdef, run.state)
    eot = end_of_text(tokenizer)
    return TextRun(model, tokenizer, eot, run.config.model.max_length, run.step)
