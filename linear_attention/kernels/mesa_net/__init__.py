"""MesaNet: two decayed statistics of the keys and an output from a regularised solve."""
