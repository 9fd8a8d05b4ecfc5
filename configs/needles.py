"""RULER-style needle studies for ``la-eval --needles`` (docs/guides/evaluation.md).

    la-eval --workdir runs/lm --needles configs/needles.py:short --output runs/lm/needles.json

A preset sets the tasks, context lengths (tokens), depths, prompts per cell and answer length;
``--lengths``, ``--depths``, ``--samples`` and ``--answer_len`` on the command line replace the
preset's.

Presets (``configs/needles.py:<arg>``):
  ``smoke``: one task, two short lengths, three depths, two prompts a cell (a byte-level model
      at max_length >= 1024; seconds).
  ``short`` (default): every task at 1024, 2048 and 4096 tokens, five depths, four prompts a
      cell: a model trained here at 512-2048 tokens, read past its length.
  ``ruler``: every task at RULER's lengths 4096 ... 131072, eleven depths, 25 prompts a cell
      (an accelerator, a model whose max_length reaches 131072).
"""

import ml_collections

ALL_TASKS = (
    "niah_single_1,niah_single_2,niah_single_3,niah_multikey,niah_multivalue,niah_multiquery,vt"
)

PRESETS = {
    "smoke": dict(needles="niah_single_1", lengths="512,1024", depths="0,0.5,1", samples=2,
                  answer_len=32),
    "short": dict(needles=ALL_TASKS, lengths="1024,2048,4096", depths="0,0.25,0.5,0.75,1",
                  samples=4, answer_len=64),
    "ruler": dict(needles=ALL_TASKS, lengths="4096,8192,16384,32768,65536,131072",
                  depths=",".join(str(d / 10) for d in range(11)), samples=25, answer_len=128),
}  # fmt: skip


def get_config(arg=None):
    arg = arg or "short"
    if arg not in PRESETS:
        raise ValueError(f"unknown preset {arg!r}; allowed: {', '.join(PRESETS)}")
    return ml_collections.ConfigDict(PRESETS[arg])
