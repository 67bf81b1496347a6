"""Expert parallelism (ep): the experts of each sparse layer spread over an ep sub-group of dp.

One concern per module; import from the module, not from this package:

    dispatch  the differentiable uneven all-to-all and `AllToAllDispatcher` (tokens to the ep
              ranks holding their experts and back), and `ReplicatedDispatcher` (evaluation and
              decoding: the ep peers hold the same tokens; local experts, then a sum over ep)
    apply     cutting the experts per ep rank (expert-local construction), tp over the experts'
              FFN dim (`TensorParallelExperts`), swapping the dispatchers in
    params    the mark of a cut expert parameter and its `LocalSlice`
    logical   the checkpoint view: one entry per expert under its transformers name

The groups (ep, and edp = dp / ep for the expert gradients) live in `parallel.mesh`; a step's
gradient work for experts (edp reduce, norm over ep) in `parallel.grads`.
"""
