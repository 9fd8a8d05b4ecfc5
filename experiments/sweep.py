"""A grid of training runs with the best learning rate kept per setting, as Zoology does.

    python experiments/sweep.py --config configs/sweeps/mqar.py:cpu --workdir runs/mqar-sweep
    python experiments/sweep.py --config configs/sweeps/lm.py:cpu --workdir runs/lm-sweep

The engine (grids, seeds, learning-rate selection, resume, workers, tables, figures) is
`linear_attention.training.sweep`; its `cli` module documents every option
(``python experiments/sweep.py --help``).
"""

import sys

from linear_attention.training.sweep import main

if __name__ == "__main__":
    sys.exit(main())
