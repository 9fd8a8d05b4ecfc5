"""A language model on a pre-tokenized file: `configs/lm.py`'s presets with ``kind = "tokens"``.

Command (a flat ``uint16`` file of token ids, nanoGPT / Megatron style, or a ``.npy``):

    python experiments/train.py --config configs/lm_tokens.py:smoke --workdir runs/tok \\
        --config.data.path=train.bin --config.model.vocab_size=50304 \\
        [--config.data.token_dtype=uint32] [--config.data.tokenizer=tokenizer.json]

The file is memory-mapped and trained through the Grain pipeline (shuffled by epoch, sharded by
process); every id is checked against ``config.model.vocab_size``. Without
``config.data.eos_id`` (-1) the file is one stream with no document boundary, trained as windows
of ``seq_len + 1`` tokens; with ``--config.data.eos_id=ID`` (e.g. GPT-2's 50256) each document
ends with that token (kept as its last), and packed rows restart their segment ids, so the
model's states, at every document. With ``config.data.tokenizer`` (the tokenizer that made the file)
bits per byte are reported and a sample is generated; without it, only the loss (and
``train.sample_tokens`` is 0).
"""

import importlib.util
import os

import ml_collections

_LM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm.py")
_spec = importlib.util.spec_from_file_location("la_config_lm_base", _LM)
_lm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_lm)

PRESETS = _lm.PRESETS


def get_config(arg=None):
    config = _lm.get_config(arg)
    seq_len, num_val_windows = config.data.seq_len, config.data.num_val_windows
    config.data = ml_collections.ConfigDict()
    config.data.kind = "tokens"
    config.data.path = ""  # required: --config.data.path=FILE.bin / FILE.npy
    config.data.token_dtype = "uint16"  # of a .bin (a .npy carries its own)
    config.data.seq_len = seq_len
    config.data.val_fraction = 0.02
    config.data.num_val_windows = num_val_windows
    config.data.tokenizer = ""  # the tokenizer that made the file, for bits per byte
    # The id that ends each document (packed rows reset states there); -1: one stream
    config.data.eos_id = -1
    config.train.sample_tokens = 0
    return config
