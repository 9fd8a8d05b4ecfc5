"""Train from a config file: ``python experiments/train.py --config configs/mqar.py:cpu
--workdir runs/mqar``. The same entry point is installed as the ``la-train`` command."""

import sys

from linear_attention.training.cli import main

if __name__ == "__main__":
    sys.exit(main())
