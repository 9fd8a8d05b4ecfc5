"""``la-tokenizer``: train a byte-level BPE tokenizer on a local corpus, or encode a corpus into
a flat token file.

    la-tokenizer train --input PATH --vocab_size N --output FILE [--text_field text]
                       [--max_bytes 0] [--overwrite]
    la-tokenizer encode --input PATH --tokenizer T --output FILE.bin [--eos_id -1]
                        [--text_field text] [--max_bytes 0] [--overwrite]

``PATH`` is read as `linear_attention.data.corpus.read_documents` reads a corpus (a text file,
a folder, JSONL or Parquet records; "" for the built-in corpus), so the tokenizer sees the
documents a run on ``--config.data.path=PATH`` sees. ``train`` writes a Hugging Face
``tokenizer.json``, for ``--config.data.tokenizer=FILE``. ``encode`` writes the ids as a flat
file (uint16 when the vocabulary fits, else uint32; each document followed by ``--eos_id`` when
it is >= 0) and its sidecar ``FILE.bin.json`` (dtype, vocabulary, eos, tokenizer, digest),
which a ``config.data.kind='tokens'`` run checks. ``--output`` is checked before any work: its
folder must exist and be writable, and an existing file is replaced only with ``--overwrite``.
Bad arguments or input stop with ``la-tokenizer: error: ...`` (exit status 2), and a failed
write (a full disk) leaves no partial file.
"""

from __future__ import annotations

from linear_attention.training import cuda_plugin

cuda_plugin.hide()  # before jax is imported: without a GPU, no CUDA plugin's driver messages

import argparse
import sys

from linear_attention.data.corpus import read_documents
from linear_attention.data.token_files import encode_token_file, sidecar_path
from linear_attention.data.tokenizers import check_vocab_size, load_tokenizer, train_bpe
from linear_attention.training.cli_args import plain
from linear_attention.training.metrics import Progress
from linear_attention.training.outputs import check_output
from linear_attention.training.platforms import quiet_platforms


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def _corpus_arguments(parser) -> None:
    parser.add_argument("--input", required=True, help="corpus: file, folder, JSONL, Parquet")
    parser.add_argument("--text_field", default="text", help="JSONL field / Parquet column")
    parser.add_argument("--max_bytes", type=int, default=0, help="read at most this (0: all)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="la-tokenizer", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command")
    train = commands.add_parser("train", help="train a byte-level BPE")
    train.add_argument("--vocab_size", type=int, required=True, help="at most this many tokens")
    train.add_argument("--output", required=True, help="the tokenizer.json to write")
    _corpus_arguments(train)
    encode = commands.add_parser("encode", help="encode a corpus into a flat token file")
    encode.add_argument("--tokenizer", required=True, help="'bytes', a tokenizer.json or .model")
    encode.add_argument("--output", required=True, help="the token file to write (FILE.bin)")
    encode.add_argument("--eos_id", type=int, default=-1, help="id after each document (-1: none)")
    _corpus_arguments(encode)
    return parser


class _Documents:
    """The documents, iterated with progress (the BPE trainer reads them once, then merges:
    said in a line, and on a terminal the library draws its own bar of the merges)."""

    def __init__(self, docs: list[str], progress: Progress, vocab_size: int):
        self.docs, self.progress, self.vocab_size = docs, progress, vocab_size
        self.total = sum(len(d) for d in docs)

    def __iter__(self):
        done = 0
        for doc in self.docs:
            yield doc
            done += len(doc)
            self.progress.update(done, self.total)
        self.progress.close()
        print(f"merging pairs up to {self.vocab_size:,} tokens", file=self.progress.stream)

    def __len__(self):
        return len(self.docs)


def _check(args) -> None:
    """Everything that can be checked before reading the corpus."""
    if args.max_bytes < 0:
        raise ValueError(f"--max_bytes must be >= 0 (0: all), got {args.max_bytes}")
    if args.command == "train":
        if not args.output.endswith(".json"):
            raise ValueError(f"--output must be a .json file (a tokenizer.json), got {args.output}")
        try:
            check_vocab_size(args.vocab_size)
        except ValueError as e:
            raise ValueError(f"--{e}") from None
    else:
        if args.output.endswith(".json"):
            raise ValueError(f"--output is the token file (e.g. train.bin), got {args.output}")
        if args.eos_id < -1 or args.eos_id >= 1 << 32:
            raise ValueError(f"--eos_id must be -1 (none) or in [0, 2**32), got {args.eos_id}")
        check_output(sidecar_path(args.output), flag="--output's sidecar", overwrite=args.overwrite)
    check_output(args.output, overwrite=args.overwrite)


def main(argv: list[str] | None = None) -> int:
    quiet_platforms()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        print(plain(parser.format_help()), end="")
        return 0
    progress = None
    try:
        args = parser.parse_args(argv)
        if args.command not in ("train", "encode"):
            raise ValueError("the command is 'train' or 'encode': la-tokenizer train --input ...")
        _check(args)
        tokenizer = load_tokenizer(args.tokenizer) if args.command == "encode" else None
        docs, provenance = read_documents(
            args.input, text_field=args.text_field, max_bytes=args.max_bytes or None
        )
        if args.command == "train":
            progress = Progress("reading the corpus", unit="characters")
            tokenizer = train_bpe(
                _Documents(docs, progress, args.vocab_size),
                vocab_size=args.vocab_size,
                output=args.output,
                show_progress=progress.tty,
            )
        else:
            progress = Progress("tokenizing", unit="characters")
            record = encode_token_file(
                docs,
                tokenizer,
                args.output,
                provenance=provenance,
                eos_id=args.eos_id,
                progress=progress.update,
            )
    except OSError as e:
        where = getattr(e, "filename", None) or getattr(args, "output", "")
        print(f"la-tokenizer: error: cannot write {where}: {e.strerror or e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"la-tokenizer: error: {e}", file=sys.stderr)
        return 2
    finally:
        if progress is not None:
            progress.close()
    if args.command == "train":
        print(
            f"trained a byte-level BPE of {tokenizer.vocab_size} tokens on {len(docs)} documents "
            f"({provenance['bytes']:,} bytes): {args.output}"
        )
    else:
        print(
            f"encoded {len(docs)} documents ({provenance['bytes']:,} bytes) into "
            f"{record['tokens']:,} {record['dtype']} ids: {args.output} (sidecar "
            f"{sidecar_path(args.output)})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
