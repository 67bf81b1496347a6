"""Megatron-style tensor parallelism (tp), applied to the single-device model from outside.

One concern per module; import from the module, not from this package:

    comm    the collectives and the autograd operators over the tp group (Megatron's
            f / g, the sequence-parallel all-gathers and reduce-scatters)
    layers  ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
            VocabParallelLMHead, the vocabulary partition and the parameter marks
    loss    the vocab-parallel cross-entropy and `gather_logits`
    rng     per-tp-rank dropout streams for the sites whose activations tp splits
    apply   `apply_tensor_parallel` / `TensorParallelInfo`, sequence parallelism, and
            the per-step helpers (sequence-parallel grad sync, grad norm, full state dict)

Imports run one way: comm <- layers, loss, rng <- apply.
"""
