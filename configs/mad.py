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
Every preset (`linear_attention.training.presets.synthetic_preset`): MAD's 12,800 training
and 1,280 test examples; a 2-layer model with MLPs, d_model 64, 2 heads, the short conv,
softmax by default (``--config.model.mixer=...``); AdamW lr 3e-3 (10 % warmup, cosine), batch
64, the same 1.6M training tokens for every task (``TOKENS_PER_RUN``: 200 steps at length 128,
100 at 256, 800 at 32; one evaluation at the end). MAD trains far longer: the figures here are
a CPU budget's, to be compared by ranking.

Each preset run once with its default mixer (softmax, seed 0): the command, wall time, load and
every record are in docs/results/presets_cpu/mad_<task>.json, the figures in
docs/results/config_docstring_runs.md; the study over mixers: EXPERIMENTS.md section 9.
"""

from linear_attention.data.mad import MAD_SETTINGS, OPTION_DEFAULTS, TASKS, mad_num_tokens
from linear_attention.training.presets import synthetic_preset

PRESETS = (*TASKS, "smoke")
# One budget in tokens for every task, 200 steps of batch 64 at length 128 (1.6M tokens):
# a few minutes on 2 CPU cores whatever the task's length.
TOKENS_PER_RUN = 200 * 64 * 128


def get_config(arg=None):
    if arg not in PRESETS:
        raise ValueError(f"unknown preset {arg!r} for configs/mad.py; presets: {PRESETS}")
    smoke = arg == "smoke"
    task = "in_context_recall" if smoke else arg
    vocab_size, seq_len = MAD_SETTINGS[task]
    seq_len = 16 if smoke else seq_len
    data = dict(
        kind="mad",
        task=task,
        vocab_size=vocab_size,
        seq_len=seq_len,
        num_train_examples=64 if smoke else 12_800,
        num_test_examples=20 if smoke else 1_280,
        # Every task's options, at MAD's baseline; a task rejects a change to another's option.
        **OPTION_DEFAULTS,
    )
    num_steps = TOKENS_PER_RUN // (64 * seq_len)
    # The model's vocabulary: the content tokens plus the task's special tokens (at defaults;
    # an option that adds tokens, such as noise_vocab_size, needs model.vocab_size raised too).
    return synthetic_preset(
        data,
        vocab_size=mad_num_tokens(task, vocab_size, seq_len),
        max_length=seq_len,
        learning_rate=3e-3,
        warmup_steps=num_steps // 10,
        num_steps=num_steps,
        eval_every=num_steps,  # once, at the end
        log_every=max(num_steps // 10, 1),
        checkpoint_every=num_steps // 2,
        smoke=smoke,
    )
