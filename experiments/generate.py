"""The ``la-generate`` command from a checkout, without installing:
``python experiments/generate.py --workdir runs/lm --prompt "def " --num_tokens 200``
(see `linear_attention.training.cli`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from linear_attention.training.cli import generate_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(generate_main())
