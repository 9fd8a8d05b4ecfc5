"""``python experiments/eval.py --workdir runs/mqar``: the ``la-eval`` command, from a checkout
without installing (see `linear_attention.training.cli`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from linear_attention.training.cli import eval_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(eval_main())
