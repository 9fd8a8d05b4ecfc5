"""PaTH attention: softmax attention with keys transported by accumulated Householder transforms
(`path.py`: the reference, the dispatcher and decoding; `blockwise.py`: the O(T)-memory form)."""
