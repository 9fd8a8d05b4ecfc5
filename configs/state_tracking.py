"""State tracking (Grazzi et al., ICLR 2025; Merrill et al. 2024; DeltaProduct): train on
short sequences, evaluate on longer ones.

Command (2 CPU cores):

    python experiments/train.py --config configs/state_tracking.py:parity \
        --config.model.mixer=gated_deltanet --config.model.options.allow_neg_eigval=True \
        --workdir runs/parity_neg

Presets (``configs/state_tracking.py:<task>``): ``parity``, ``mod_arith`` (mod 5, no brackets,
``*`` before ``+ −``), ``s3``, ``s5``, ``s5_swaps`` (S5 with only the identity and the
transpositions as inputs), ``a5`` (group word problems: the label at every position is the
running product), and ``smoke`` (a tiny parity run for tests). ``parity_paper`` and
``mod_arith_paper`` are Grazzi et al.'s own settings (`paper_preset` lists the source files and
every difference): 2 layers at d_model 128, batch 256 for 20,000 steps on parity; 3 layers at
d_model 128, batch 1,024 for 100,000 steps on mod_arith. ``parity_fork_1layer`` is a
single-layer variant (1 layer, d_model 16, otherwise parity_paper's), from a file a third party
added to a fork of the authors' repository after the paper; it is not the authors' protocol.
Launch: ``python experiments/sweep.py --config configs/sweeps/state_tracking.py:parity_paper``
(or ``:parity_fork_1layer``); results: docs/studies/state_tracking.md.
``s3_paper``, ``s5_paper`` and ``a5_paper`` are DeltaProduct's (Siems et al. 2025;
`deltaproduct_preset` lists the source files and every difference): one gated_deltaproduct
layer at d_model 128, trained on sequences of exactly 128 elements and tested at 512, batch
2048 for 4,900 steps (10.0M sequences). Their size from ``la-train ... --dry_run`` on the 2-core
CPU: S3 398,480 parameters, 3.79M FLOPs per token, a 32.3 GB train step; S5 560,784, 6.09M,
57.3 GB; A5 545,424, 6.04M, 57.3 GB (4 Householder steps). For a device; smoke-tested here.
Training lengths 3–40, evaluation at lengths 40, 64, 128 and 256 (512 sequences each), as
Grazzi et al. (train 3–40, test 40–256).
``eval/length_{L}/accuracy``: sequence-level for parity and mod_arith (one label per sequence),
token-level for the group tasks; ``eval/accuracy`` is their mean over the lengths and
``eval/scaled_accuracy`` = (accuracy − chance) / (1 − chance), Grazzi et al.'s score.

Model and budget (`linear_attention.training.presets.synthetic_preset`): 2 layers, d_model 64,
2 heads, MLP, the short conv, softmax by default (``--config.model.mixer=...`` compares mixers
on the same backbone); AdamW at lr 1e-3, 50 warmup steps then cosine, batch 64, 500 steps,
one evaluation at the end. Sized to minutes on 2 CPU cores. Each preset run once with its
default mixer (softmax, seed 0): the command, wall time, load and every record are in
docs/results/presets_cpu/<task>.json, the figures and the runs toward the issue's parity
measure in docs/results/config_docstring_runs.md; the study: docs/studies/state_tracking.md.
"""

from linear_attention.data.state_tracking import TASKS, task_vocab_size
from linear_attention.fields import did_you_mean
from linear_attention.training.presets import synthetic_preset

# Grazzi et al.'s own protocol (`paper_preset`): parity and modular arithmetic.
PAPER = ("parity_paper", "mod_arith_paper")
# The single-layer parity variant of a fork of the authors' repository (`paper_preset`).
FORK = ("parity_fork_1layer",)
# DeltaProduct's protocol (`deltaproduct_preset`): the group word problems.
GROUP_PAPER = ("s3_paper", "s5_paper", "a5_paper")
PRESETS = (*TASKS, *PAPER, *FORK, *GROUP_PAPER, "smoke")
NUM_STEPS = 500
# Householder steps per token that one layer needs to carry the group (Siems et al.'s
# construction: an element that is a product of m transpositions takes m reflections; S3's
# 3-cycles are 2, the 5-cycles of S5 and A5 are 4).
HOUSEHOLDER_STEPS = {"s3": 2, "s5": 4, "a5": 4}


def get_config(arg=None):
    if arg not in PRESETS:
        raise ValueError(
            f"unknown preset {arg!r}{did_you_mean(arg, PRESETS)} for configs/state_tracking.py; "
            f"presets: {PRESETS}"
        )
    if arg in PAPER:
        return paper_preset(arg.removesuffix("_paper"))
    if arg in FORK:
        return paper_preset("parity", single_layer=True)
    if arg in GROUP_PAPER:
        return deltaproduct_preset(arg.removesuffix("_paper"))
    smoke = arg == "smoke"
    task = "parity" if smoke else arg
    data = dict(
        kind="state_tracking",
        task=task,
        seq_len=12 if smoke else 40,  # the longest training sequence
        min_len=3,
        eval_lengths=(12, 20) if smoke else (40, 64, 128, 256),
        num_eval_examples=20 if smoke else 512,
    )
    return synthetic_preset(
        data,
        vocab_size=task_vocab_size(task),
        max_length=32 if smoke else 256,
        learning_rate=1e-3,
        warmup_steps=NUM_STEPS // 10,
        num_steps=NUM_STEPS,
        eval_every=NUM_STEPS,  # once, at the end: an evaluation costs as much as ~50 steps
        log_every=50,
        checkpoint_every=NUM_STEPS // 2,
        smoke=smoke,
    )


def paper_preset(task, single_layer=False):
    """Grazzi et al.'s configuration files in their repository ``automl/unlocking_state_tracking``
    (commit df8f840), ``xlstm/experiments/parity_delta_net_2.yaml`` (parity) and
    ``mod_arithmetic_delta_net_2.yaml`` (modular arithmetic without brackets), as read there:

    - parity: 2 layers, d_model 128, 4 heads, short conv, DeltaNet with β ∈ (0, 2)
      (``sigmoid_scale: 2.0``); batch 256, 20,000 steps (5.12M sequences, the file's training
      count), lr 1e-3 with 2,000 linear warmup steps then cosine to 1e-3 × lr at the last step,
      weight decay 0, no gradient clipping; train lengths 3–40, test lengths 40–256.
    - mod_arith: the file has 2 layers, d_model 128, 4 heads, short conv, batch 256 and 100,000
      steps, lr 1e-3 with 10,000 warmup steps then cosine to 1e-3 × lr, weight decay 0.1, the
      same lengths, numbers mod 5; but its training count is 102,400,000 sequences
      (= 100,000 × 1,024), and the paper's appendix, as an issue on that repository (#3) reports
      it, gives 3 layers and batch 1,024. This preset takes the appendix's 3 layers and batch
      1,024 (102.4M sequences) and the file's other settings. The appendix itself was not read
      here.

    ``single_layer=True`` (``parity_fork_1layer``) is parity at 1 layer and d_model 16, from
    ``xlstm/experiments/parity_delta_net_2_single_layer.yaml`` in the fork
    ``adankow/unlocking_state_tracking`` (commit dd420c5), a file a third party added on
    2025-05-09, after the paper; the rest is parity_paper's.

    Taken as they are: the sizes, the budget, the schedule, the weight decay, AdamW, no
    clipping, the training lengths. The differences:

    - mixer: ``deltanet`` with ``allow_neg_eigval=True`` (the file's DeltaNet, β = 2·sigmoid);
      the study overrides ``--config.model.mixer`` and ``allow_neg_eigval``.
    - AdamW's β₂ is torch's default, 0.999 (the synthetic presets use 0.98); ε 1e-8.
    - the block: this library's (pre-norm RMSNorm, SwiGLU MLP, untied embeddings as the files'
      ``tie_weights: false``), where the authors use flash-linear-attention's DeltaNet model:
      the same parts, and at d_model 128 the same MLP width (512); its width is 2/3 · 4 ·
      d_model rounded up to a multiple of 256, so at the fork's d_model 16 it is 256 against
      64 here.
    - the DeltaNet layer: flash-linear-attention's has no output gate (``use_gate=False``, its
      default: RMSNorm only); this library's ``deltanet`` has the gate on (``out_gate``).
      flash-linear-attention's Gated DeltaNet has it too.
    - initialisation: flash-linear-attention's (the mixer's projections Xavier-uniform with gain
      2^−2.5, the embeddings and MLP N(0, 0.02), the MLP's down projection divided by
      √(2 · layers)) against this library's defaults.
    - weight decay reaches the embedding matrices here (AdamW decays every matrix); the files
      keep it off them (``weight_decay_on_embedding: false``). It matters on mod_arith only
      (parity's weight decay is 0).
    - precision: float32 throughout (the authors train in bfloat16 autocast).
    - evaluation: 512 sequences at each of the lengths 40, 64, 128 and 256, where the authors
      draw 8,192 test sequences with lengths uniform in 40–256; the paper's Table 3 reports the
      scaled accuracy (``eval/scaled_accuracy`` here, per length in ``eval/length_{L}/…``).
      Evaluated every 2,000 steps (the authors validate every 200).
    - data: parity's tokens are the bits {0, 1} and mod_arith's operators are ``+ − *`` in
      the library's encoding (`linear_attention.data.state_tracking`); the authors' token ids
      differ, the tasks do not.

    The authors' lr is the file's (1e-3; ``main.py`` takes ``--lr`` and ``--seed``); their
    repository has no lr grid. The paper reports one run per cell (its evaluation script names
    one saved run per model), not a mean or a best over a stated number of seeds.
    """
    parity = task == "parity"
    steps, warmup = (20_000, 2_000) if parity else (100_000, 10_000)
    config = synthetic_preset(
        dict(
            kind="state_tracking",
            task=task,
            seq_len=40,
            min_len=3,
            eval_lengths=(40, 64, 128, 256),
            num_eval_examples=512,
        ),
        vocab_size=task_vocab_size(task),
        max_length=256,
        learning_rate=1e-3,
        warmup_steps=warmup,
        num_steps=steps,
        eval_every=2_000 if parity else 10_000,
        log_every=200,
        checkpoint_every=2_000 if parity else 10_000,
    )
    config.model.update(
        d_model=16 if single_layer else 128,
        num_layers=(1 if single_layer else 2) if parity else 3,
        num_heads=4,
        mixer="deltanet",
    )
    config.model.options.allow_neg_eigval = True
    config.model.tie_embeddings = False
    config.optimizer.update(weight_decay=0.0 if parity else 0.1, b2=0.999, grad_clip=0.0)
    config.optimizer.min_lr_ratio = 1e-3
    config.train.batch_size = 256 if parity else 1_024
    return config


def deltaproduct_preset(task):
    """Siems et al.'s (DeltaProduct, 2025) group word problems, as their repository
    ``automl/DeltaProduct`` (commit 38cd4e4) runs them: ``README.md``'s S3 commands and the
    defaults of ``state_tracking/src/main.py`` and ``src/generate_data.py``, as read there:

    - data: 100,000 distinct random sequences of exactly 128 group elements, 99 % for training
      (99,000; ``train_size=0.99``), the label at every position the running product; tested
      on the 1 % test split (1,000 sequences) of a file of length 512 (``--k_test=512``).
    - model: flash-linear-attention's GatedDeltaProduct, 1 layer (``--n_layers=1``; the paper
      also varies it), hidden size 128, 8 heads of head_dim 32, MLP, no short conv, no output
      gate, no forget gate (``use_forget_gate=False``), untied embeddings, β ∈ (0, 2)
      (``--allow_neg_eigval=True``), n Householder steps (``--num_householder``; the paper
      varies it).
    - training: batch 2048, 100 epochs (49 batches each: 4,900 steps, 9.9M sequences, 1.27B
      tokens), AdamW lr 1e-3, β (0.9, 0.999), ε 1e-8, weight decay 1e-6, no clipping, cosine
      from the first step to 0 over the 100 epochs (``--use_scheduler=True``; no warmup),
      cross-entropy at every position; stop once the validation sequence accuracy reaches
      0.99 (``max_val_acc``).

    Taken as they are: the lengths, the model's sizes, the budget in steps, the optimizer and
    its schedule. ``num_householder`` defaults to what one layer needs in theory
    (`HOUSEHOLDER_STEPS`: S3 2, S5 and A5 4); the study sets it (and ``num_layers``) per run.
    The differences:

    - the mixer is ``gated_deltaproduct``, whose scalar decay (Gated DeltaNet's γ) has no
      switch: the authors' run has no forget gate.
    - data: fresh draws every step (keyed by seed and step), where the authors cycle a fixed
      set of 99,000 sequences 100 times (every batch here is full, 10.0M sequences against their
      9.9M, whose last batch of an epoch holds 696); their tokenizer prepends a BOS token
      (scored against a BOS label), here the first token is the first element.
    - score: ``eval/length_{L}/accuracy`` is token-level (every prefix's product), where the
      authors stop on and plot whole-sequence accuracy; evaluated at lengths 128 (in
      distribution) and 512 on 1,000 sequences each, every 490 steps (10 epochs; the authors
      validate every epoch), and no early stop: every run spends the full 4,900 steps.
    - AdamW decays the embedding matrix too (as the authors' torch AdamW does); float32
      throughout, where the authors cast the model to bfloat16.
    - the block: this library's (pre-norm RMSNorm, SwiGLU MLP of ratio 4), where the authors use
      flash-linear-attention's: the same parts and the same MLP width, 512 (its 2/3 · 4 · 128
      rounded up to a multiple of 256).
    """
    steps, per_epoch = 4_900, 49
    config = synthetic_preset(
        dict(
            kind="state_tracking",
            task=task,
            seq_len=128,
            min_len=128,  # every training sequence exactly 128 long
            eval_lengths=(128, 512),
            num_eval_examples=1_000,
        ),
        vocab_size=task_vocab_size(task),
        max_length=512,
        learning_rate=1e-3,
        warmup_steps=0,
        num_steps=steps,
        eval_every=10 * per_epoch,
        log_every=per_epoch,
        checkpoint_every=10 * per_epoch,
    )
    config.model.update(
        d_model=128,
        num_layers=1,
        num_heads=8,
        head_dim=32,
        mixer="gated_deltaproduct",
        conv=0,
        out_gate=False,
        tie_embeddings=False,
    )
    config.model.options.update(num_householder=HOUSEHOLDER_STEPS[task], allow_neg_eigval=True)
    config.optimizer.update(weight_decay=1e-6, b2=0.999, eps=1e-8, grad_clip=0.0)
    config.train.batch_size = 2_048
    return config
