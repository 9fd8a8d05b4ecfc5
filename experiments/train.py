"""Train from a config file: ``python experiments/train.py --config configs/mqar.py:cpu
--workdir runs/mqar``. The same entry point is installed as the ``la-train`` command."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from linear_attention.training.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
