"""The ``la-convert`` command line: Hugging Face checkpoints in and out of run workdirs.

    la-convert --from-hf PATH --workdir W     a local transformers folder -> a run workdir
    la-convert --to-hf W OUT [--model-type T]  a run workdir's latest checkpoint -> a folder

``--from-hf`` writes W as a run: ``config.json`` (the model's fields from the checkpoint's
config; text data with the checkpoint's tokenizer, the built-in corpus, a placeholder budget to
override), a step-0 checkpoint holding the weights (and a fresh optimizer state), and the
tokenizer files copied in, so that ``la-eval --workdir W``, ``la-generate --workdir W`` and a
fine-tuning run (``la-train ... --config.train.init_from=W``) work on it. ``--to-hf`` writes a
folder that ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads with the same
logits, for a model whose every part maps (docs/hf.md); any other is refused with the reasons.
``--model-type`` picks the architecture written (default: the first that holds the model
exactly, `models.hf.export_type`), e.g. ``qwen3_5_moe_text`` for a model that ``qwen3_next``
holds too.
What the checkpoint holds that the causal LM leaves out (a multimodal checkpoint's vision
tower, a multi-token-prediction head) is printed after ``--from-hf``, one ``not imported:`` line
each. Nothing is downloaded.

Everything read is checked before anything is written (`models.hf.files`): ``config.json`` and
the shard index as JSON objects with fields of the kinds transformers writes, each safetensors
header against its file's size, every weight a float, and finite: a NaN or Inf is refused
unless ``--allow_nonfinite`` (both ways). The tokenizer is read and measured against the
vocabulary. Bad input stops with one ``la-convert: error: ...`` line naming the file, tensor or
field (exit status 2). The output (W, or OUT) must be new or an empty folder, and is written
into ``.<name>.partial`` beside it, under its lock, then renamed into place
(`workdir.staged_folder`): a refused, failed (a full disk) or killed conversion leaves no
output, and its rerun works; a second conversion into the same folder at once is refused.
"""

from __future__ import annotations

from linear_attention.training import cuda_plugin

cuda_plugin.hide()  # before jax is imported: without a GPU, no CUDA plugin's driver messages

import argparse
import dataclasses
import os
import shutil
import sys

import ml_collections
from flax import nnx

from linear_attention.data.tokenizers import load_tokenizer
from linear_attention.models import hf
from linear_attention.training.checkpoint import Checkpoints
from linear_attention.training.cli_args import UsageError, error, plain
from linear_attention.training.config import (
    experiment_config,
    mesh_section,
    model_section,
    optimizer_section,
    train_section,
)
from linear_attention.training.load import load_run
from linear_attention.training.metrics import write_json
from linear_attention.training.optim import make_optimizer
from linear_attention.training.platforms import quiet_platforms
from linear_attention.training.workdir import check_folder_arg, check_new_folder, staged_folder

USAGE = (
    "usage: la-convert --from-hf PATH --workdir W  |  la-convert --to-hf W OUT [--model-type T]"
    "  [--allow_nonfinite]"
)
# The tokenizer files of a transformers folder, copied as they are (whichever exist).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
# The tokenizer file `config.data.tokenizer` names, the first present.
DATA_TOKENIZERS = ("tokenizer.json", "tokenizer.model")
# The placeholder budget of a converted run (a fine-tuning run overrides it).
SEQ_LEN = 256


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="la-convert", usage=USAGE, description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--from-hf", metavar="PATH", help="a local transformers checkpoint folder")
    parser.add_argument("--workdir", metavar="W", help="the run workdir to write (--from-hf)")
    parser.add_argument("--to-hf", nargs=2, metavar=("W", "OUT"), help="workdir and folder")
    parser.add_argument(
        "--model-type",
        metavar="T",
        help="the architecture --to-hf writes (default: the first "
        f"that holds the model; one of {', '.join(hf.ARCHITECTURES)})",
    )
    parser.add_argument(
        "--allow_nonfinite",
        "--allow-nonfinite",
        action="store_true",
        help="import (or export) weights that hold NaN or Inf instead of refusing them",
    )
    return parser


def run_section(model_config, tokenizer: str) -> ml_collections.ConfigDict:
    """A run's config for an imported model: its `ModelConfig`, text data on the built-in
    corpus read with `tokenizer`, AdamW at a fine-tuning rate, a placeholder budget."""
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.model = model_section(**dataclasses.asdict(model_config))
    config.data = ml_collections.ConfigDict(
        dict(kind="text", seq_len=min(SEQ_LEN, model_config.max_length), tokenizer=tokenizer)
    )
    config.optimizer = optimizer_section(learning_rate=1e-5)
    config.train = train_section(num_steps=1, batch_size=8)
    config.mesh = mesh_section()
    return config


def from_hf(path: str, workdir: str, *, allow_nonfinite: bool = False) -> dict:
    """Write the run workdir `workdir` from the transformers folder `path`; returns its config
    as written. Everything is read and checked first (`models.hf.from_pretrained`, the
    tokenizer against the vocabulary); then the workdir is written whole or not at all
    (`workdir.staged_folder`)."""
    check_new_folder("--workdir", workdir)
    model, model_config = hf.from_pretrained(path, allow_nonfinite=allow_nonfinite)
    present = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(path, f))]
    named = next((f for f in DATA_TOKENIZERS if f in present), None)
    if named is None and model_config.vocab_size < 256:
        raise UsageError(
            f"--from-hf {path!r} has no tokenizer file ({' or '.join(DATA_TOKENIZERS)}) and a "
            f"vocabulary of {model_config.vocab_size} < 256 bytes: nothing can read text for it"
        )
    # (checked where it is, in `path`, before anything is written)
    source = "bytes" if named is None else os.path.join(os.path.abspath(path), named)
    tokens = load_tokenizer(source).vocab_size
    if tokens > model_config.vocab_size:
        raise UsageError(
            f"--from-hf {path!r}: the tokenizer {named} has {tokens} tokens, more than the "
            f"model's vocab_size {model_config.vocab_size} (config.json): they do not belong "
            "together"
        )
    cfg = experiment_config(run_section(model_config, source))
    written = cfg.to_dict()
    if named is not None:
        written["data"]["tokenizer"] = os.path.join(os.path.abspath(workdir), named)
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.num_steps)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    with staged_folder("--workdir", workdir) as staging:
        for name in present:
            shutil.copyfile(os.path.join(path, name), os.path.join(staging, name))
        folder = os.path.join(staging, "checkpoints")
        checkpoints = Checkpoints(folder, keep=cfg.train.keep_checkpoints)
        try:
            meta = {"converted_from": os.path.abspath(path)}
            checkpoints.save(0, nnx.state((model, optimizer)), meta)
        finally:
            checkpoints.close()
        write_json(os.path.join(staging, "config.json"), written)
    return written


def to_hf(
    workdir: str, out: str, model_type: str | None = None, *, allow_nonfinite: bool = False
) -> str:
    """Write the latest checkpoint of the run in `workdir` as a transformers folder `out` of
    `model_type` (None: the architecture that holds its config exactly, `models.hf.export_type`),
    with the tokenizer files of the workdir, or else of the folder of the run's
    `config.data.tokenizer` file (a fine-tuning run reads the converted run's). A weight
    holding NaN or Inf is refused unless `allow_nonfinite`; `out` is written whole or not at
    all (`workdir.staged_folder`)."""
    check_folder_arg("--to-hf W", workdir)
    check_new_folder("--to-hf OUT", out)
    model, config = load_run(workdir)
    model_type = hf.export_type(model.config, model_type)
    tokenizer = getattr(config.data, "tokenizer", "bytes")
    folders = [workdir] + ([os.path.dirname(tokenizer)] if os.path.isfile(tokenizer) else [])
    with staged_folder("--to-hf OUT", out) as staging:
        hf.save_pretrained(model, staging, model_type=model_type, allow_nonfinite=allow_nonfinite)
        for name in TOKENIZER_FILES:
            found = [f for f in folders if os.path.isfile(os.path.join(f, name))]
            if found:
                shutil.copyfile(os.path.join(found[0], name), os.path.join(staging, name))
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``la-convert``; returns the exit status."""
    quiet_platforms()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if any(a in ("-h", "--help") for a in argv):
        print(plain(parser.format_help()), end="")
        return 0
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            raise UsageError(f"unknown arguments {' '.join(extra)}; {USAGE}")
        if (args.from_hf is None) == (args.to_hf is None):
            raise UsageError(f"give one of --from-hf or --to-hf; {USAGE}")
        if args.model_type is not None and (
            args.to_hf is None or args.model_type not in hf.ARCHITECTURES
        ):
            raise UsageError(
                f"--model-type {args.model_type!r}: it goes with --to-hf and is one of "
                f"{', '.join(hf.ARCHITECTURES)}"
            )
        if args.from_hf is not None:
            if args.workdir is None:
                raise UsageError("--from-hf needs --workdir W")
            check_folder_arg("--from-hf", args.from_hf)
            from_hf(args.from_hf, args.workdir, allow_nonfinite=args.allow_nonfinite)
            print(f"wrote {args.workdir} (step 0) from {args.from_hf}")
            for line in hf.not_imported(args.from_hf):
                print(f"not imported: {line}")
        else:
            if args.workdir is not None:
                raise UsageError("--to-hf takes W OUT, not --workdir")
            to_hf(*args.to_hf, model_type=args.model_type, allow_nonfinite=args.allow_nonfinite)
            print(f"wrote {args.to_hf[1]} from {args.to_hf[0]}")
    except (UsageError, ValueError) as e:
        return error("la-convert", e)
    except OSError as e:  # a file that cannot be read (permissions, a folder for a file)
        return error("la-convert", f"{e.filename}: {e.strerror or e}")
    except SystemExit as e:  # argparse's own usage errors (exit 2, message printed)
        return int(e.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
