"""Linear attention in JAX: kernels, Flax NNX modules, models, training and experiments."""
