"""``python -m linear_attention.training.sweep``: the sweep command (`cli.main`); with the single
argument ``--worker``, a worker process of a parallel sweep (`workers.worker_main`). The workers
are started this way, so a clean clone with ``pip install -e .`` finds them."""

import sys

from linear_attention.training.sweep.cli import main
from linear_attention.training.sweep.workers import worker_main

if __name__ == "__main__":
    sys.exit(worker_main() if sys.argv[1:] == ["--worker"] else main())
