"""Byte-level language model on the built-in corpus (the Python standard library's source).

Command (2 CPU cores; validation bits-per-byte well below 8, then a generated sample):

    python experiments/train.py --config configs/lm.py:cpu --workdir runs/lm

Measured (packed, the default): eval/bits_per_byte 2.47, 2.12, 1.98 at steps 200, 400, 600
(uniform bytes: 8; unpacked, ``--config.data.pack=False``: 2.46, 2.11, 1.96; EXPERIMENTS.md,
section 5); the unpacked run took 7.5 minutes (5.6k tokens/s) at a light load on a shared
2-core machine, the packed one 16 minutes at load ~10 (the load, not the packing).

Any mixer or hybrid (names per layer, repeated): ``--config.model.mixer=softmax``,
``--config.model.mixer=gated,softmax``; another corpus: ``--config.data.path=/file/or/folder``.

Presets (``configs/lm.py:<arg>``):
  (none) / ``default``: an accelerator run: 8 layers, d_model 512, sequence 1024, bfloat16
      compute, the whole standard library (~30 MB).
  ``cpu``: 2 layers, d_model 128, sequence 128, batch 32, 600 steps on 8 MB of the corpus.
  ``smoke``: a tiny run for tests (seconds, learns little).

Documents are packed (``data.pack``): each file is a document, and states, conv and attention
reset at each document start (``--config.data.separator='\\n\\n\\n'`` cuts files further).

The model is gated linear attention (data-dependent decay per head, as in Mamba-2 / simple
GLA) with the short causal convolution, SwiGLU MLPs and no position embedding (the decay and
the convolution carry order). bits-per-byte = eval/loss / ln 2 (tokens are bytes).
"""

import ml_collections
from ml_collections import config_dict

PRESETS = ("default", "cpu", "smoke")


def get_config(arg=None):
    arg = arg or "default"
    if arg not in PRESETS:
        raise ValueError(f"unknown preset {arg!r} for configs/lm.py; presets: {PRESETS}")
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

    model = config.model = ml_collections.ConfigDict()
    model.vocab_size = 256
    model.d_model = 512
    model.num_layers = 8
    model.num_heads = 8
    model.head_dim = config_dict.placeholder(int)
    model.mixer = "gated"
    model.feature_map = config_dict.placeholder(str)  # None: the mixer's default
    model.feature_dim = config_dict.placeholder(int)
    model.feature_scale = config_dict.placeholder(float)  # linear: φ(c·q), φ(c·k)
    model.conv = 4
    model.out_norm = config_dict.placeholder(bool)
    model.out_gate = config_dict.placeholder(bool)
    model.mlp = True
    model.mlp_ratio = 4.0
    model.position = "none"
    model.rope_base = 10000.0
    model.reset_positions = True  # packed rows: positions restart at each document
    model.max_length = 2048  # >= seq_len; also bounds prompt + sample_tokens at the end
    model.method = "chunk"
    model.chunk_size = 64
    model.eps = 1e-6
    model.allow_neg_eigval = False  # deltanet / gated_deltanet: β = 2·sigmoid in (0, 2)
    model.window = 64  # swa: tokens each layer sees (Based: mixer=taylor,swa)
    model.norm_eps = 1e-6
    model.redraw_interval = 0  # favor layers: redraw the random features every this many steps
    model.dtype = "bfloat16"
    model.param_dtype = "float32"
    model.tie_embeddings = True

    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.learning_rate = 1e-3
    config.optimizer.weight_decay = 0.1
    config.optimizer.warmup_steps = 1000
    config.optimizer.schedule = "cosine"
    config.optimizer.min_lr_ratio = 0.1
    config.optimizer.grad_clip = 1.0
    config.optimizer.b1 = 0.9
    config.optimizer.b2 = 0.95
    config.optimizer.eps = 1e-8

    config.train = ml_collections.ConfigDict()
    config.train.num_steps = 20_000
    config.train.batch_size = 64
    config.train.eval_batch_size = 0  # 0: the training batch size
    config.train.eval_every = 1000
    config.train.log_every = 100
    config.train.checkpoint_every = 1000
    config.train.keep_checkpoints = 3
    config.train.profile_steps = 0  # >0: trace that many steps for TensorBoard (jax.profiler)
    config.train.sample_tokens = 256  # generated after training, from sample_prompt
    config.train.sample_prompt = "def "
    config.train.sample_temperature = 0.8
    config.train.sample_top_k = 0  # 0: no top-k truncation

    config.mesh = ml_collections.ConfigDict()
    config.mesh.num_devices = 0  # 0: every device
    config.mesh.fsdp = False
    config.mesh.seq = 1  # devices splitting the time axis (sequence parallelism)
    config.mesh.multi_host = False  # one of several processes (jax.distributed)
    config.mesh.coordinator_address = ""  # "" / 0: from the environment or cluster
    config.mesh.num_processes = 0
    config.mesh.process_id = 0

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
