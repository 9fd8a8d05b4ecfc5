"""The ``la-generate`` command line.

    la-generate --workdir runs/x --prompt "def " --num_tokens 200 [--temperature 0.8 --top_k 40]

It samples from a text run's checkpoint with the run's own ``config.json`` (overridable with
``--config.<section>.<field>=value``); a bad argument stops with ``la-generate: error: ...``
(exit status 2).
"""

from __future__ import annotations

from linear_attention.training import cuda_plugin

cuda_plugin.hide()  # before jax is imported: without a GPU, no CUDA plugin's driver messages

import codecs
import itertools
import os
import re
import sys

import jax
import numpy as np
from absl import flags

from linear_attention.data.tokenizers import BYTES, load_tokenizer
from linear_attention.models import generate_stream
from linear_attention.training.cli_args import (
    UsageError,
    check_backend,
    error,
    parse_overrides,
    pop_workdir,
    show_spelling_warnings,
    usage_help,
    validate,
    workdir_config,
    workdir_flags,
)
from linear_attention.training.load import load_run
from linear_attention.training.platforms import quiet_platforms

GENERATE_USAGE = (
    "usage: la-generate --workdir DIR --prompt TEXT --num_tokens N [--temperature T] [--top_k K]"
    " [--seed S] [--step N]"
)


def _check_utf8(flag: str, text: str) -> None:
    """UsageError unless ``text`` (an argument, decoded by Python with surrogate escapes) is
    UTF-8: a tokenizer reads text only."""
    raw = os.fsencode(text)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{flag} is not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start})"
        ) from None


def generate_main(argv: list[str] | None = None) -> int:
    """Entry point of ``la-generate``: sample from a text run's checkpoint, printing the prompt
    (encoded with the run's tokenizer) and then the text of each token as it is drawn. Token i
    is drawn from ``fold_in(key(seed), i)`` with ``softmax(logits / temperature)`` over the
    ``top_k`` largest logits (0: all); ``--temperature 0`` is greedy."""
    quiet_platforms()
    if argv is None:  # (the program itself, not a caller that manages warnings)
        show_spelling_warnings()
    argv = list(sys.argv if argv is None else argv)
    if any(a in ("-h", "--help", "-help") for a in argv[1:]):
        print(usage_help(GENERATE_USAGE, generate_main.__doc__))
        return 0

    try:
        workdir = pop_workdir(argv)
        fv, cfg = _parse_generate(argv, workdir)
        model, _ = load_run(workdir, config=fv.config, step=fv.step)
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        prompt = tokenizer.encode(fv.prompt).astype(np.int32)[None]
        tokens = generate_stream(
            model,
            prompt,
            fv.num_tokens,
            rng=jax.random.key(fv.seed),
            temperature=fv.temperature,
            top_k=fv.top_k or None,
        )
        first = next(tokens)  # arguments are checked when the first token is asked for
    except (UsageError, ValueError) as e:
        return error("la-generate", e)
    write = _writer(sys.stdout)
    write(fv.prompt)
    _print_tokens(itertools.chain([first], tokens), tokenizer, write)
    return 0


# Control characters but newline and tab: C0, DEL and C1 (ESC starts a terminal's escape
# sequences; a sampled one would recolour, move or clear the screen).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_safe(text: str) -> str:
    """``text`` with each control character but newline and tab written as ``\\xNN``."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _writer(stream):
    """Write and flush to ``stream``; on a terminal, control characters escaped
    (`terminal_safe`); into a pipe or file, the text as drawn."""
    tty = stream.isatty()

    def write(text: str) -> None:
        stream.write(terminal_safe(text) if tty else text)
        stream.flush()

    return write


def _define_flags(fv) -> None:
    workdir_flags(fv)
    flags.DEFINE_string("prompt", None, "text to continue", flag_values=fv)
    flags.DEFINE_integer("num_tokens", None, "tokens to generate", flag_values=fv)
    flags.DEFINE_float("temperature", 1.0, "sampling temperature (0: greedy)", flag_values=fv)
    flags.DEFINE_integer("top_k", 0, "sample among the k largest logits (0: all)", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "random seed of the sample", flag_values=fv)


def _parse_generate(argv: list[str], workdir: str | None):
    """``(flags, validated config)`` of a ``la-generate`` command line; `UsageError` for a run
    without text or a bad argument, before the checkpoint is loaded."""
    fv = parse_overrides(argv, workdir_config(workdir, GENERATE_USAGE), _define_flags)
    cfg = validate(fv.config)
    check_backend(fv.config)
    if not cfg.data.has_text:
        raise UsageError(
            f"la-generate samples text; {workdir} is a {cfg.data.kind!r} run without a "
            "tokenizer (config.data.kind must be 'text', or 'tokens' with "
            "config.data.tokenizer)"
        )
    if not fv.prompt:
        raise UsageError(f"--prompt is required (a non-empty text)\n{GENERATE_USAGE}")
    _check_utf8("--prompt", fv.prompt)
    if fv.num_tokens is None:
        raise UsageError(f"--num_tokens is required\n{GENERATE_USAGE}")
    if fv.top_k < 0:
        raise UsageError(f"--top_k must be >= 0 (0: all), got {fv.top_k}")
    if fv.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {fv.seed}")
    return fv, cfg


def _print_tokens(tokens, tokenizer, write) -> None:
    """The text of each token as it is drawn (``write``), then a newline."""
    if tokenizer.name == BYTES:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for token in tokens:
            write(decoder.decode(bytes([int(token[0])])))
        write(decoder.decode(b"", final=True) + "\n")
        return
    # Other tokenizers: decode everything drawn so far and print what is new, holding back a
    # trailing replacement character (a token that ends inside a UTF-8 character).
    drawn, shown = [], ""
    for token in tokens:
        drawn.append(int(token[0]))
        text = tokenizer.decode(drawn).rstrip("\ufffd")
        if text.startswith(shown):
            write(text[len(shown) :])
            shown = text
    text = tokenizer.decode(drawn)
    write((text[len(shown) :] if text.startswith(shown) else "") + "\n")


if __name__ == "__main__":
    sys.exit(generate_main())
