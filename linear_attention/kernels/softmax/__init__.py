"""Softmax attention and its windows: exact, blockwise (online softmax) and cached decoding
(`softmax.py`), sliding windows (`sliding_window.py`), and context parallelism
(`context_parallel.py`)."""
