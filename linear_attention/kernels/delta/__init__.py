"""The delta rule and its generalisations: DeltaNet / Gated DeltaNet / KDA with grouped value
heads (`delta.py`: the scan reference and the chunkwise WY/UT forms), DPLR / RWKV-7
(`dplr.py`) and Gated DeltaProduct (`delta_product.py`, sub-tokens of the delta rule's chunk
kernel). Sequence parallelism for all of them is `primitives.combine.affine_sequence_parallel`."""
