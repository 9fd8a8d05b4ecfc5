"""Causal linear attention (optionally decayed per head or per key dimension): the dispatcher
(`linear.py`), the reference forms (`quadratic.py`, `recurrent.py`) and the fast ones
(`associative.py`, `chunked.py`, `chunk_parallel.py`), and sequence parallelism
(`sequence_parallel.py`, on `primitives.combine`)."""
