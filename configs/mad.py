"""MAD's six synthetic tasks (Poli et al. 2024) at MAD's baseline settings, scored as MAD does:
class-macro accuracy over the scored positions (``eval/accuracy``; the plain token accuracy is
``eval/token_accuracy``).

Command (2 CPU cores):

    python experiments/train.py --config configs/mad.py:in_context_recall \
        --config.model.mixer=deltanet --workdir runs/mad_icr_deltanet

Presets (``configs/mad.py:<task>``; ``linear_attention/data/mad.py`` defines each task):
``in_context_recall`` (vocab 16, length 128, multi-query), ``noisy_recall`` (+ 20 % noise
tokens from 16 more ids), ``fuzzy_recall`` (keys and values of 1–3 tokens), ``selective_copying``
(16 tokens among blanks in length 256), ``compression`` (length 32; MAD's separate decoder
replaced by position queries, see the data module), ``memorization`` (vocab 256, length 32, one
fixed map), and ``smoke`` (a tiny in-context recall run for tests). MAD's variants are options:
``--config.data.multi_query=False``, ``--config.data.noise_fraction=0.4``,
``--config.data.max_key_len=1``, ``--config.data.selective=False``, ...
Every preset: MAD's 12,800 training and 1,280 test examples; a 2-layer model with MLPs,
d_model 64, 2 heads, the short conv, softmax by default (``--config.model.mixer=...``);
AdamW lr 3e-3 (warmup 100, cosine), batch 64, 1000 steps (5 epochs; MAD trains far longer, so
the figures here are a CPU budget's, to be compared by ranking).

Measured: not yet. The presets are built and tested (tests/test_synthetic_configs.py trains
the smoke preset); their results and the study (configs/sweeps/mad.py) are still to be run.
"""

import importlib.util
from pathlib import Path

import ml_collections

from linear_attention.data.mad import MAD_SETTINGS, OPTION_DEFAULTS, TASKS, mad_num_tokens

PRESETS = (*TASKS, "smoke")


def _mqar(preset):
    path = Path(__file__).resolve().parent / "mqar.py"
    spec = importlib.util.spec_from_file_location("configs_mqar", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(preset)


def get_config(arg=None):
    if arg not in PRESETS:
        raise ValueError(f"unknown preset {arg!r} for configs/mad.py; presets: {PRESETS}")
    task = "in_context_recall" if arg == "smoke" else arg
    vocab_size, seq_len = MAD_SETTINGS[task]
    # The model, optimizer, train and mesh sections of the MQAR CPU preset, resized here.
    base = _mqar("cpu")
    config = ml_collections.ConfigDict()
    config.seed = 0

    config.data = ml_collections.ConfigDict()
    config.data.kind = "mad"
    config.data.task = task
    config.data.vocab_size = vocab_size
    config.data.seq_len = seq_len
    config.data.num_train_examples = 12_800
    config.data.num_test_examples = 1_280
    # Every task's options, at MAD's baseline; a task rejects a change to another's option.
    for name, value in OPTION_DEFAULTS.items():
        config.data[name] = value

    config.model = base.model
    # The model's vocabulary: the content tokens plus the task's special tokens (at defaults;
    # an option that adds tokens, such as noise_vocab_size, needs model.vocab_size raised too).
    config.model.vocab_size = mad_num_tokens(task, vocab_size, seq_len)
    config.model.d_model = 64
    config.model.num_heads = 2
    config.model.mlp = True
    config.model.max_length = seq_len

    config.optimizer = base.optimizer
    config.optimizer.learning_rate = 3e-3
    config.optimizer.warmup_steps = 100

    config.train = base.train
    config.train.num_steps = 1000
    config.train.batch_size = 64
    config.train.eval_every = 250
    config.train.log_every = 50
    config.train.checkpoint_every = 500
    config.mesh = base.mesh

    if arg == "smoke":
        config.data.seq_len = 16
        config.data.num_train_examples = 64
        config.data.num_test_examples = 20
        config.model.d_model = 32
        config.model.max_length = 16
        config.optimizer.warmup_steps = 2
        config.train.num_steps = 4
        config.train.batch_size = 8
        config.train.eval_every = 2
        config.train.log_every = 1
        config.train.checkpoint_every = 2
    return config
