"""Log-linear attention (Guo et al. 2025): a Fenwick-tree hierarchy of O(log T) level states per
position, each read with its own data-dependent weight (`log_linear.log_linear_attention`)."""
