"""``python experiments/eval.py --workdir runs/mqar``: the ``la-eval`` command as a script
(the package importable: ``pip install -e .``; see `linear_attention.training.eval_cli`)."""

import sys

from linear_attention.training.eval_cli import eval_main

if __name__ == "__main__":
    sys.exit(eval_main())
