"""Byte-level language model on the built-in corpus (the Python standard library's source).

Command (2 CPU cores; validation bits-per-byte well below 8, then a generated sample):

    python experiments/train.py --config configs/lm.py:cpu --workdir runs/lm

What the ``cpu`` preset reaches (validation bits per byte by step, packed and unpacked, and on
which Python): docs/results/config_docstring_runs.md; packing's effect on the comparison:
docs/studies/packing.md; the mixers compared: docs/studies/lm.md. The built-in
corpus is the running Python's standard library, so the figures depend on the Python version
and its installation.

Any mixer or hybrid (names per layer, repeated): ``--config.model.mixer=softmax``,
``--config.model.mixer=gated,softmax``; another corpus: ``--config.data.path=/file/or/folder``.

Presets (``configs/lm.py:<arg>``):
  (none) / ``default``: an accelerator run: 8 layers, d_model 512, sequence 1024, bfloat16
      compute, the whole standard library (~30 MB).
  ``cpu``: 2 layers, d_model 128, sequence 128, batch 32, 600 steps on 8 MB of the corpus.
  ``smoke``: a tiny run for tests (seconds, learns little).

Paper-size presets (accelerators; size them first with ``--dry_run``, BENCHMARKS.md "Paper-size
presets"). All: vocabulary 32,000 (the model is sized for the papers' Llama / Mistral
tokenizers), 0.5M tokens per step, AdamW (β 0.9, 0.95; clip 1.0) with cosine decay to 0.1 of
the peak, bfloat16 compute, SwiGLU width 2.75·d (flash-linear-attention's ``hidden_ratio 4``).
Parameter counts are this library's (from the dry run); the published sizes are nominal.
  ``transformer_340m``, ``transformer_1.3b``: the transformer++ baselines of the GLA paper
      (Yang et al. 2024, "Gated Linear Attention Transformers with Hardware-Efficient
      Training", section 5.1: 340M on 15B tokens, 1.3B on 100B; lr 3e-4, weight decay 0.01,
      sequence 2048): d 1024 / 2048, 24 layers, 16 heads, rotary, tied embeddings.
      341.1M and 1298.8M parameters: within 0.3% of 340M and 1.3B.
  ``gla_340m``, ``gla_1.3b``: GLA in the same setting: d 1024 / 2048, 24 layers, 4 heads, the
      low-rank (16) key-wise gate, per-head output norm and swish output gate, no convolution.
      367.1M and 1401.1M parameters, 8% over 340M and 1.3B: the paper halves the key width
      (``expand_k = 0.5``), this library's GLA keeps q, k and v at ``head_dim``, so q and k
      projections hold d² more per layer (24 · d²: 25M and 101M).
  ``gated_deltanet_400m``, ``gated_deltanet_1.3b``: Gated DeltaNet (Yang, Kautz and
      Hatamizadeh 2025, "Gated Delta Networks": 1.3B on 100B tokens at sequence 4096; lr 4e-4,
      weight decay 0.1, 1B warmup tokens; its ablations use ~400M models on 15B tokens), heads
      of 256 keys as in flash-linear-attention's ``gated_deltanet``, the short convolution (4),
      output gate, untied embeddings. ``1.3b``: d 2048, 21 layers, 6 heads (that config's
      shape): 1189.2M parameters, because the published model expands the values 2×
      (``expand_v = 2``: 512 per head) and this library's mixer does not (values are
      ``head_dim`` wide), so v, the output gate and the output projection are half as wide:
      21 · 3 · d · 1536 = 198M fewer (with them 1387M: the published 1.3B is nominal).
      ``400m``: d 1024, 24 layers, 4 heads (keys and values 1024 wide, as d): 399.6M
      parameters, within 0.1% of 400M (the ablations' exact shape is not reproduced).
  ``kda_400m``, ``kda_1.3b``: Kimi Delta Attention. The Kimi Linear paper (Kimi Team 2025,
      "Kimi Linear: An Expressive, Efficient Attention Architecture") trains no dense KDA
      model of these sizes: its models are 48B-parameter mixture-of-experts hybrids (3 KDA
      layers to 1 MLA layer, 1.4T and 5.7T tokens), which this library cannot build (no
      experts, no MLA). So the presets are KDA in the Gated DeltaNet paper's settings above
      (sequence 4096, lr 4e-4, weight decay 0.1, 1B warmup tokens, untied embeddings; 15B
      and 100B tokens), with flash-linear-attention's ``kda`` layer: heads of 128 keys and
      values (``expand_v = 1``), the short convolution (4), the low-rank (128) per-channel
      decay and sigmoid output gate, SwiGLU 2.75·d. ``1.3b``: that library's default ``kda``
      model, d 2048, 24 layers, 16 heads: 1391.1M parameters, 7% over the nominal 1.3B, the
      shape's own size (flash-linear-attention's modules of the same shape hold 1390.9M; per
      layer, this library's convolution has 6,144 biases and its output norm a scale per head,
      2,048 against one shared 128). No layer is cut to reach 1.3B, so the model is the one
      flash-linear-attention's ``kda`` users train. ``400m``: the ablation scale, whose shape
      is not published; ``gated_deltanet_400m``'s d 1024 and 24 layers, as 8 heads of 128:
      387.1M parameters, 3.2% under 400M, because KDA's output gate is low-rank (2·d·128
      against Gated DeltaNet's d×d) and its decay's low rank adds 2·d·128: 24·(d² − 4·128·d)
      = 12.6M fewer than ``gated_deltanet_400m`` (12.5M with the smaller per-head parts).

TPU slices (``config.mesh.target``; BENCHMARKS.md "Paper-size presets"): a preset that names a
slice ships with the remat, accumulation and FSDP with which XLA:TPU compiled its train step
for that slice and found that it fits (``la-train --config configs/lm.py:<preset> --dry_run``
compiles it again, on any machine with libtpu). On another slice, add
``--config.mesh.target=tpu:<gen>:<topology> --dry_run --fit`` to find a setting that fits it.
  ``gated_deltanet_400m``: ``tpu:v5e:2x2`` with remat=block, grad_accum_steps=4, fsdp=True:
      13.40 GiB of a chip's 15.75 GiB (4 chips, 8 rows of 4096 per chip per micro-batch).
      With no remat, no accumulation and replicated state (as first shipped) the step needs
      313.81 GiB per chip there; on ``tpu:v5e:4x4``, ``--fit`` finds remat=block alone
      (15.30 GiB, replicated state). A single chip (``1x1``) was not compiled.
  ``kda_400m``: ``tpu:v5e:2x2`` with remat=block, grad_accum_steps=4, fsdp=True: 14.14 GiB.
  ``transformer_340m``: ``tpu:v5e:2x2`` with remat=block, grad_accum_steps=8, fsdp=True:
      11.48 GiB (8 rows of 2048 per chip per micro-batch).
  ``gla_340m``: ``tpu:v5e:2x2`` with remat=block, grad_accum_steps=8, fsdp=True: 6.57 GiB.
  ``transformer_1.3b``: ``tpu:v5e:2x2`` with remat=block, grad_accum_steps=16, fsdp=True:
      13.82 GiB (4 chips, 4 rows of 2048 per chip per micro-batch), ``--fit``'s answer on 2x2
      (with accumulation 8 it needs 17.59 GiB there); on ``tpu:v5e:2x4`` accumulation 8 fits
      (9.93 GiB).
  ``gla_1.3b``: ``tpu:v5e:2x2`` with remat=block, grad_accum_steps=16, fsdp=True: 14.37 GiB
      (4 rows of 2048 per chip per micro-batch); on ``tpu:v5e:2x4`` accumulation 8 fits
      (9.80 GiB).
  ``gated_deltanet_1.3b``: ``tpu:v5e:2x2`` with remat=block, grad_accum_steps=16, fsdp=True:
      13.47 GiB (2 rows of 4096 per chip per micro-batch); with accumulation 8 it needs
      17.80 GiB there; on ``tpu:v5e:2x4`` accumulation 4 fits (14.23 GiB).
  ``kda_1.3b``: ``tpu:v5e:2x2`` with remat=block, grad_accum_steps=32, fsdp=True: 12.71 GiB
      (1 row of 4096 per chip per micro-batch); with accumulation 16 it needs 15.97 GiB there;
      on ``tpu:v5e:2x4`` accumulation 8 fits (11.21 GiB).
  v5e 2x2 is the smallest slice the dry run can describe (libtpu refuses ``v5e:1x1``: its
  chips per host are 2x2x1), so every preset here is on the smallest slice it can name.

H100s (``configs/lm.py:<preset>@h100``: the preset with ``--config.mesh.target=gpu:h100:N`` and
the setting below; BENCHMARKS.md "XLA:GPU's bytes per GPU"): the fewest H100 80 GB GPUs on which
XLA:GPU, compiling the train step without a GPU, found that it fits (its peak bytes at most the
GPU's 79.11 GiB), with the remat and accumulation. One H100 holds every preset, its state
replicated (FSDP is moot on one GPU), with remat=block. The accumulation is the TPU preset's
halved where that was compiled and fits (the 340m and 1.3b presets; at the TPU's own
accumulation they need 25.7 to 42.4 GiB); the 400m presets keep the TPU's 4 (at 2 their 40.5 GiB
of temporaries would about double, past 79 GiB: not compiled).
  ``transformer_340m``: 1 H100 with remat=block, grad_accum_steps=4: 51.96 GiB (64 rows of 2048
      per micro-batch).
  ``gla_340m``: 1 H100 with remat=block, grad_accum_steps=4: 44.54 GiB.
  ``gated_deltanet_400m``: 1 H100 with remat=block, grad_accum_steps=4: 45.03 GiB (32 rows of
      4096 per micro-batch).
  ``kda_400m``: 1 H100 with remat=block, grad_accum_steps=4: 44.79 GiB, as gated_deltanet_400m.
  ``transformer_1.3b``: 1 H100 with remat=block, grad_accum_steps=8: 55.53 GiB.
  ``gla_1.3b``: 1 H100 with remat=block, grad_accum_steps=8: 52.78 GiB.
  ``gated_deltanet_1.3b``: 1 H100 with remat=block, grad_accum_steps=8: 43.82 GiB.
  ``kda_1.3b``: 1 H100 with remat=block, grad_accum_steps=16: 41.44 GiB.

Documents are packed (``data.pack``): each file is a document, and states, conv and attention
reset at each document start (``--config.data.separator='\\n\\n\\n'`` cuts files further).

The model is gated linear attention (data-dependent decay per head, as in Mamba-2 / simple
GLA) with the short causal convolution, SwiGLU MLPs and no position embedding (the decay and
the convolution carry order). bits-per-byte = eval/loss / ln 2 (tokens are bytes).
"""

import ml_collections

from linear_attention.fields import did_you_mean
from linear_attention.training.config import (
    mesh_section,
    model_section,
    optimizer_section,
    train_section,
)

# Published settings (see `_paper_size`): the model, the sequence, the batch in tokens, the
# training tokens and the optimizer of each paper's runs.
_GLA_OPT = dict(lr=3e-4, weight_decay=0.01, warmup_tokens=500e6, seq=2048)
_GDN_OPT = dict(lr=4e-4, weight_decay=0.1, warmup_tokens=1e9, seq=4096)
PAPER_SIZES = {
    "transformer_340m": dict(
        mixer="softmax", d_model=1024, num_layers=24, num_heads=16, tokens=15e9, **_GLA_OPT,
        tpu=dict(target="tpu:v5e:2x2", remat="block", grad_accum_steps=8, fsdp=True),
        h100=dict(count=1, remat="block", grad_accum_steps=4),
    ),
    "transformer_1.3b": dict(
        mixer="softmax", d_model=2048, num_layers=24, num_heads=16, tokens=100e9, **_GLA_OPT,
        tpu=dict(target="tpu:v5e:2x2", remat="block", grad_accum_steps=16, fsdp=True),
        h100=dict(count=1, remat="block", grad_accum_steps=8),
    ),
    "gla_340m": dict(
        mixer="gla", d_model=1024, num_layers=24, num_heads=4, tokens=15e9, **_GLA_OPT,
        tpu=dict(target="tpu:v5e:2x2", remat="block", grad_accum_steps=8, fsdp=True),
        h100=dict(count=1, remat="block", grad_accum_steps=4),
    ),
    "gla_1.3b": dict(
        mixer="gla", d_model=2048, num_layers=24, num_heads=4, tokens=100e9, **_GLA_OPT,
        tpu=dict(target="tpu:v5e:2x2", remat="block", grad_accum_steps=16, fsdp=True),
        h100=dict(count=1, remat="block", grad_accum_steps=8),
    ),
    "gated_deltanet_400m": dict(
        mixer="gated_deltanet", d_model=1024, num_layers=24, num_heads=4, head_dim=256,
        tokens=15e9, tie=False, **_GDN_OPT,
        tpu=dict(target="tpu:v5e:2x2", remat="block", grad_accum_steps=4, fsdp=True),
        h100=dict(count=1, remat="block", grad_accum_steps=4),
    ),
    "gated_deltanet_1.3b": dict(
        mixer="gated_deltanet", d_model=2048, num_layers=21, num_heads=6, head_dim=256,
        tokens=100e9, tie=False, **_GDN_OPT,
        tpu=dict(target="tpu:v5e:2x2", remat="block", grad_accum_steps=16, fsdp=True),
        h100=dict(count=1, remat="block", grad_accum_steps=8),
    ),
    "kda_400m": dict(
        mixer="kda", d_model=1024, num_layers=24, num_heads=8, head_dim=128,
        tokens=15e9, tie=False, **_GDN_OPT,
        tpu=dict(target="tpu:v5e:2x2", remat="block", grad_accum_steps=4, fsdp=True),
        h100=dict(count=1, remat="block", grad_accum_steps=4),
    ),
    "kda_1.3b": dict(
        mixer="kda", d_model=2048, num_layers=24, num_heads=16, head_dim=128,
        tokens=100e9, tie=False, **_GDN_OPT,
        tpu=dict(target="tpu:v5e:2x2", remat="block", grad_accum_steps=32, fsdp=True),
        h100=dict(count=1, remat="block", grad_accum_steps=16),
    ),
}  # fmt: skip
PRESETS = ("default", "cpu", "smoke", *PAPER_SIZES)


def get_config(arg=None):
    arg = arg or "default"
    preset, at, chip = arg.partition("@")  # <paper preset>@h100: its stated H100 setting
    if preset not in PRESETS or at and (chip != "h100" or preset not in PAPER_SIZES):
        raise ValueError(
            f"unknown preset {arg!r}{did_you_mean(preset, PRESETS)} for configs/lm.py; "
            f"presets: {PRESETS}, and a paper-size preset's H100 setting: <preset>@h100"
        )
    config = ml_collections.ConfigDict()
    config.seed = 0

    config.data = ml_collections.ConfigDict()
    config.data.kind = "text"
    config.data.path = ""  # "": the built-in corpus (the standard library's *.py files)
    config.data.seq_len = 1024
    config.data.max_bytes = 0  # 0: the whole corpus
    config.data.val_fraction = 0.02
    config.data.num_val_windows = 512
    # Documents packed with segment ids: each file is a document, the model's states, conv and
    # attention reset at every document start (a separator, e.g. "\n\n\n", cuts files further).
    config.data.pack = True
    config.data.separator = ""
    config.data.tokenizer = "bytes"  # or a tokenizer.json / sentencepiece .model (la-tokenizer)
    config.data.text_field = "text"  # JSONL field / Parquet column of the text
    config.data.loader = "windows"  # or "grain": epochs of shuffled packed documents

    # Only what differs from ModelConfig's defaults; every model field (each mixer's options
    # included, `la-train --help` lists them) can still be set with --config.model.FIELD=VALUE.
    model = config.model = model_section(
        vocab_size=256,
        d_model=512,
        num_layers=8,
        num_heads=8,
        mixer="gated",
        conv=4,
        mlp=True,
        max_length=2048,  # >= seq_len; also bounds prompt + sample_tokens at the end
        dtype="bfloat16",
    )

    # Only what differs from the dataclasses' defaults; every field can still be overridden.
    config.optimizer = optimizer_section(
        learning_rate=1e-3, weight_decay=0.1, warmup_steps=1000, min_lr_ratio=0.1, b2=0.95
    )
    config.train = train_section(
        num_steps=20_000,
        batch_size=64,
        sample_tokens=256,  # generated after training, from sample_prompt
        sample_prompt="def ",
        sample_temperature=0.8,
    )
    config.mesh = mesh_section()

    if arg == "cpu":
        config.data.seq_len = 128
        config.data.max_bytes = 8_000_000
        config.data.num_val_windows = 256
        model.d_model = 128
        model.num_layers = 2
        model.num_heads = 2
        model.dtype = "float32"
        config.optimizer.learning_rate = 3e-3
        config.optimizer.warmup_steps = 100
        config.train.num_steps = 600
        config.train.batch_size = 32
        config.train.eval_every = 200
        config.train.log_every = 50
        config.train.checkpoint_every = 200
        config.train.sample_tokens = 200
    elif preset in PAPER_SIZES:
        _paper_size(config, **PAPER_SIZES[preset], on_h100=bool(at))
    elif arg == "smoke":
        config.data.seq_len = 32
        config.data.max_bytes = 200_000
        config.data.num_val_windows = 16
        model.d_model = 32
        model.num_layers = 1
        model.num_heads = 2
        model.dtype = "float32"
        config.optimizer.warmup_steps = 2
        config.train.num_steps = 6
        config.train.batch_size = 8
        config.train.eval_every = 3
        config.train.log_every = 1
        config.train.checkpoint_every = 2
        config.train.sample_tokens = 8
    return config


def _paper_size(config, *, mixer, d_model, num_layers, num_heads, tokens, lr, weight_decay,
                warmup_tokens, seq, head_dim=None, tie=True, tpu=None, h100=None,
                on_h100=False):  # fmt: skip
    """A paper-size run: the model, sequence, batch of 0.5M tokens, token budget and AdamW
    settings of the paper; bfloat16 compute, float32 parameters; vocabulary 32,000 (the
    Llama / Mistral tokenizers' size: the model is sized for it, whatever tokenizer the data
    use). SwiGLU hidden width 2.75·d_model (the flash-linear-attention models' ``hidden_ratio
    4``: 2/3·4·d rounded up to a multiple of 256, which is exactly 2.75·d for d = 1024, 2048)."""
    model = config.model
    model.vocab_size = 32_000
    model.mixer, model.d_model, model.num_layers = mixer, d_model, num_layers
    model.num_heads, model.head_dim = num_heads, head_dim
    model.mlp_ratio = 2.75
    model.max_length = seq
    model.tie_embeddings = tie
    if mixer == "softmax":  # transformer++: rotary positions, no short convolution
        model.position, model.conv = "rope", False
    elif mixer == "gla":  # GLA: no convolution, no positions (the decay orders tokens)
        model.conv = False
    else:  # Gated DeltaNet and KDA: the short convolution on q, k, v (kernel 4)
        model.conv = 4
    config.data.seq_len = seq
    config.data.max_bytes = 0
    batch = 524_288 // seq  # 0.5M tokens per step
    config.train.batch_size = batch
    config.train.num_steps = round(tokens / (batch * seq))
    config.train.eval_every = config.train.checkpoint_every = 2000
    config.train.log_every = 50
    config.train.sample_tokens = 0
    opt = config.optimizer
    opt.learning_rate, opt.weight_decay = lr, weight_decay
    opt.warmup_steps = round(warmup_tokens / (batch * seq))
    opt.schedule, opt.min_lr_ratio = "cosine", 0.1
    opt.b1, opt.b2, opt.grad_clip = 0.9, 0.95, 1.0
    if on_h100:  # the fewest H100s and the setting XLA:GPU found to fit (module docstring)
        config.mesh.target, model.remat = f"gpu:h100:{h100['count']}", h100["remat"]
        config.train.grad_accum_steps, config.mesh.fsdp = h100["grad_accum_steps"], False
    elif tpu:  # the TPU slice and the setting XLA:TPU found to fit (see the module docstring)
        config.mesh.target, model.remat = tpu["target"], tpu["remat"]
        config.train.grad_accum_steps, config.mesh.fsdp = tpu["grad_accum_steps"], tpu["fsdp"]
