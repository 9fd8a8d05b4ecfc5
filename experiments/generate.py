"""The ``la-generate`` command as a script (the package importable: ``pip install -e .``):
``python experiments/generate.py --workdir runs/lm --prompt "def " --num_tokens 200``
(see `linear_attention.training.generate_cli`)."""

import sys

from linear_attention.training.generate_cli import generate_main

if __name__ == "__main__":
    sys.exit(generate_main())
