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

``<task>_paper`` (``in_context_recall_paper``, ...) is MAD's own protocol for the task at its
baseline setting (`paper_preset` lists the source files and every difference): d_model 128,
batch 128 for 200 epochs (20,000 steps at 12,800 examples), AdamW at lr 5e-4 without weight
decay; ``<task>_paper.<field>-<value>`` is one of MAD's harder settings
(``in_context_recall_paper.seq_len-512``; `mad_changes` lists them), and
``configs/sweeps/mad.py:paper`` runs them all with MAD's lr × weight-decay grid and scores
MAD's way.
They are the presets a device runs; on the CPU they are smoke-tested only. Their size from
``la-train ... --dry_run`` (2-core CPU, softmax): in_context_recall_paper 406,144 parameters,
2.81M FLOPs per token, a 1.08 GB train step; selective_copying_paper (length 256) 406,656,
3.21M, 3.23 GB.

Each preset run once with its default mixer (softmax, seed 0): the command, wall time, load and
every record are in docs/results/presets_cpu/mad_<task>.json, the figures in
docs/results/config_docstring_runs.md; the study over mixers: docs/studies/mad.md.
"""

from linear_attention.data.mad import (
    MAD_CHANGES,
    MAD_SETTINGS,
    MAD_TRAIN_EXAMPLES,
    OPTION_DEFAULTS,
    TASKS,
    mad_changes,
    mad_num_tokens,
)
from linear_attention.fields import did_you_mean
from linear_attention.training.presets import synthetic_preset

# MAD's own protocol (`paper_preset`), one preset per task at MAD's baseline setting.
PAPER = tuple(f"{task}_paper" for task in TASKS)
PRESETS = (*TASKS, *PAPER, "smoke")
# One budget in tokens for every task, 200 steps of batch 64 at length 128 (1.6M tokens):
# a few minutes on 2 CPU cores whatever the task's length.
TOKENS_PER_RUN = 200 * 64 * 128
PAPER_EPOCHS, PAPER_BATCH = 200, 128
# Every one of MAD's settings is a preset: ``<task>_paper`` (the baseline) and
# ``<task>_paper.<field>-<value>`` (one change, `mad_changes`), e.g.
# ``in_context_recall_paper.seq_len-512``.
PAPER_SETTINGS = tuple(
    f"{task}_paper{suffix}"
    for task in TASKS
    for suffix in ("", *(f".{label}" for label, _ in mad_changes(task)))
)


def get_config(arg=None):
    if arg in PAPER_SETTINGS:
        task, _, label = arg.partition("_paper")
        return paper_preset(task, **dict(mad_changes(task)).get(label.removeprefix("."), {}))
    if arg not in PRESETS:
        raise ValueError(
            f"unknown preset {arg!r}{did_you_mean(arg, (*PRESETS, *PAPER_SETTINGS))} for "
            "configs/mad.py; "
            f"presets: {PRESETS} (and MAD's "
            "settings <task>_paper.<field>-<value>, `mad_changes`)"
        )
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


def paper_preset(task, **change):
    """MAD's protocol for ``task`` at its baseline, or at one of its settings (``change``: the
    fields `mad_changes` varies), as mad-lab (``athms/mad-lab``, commit 0f49a45) runs it:
    ``configs/tasks/<task>.yml`` (the baseline and the changes), ``mad/configs.py`` (MADConfig's
    training defaults and ``make_benchmark_mad_configs``' lr × weight-decay grid), ``train.py``
    and ``mad/model/pl_model_wrapper.py`` (the loop), ``configs/layers/*.yml`` (the layers),
    ``mad/analysis.py`` (the score), as read there:

    - data: the baseline settings (`MAD_SETTINGS`, `OPTION_DEFAULTS`; `MAD_TRAIN_EXAMPLES`:
      12,800 training examples, 256 for memorization), 1,280 test examples, seed 12345; the
      changes (`mad_changes`) vary one of vocab_size, seq_len, num_train_examples,
      noise_fraction (noisy recall), num_tokens_to_copy (selective copying).
    - model: width 128, layers ``mh-attention swiglu mh-attention swiglu`` (two blocks of a
      mixer and a SwiGLU MLP of width 352), pre-norm RMSNorm, untied output head, no position
      embedding; attention has 16 heads with rotary positions on their 8 dims, no short conv.
    - training: batch 128, 200 epochs (``ceil(examples / 128)`` steps each: 20,000 steps at
      12,800 examples), AdamW (β 0.9, 0.999; ε 1e-8) at lr 5e-4 and weight decay 0 (the
      benchmark sweeps lr {1e-4, 5e-4, 1e-3} × weight decay {0, 0.1}), no warmup, cosine per
      epoch to 1e-6, no clipping; the test set evaluated every epoch, and training stops once
      its accuracy reaches 0.999 (Lightning's ``stopping_threshold``).
    - score: class-macro accuracy of the final model on the test set (``eval/accuracy``, as
      here); a task's MAD score is the mean over its settings of the best of the six
      lr × weight-decay runs (``configs/sweeps/mad.py:paper``).

    Taken as they are: the task settings, the model's width, depth, heads and MLP width, the
    batch, the epochs, the optimizer, the schedule's end, the early stop, the metric. The
    differences:

    - mixer: softmax with rotary positions on every dim of its 8-dim heads, this library's
      kernel; the study sets ``--config.model.mixer`` (and the position, the heads) per mixer.
    - compression: MAD decodes the compressed token with a separate MLP; here position queries
      replace that decoder (`linear_attention.data.mad`), and attention can look back at the
      tokens.
    - vocabulary: the sizes count content tokens, the special tokens (pad, copy,
      blank, compress, positions) are added on top; MAD counts them inside its vocab_size, so a
      task here has one or two more content tokens than MAD's at the same setting (memorization:
      256 keys and values where MAD has 255).
    - batches: each step draws 128 distinct training examples at random (keyed by seed and
      step) instead of shuffled epochs; steps per epoch round up as MAD's do, so the run sees
      the same number of batches.
    - the MLP: SwiGLU with SiLU; MAD's ``swiglu`` gates with a sigmoid. Float32 throughout
      (MAD trains in bfloat16); AdamW decays the embeddings too (as MAD's torch AdamW does).
    - the schedule decays per step (to 1e-6 at the last step), MAD's per epoch.
    """
    unknown = sorted(set(change) - set(MAD_CHANGES[task]))
    if unknown:
        raise ValueError(
            f"{unknown[0]!r} is not one of MAD's changes of {task!r}; "
            f"changes: {tuple(MAD_CHANGES[task])}"
        )
    vocab_size, seq_len = MAD_SETTINGS[task]
    settings = dict(vocab_size=vocab_size, seq_len=seq_len)
    settings["num_train_examples"] = MAD_TRAIN_EXAMPLES[task]
    settings.update(change)
    vocab_size, seq_len = settings.pop("vocab_size"), settings.pop("seq_len")
    num_train = settings.pop("num_train_examples")
    per_epoch = -(-num_train // PAPER_BATCH)
    steps = PAPER_EPOCHS * per_epoch
    options = {**OPTION_DEFAULTS, **settings}
    data = dict(
        kind="mad",
        task=task,
        vocab_size=vocab_size,
        seq_len=seq_len,
        num_train_examples=num_train,
        num_test_examples=1_280,
        **options,
    )
    config = synthetic_preset(
        data,
        vocab_size=mad_num_tokens(task, vocab_size, seq_len, **options),
        max_length=seq_len,
        learning_rate=5e-4,
        warmup_steps=0,
        num_steps=steps,
        eval_every=per_epoch,
        log_every=per_epoch,
        checkpoint_every=10 * per_epoch,
    )
    config.seed = 12345
    config.model.update(
        d_model=128,
        num_heads=16,
        conv=0,
        position="rope",
        mlp_dim=352,
        tie_embeddings=False,
    )
    config.optimizer.update(
        weight_decay=0.0, b2=0.999, eps=1e-8, grad_clip=0.0, min_lr_ratio=1e-6 / 5e-4
    )
    config.train.update(batch_size=PAPER_BATCH, stop_at=0.999)
    return config
