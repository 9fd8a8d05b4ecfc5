"""``la-tokenizer``: train a byte-level BPE tokenizer on a local corpus.

    la-tokenizer train --input PATH --vocab_size N --output FILE [--text_field text]
                       [--max_bytes 0]

``PATH`` is read as `linear_attention.data.corpus.read_documents` reads a corpus (a text file,
a folder, JSONL or Parquet records; "" for the built-in corpus), so the tokenizer sees the
documents a run on ``--config.data.path=PATH`` sees. ``FILE`` is a Hugging Face
``tokenizer.json``, for ``--config.data.tokenizer=FILE``. Bad arguments or input stop with
``la-tokenizer: error: ...`` (exit status 2).
"""

from __future__ import annotations

import argparse
import sys

from linear_attention.data.corpus import read_documents
from linear_attention.data.tokenizers import train_bpe


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="la-tokenizer", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command")
    train = commands.add_parser("train", help="train a byte-level BPE")
    train.add_argument("--input", required=True, help="corpus: file, folder, JSONL, Parquet")
    train.add_argument("--vocab_size", type=int, required=True, help="at most this many tokens")
    train.add_argument("--output", required=True, help="the tokenizer.json to write")
    train.add_argument("--text_field", default="text", help="JSONL field / Parquet column")
    train.add_argument("--max_bytes", type=int, default=0, help="read at most this (0: all)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    try:
        args = parser.parse_args(argv)
        if args.command != "train":
            raise ValueError("the command is 'train': la-tokenizer train --input ...")
        if args.max_bytes < 0:
            raise ValueError(f"--max_bytes must be >= 0 (0: all), got {args.max_bytes}")
        if not args.output.endswith(".json"):
            raise ValueError(f"--output must be a .json file (a tokenizer.json), got {args.output}")
        docs, provenance = read_documents(
            args.input, text_field=args.text_field, max_bytes=args.max_bytes or None
        )
        tokenizer = train_bpe(docs, vocab_size=args.vocab_size, output=args.output)
    except (ValueError, OSError) as e:
        print(f"la-tokenizer: error: {e}", file=sys.stderr)
        return 2
    print(
        f"trained a byte-level BPE of {tokenizer.vocab_size} tokens on {len(docs)} documents "
        f"({provenance['bytes']:,} bytes): {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
