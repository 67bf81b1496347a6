"""The bad-input error of `parallel/`: parallel sizes that cannot work as asked.

Raised where the sizes are checked (`ParallelDims.validate`: the mesh against the world, the
node and the model; a schedule's (p, m, v); a partition's balance), never for an internal
inconsistency, so the trainer's entry points can report it in one line (exit 2) and keep the
traceback of every other ValueError. Pure (imports nothing).
"""


class ParallelConfigError(ValueError):
    """Parallel sizes that do not fit the world, the node, the model or the schedule; the
    message names the flag (the trainer's `ParallelArguments` name), its value and what is valid."""
