"""The models of the length-generalisation study that the LM sweep does not train.

Command (2 CPU cores, a few minutes per model at ``:cpu``):

    python experiments/sweep.py --config configs/sweeps/length_gen.py:cpu \
        --workdir runs/length-gen

Softmax attention with learned absolute and with rotary position embeddings, and sliding-window
softmax (``swa``, window ``config.model.options.window``), trained exactly as
``configs/sweeps/lm.py``
trains its variants (the same base, preset, seed, steps and learning rate; d_model 128, the
short convolution on, like every model there). Softmax with no position embedding and the linear
mixers are the LM sweep's own runs. ``experiments/length_gen.py`` then evaluates all of them on
windows up to 16x the training length (docs/studies/length_generalisation.md). The learned table
has ``model.max_length`` = 2048 rows, of which training reaches the first ``data.seq_len`` =
128.

Presets: ``cpu`` (the LM sweep's ``:cpu``: 2 layers, sequence 128, batch 32, 400 steps,
lr 3e-3).
"""

from pathlib import Path

import ml_collections

from linear_attention.training.cli import load_config_file

PRESETS = ("cpu",)

# (label, mixer, d_model, position): softmax's width; positions add no parameter that training
# reaches except the learned table's first seq_len rows (16k of ~560k)
VARIANTS = (
    ("softmax-learned", "softmax", 128, "learned"),
    ("softmax-rope", "softmax", 128, "rope"),
    ("swa", "swa", 128, "none"),
)


def _lm_sweep(preset):
    return load_config_file(str(Path(__file__).resolve().parent / "lm.py") + f":{preset}")


def get_config(arg=None):
    arg = arg or "cpu"
    if arg not in PRESETS:
        raise ValueError(
            f"unknown preset {arg!r} for configs/sweeps/length_gen.py; presets: {PRESETS}"
        )
    config = _lm_sweep(arg)
    config.grid.mixer = ml_collections.ConfigDict(
        dict(
            field=("model.mixer", "model.d_model", "model.position"),
            choices=tuple((mixer, d, position) for _, mixer, d, position in VARIANTS),
            labels=tuple(label for label, *_ in VARIANTS),
        )
    )
    return config
