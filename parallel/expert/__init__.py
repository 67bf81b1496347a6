"""Expert parallelism (ep): the experts of each sparse layer spread over an ep sub-group of dp.

One concern per module; import from the module, not from this package:

    dispatch  the differentiable uneven all-to-all and `AllToAllDispatcher` (tokens to the ep
              ranks holding their experts and back)
    apply     cutting the experts per ep rank (expert-local construction), tp over the experts'
              FFN dim, and swapping the dispatcher in

The groups (ep, and edp = dp / ep for the expert gradients) live in `parallel.mesh`.
"""
