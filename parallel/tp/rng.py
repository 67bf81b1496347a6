"""Dropout under tensor parallelism (tp): masks drawn per tp rank where activations are split.

Megatron draws the dropout of model-parallel regions from a per-tp-rank generator
(`get_cuda_rng_tracker().fork()`) and the rest from one stream every tp rank shares. Here:

    site                                         activations on rank r     stream
    attention probabilities (`Attention`)        heads [r h/p, (r+1) h/p)  fork(r)
    FFN hidden (`activation_dropout`)            columns [r F/p, (r+1) F/p) fork(r)
      (also each expert's, NLLB-MoE)
    residual branches (`dropout`)                (B, T, H) replicated       shared
                                  with sequence parallelism: (B, T/p, H)    fork(r)
    embedding dropout                            (B, T, H) replicated       shared

so the masks of a split site are independent across ranks (their union is one mask of the
full activation, as on one device), and a replicated site draws one mask that every rank
applies. Under sequence parallelism the residual branches hold different tokens on every
rank: a shared stream would repeat one pattern across the T/p slices, so they fork too
(Megatron runs its whole sequence-parallel block inside the fork). The rule across the
other axes, restarts and remat is in `parallel.rng`.

A fork is stateless, unlike Megatron's tracker: it draws one number from the CPU generator
(the shared stream: the same draw on every tp rank), mixes in the tp rank and seeds the
device generator with it for the site's draw, then restores both. Nothing is left to save in
checkpoints, and `torch.utils.checkpoint`, which restores the CPU generator before it
recomputes a region, recomputes the same masks.

The model (`models.m2m100`) knows nothing of this: `install_tensor_parallel_rng` sets the
sites' `dropout_rng` hooks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from models.init import stable_seed
from models.m2m100 import Attention, DecoderLayer, EncoderLayer
from models.moe import Experts
from parallel.rng import seeded


class TensorParallelRng:
    """The per-tp-rank dropout stream of rank `tp_rank` (see the module docstring)."""

    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank

    @torch._dynamo.disable  # generator state on the host: never traced into a compiled layer
    def _seed(self) -> int:
        # A host tensor read through numpy: no device read (nor an `aten._local_scalar_dense`
        # that `parallel.dispatch_count` would count as one).
        shared = int(torch.randint(0, 2**62, (1,), generator=torch.default_generator).numpy()[0])
        return stable_seed(shared, "tp", self.tp_rank)

    @contextmanager
    def fork(self) -> Iterator[None]:
        """Within: the device generator draws this rank's stream; on exit the shared one goes on."""
        with seeded(self._seed(), cpu=False):
            yield


def install_tensor_parallel_rng(model: nn.Module, tp_rank: int, sequence_parallel: bool) -> int:
    """Point the tp-split dropout sites of `model` at rank `tp_rank`'s fork; returns how many.

    Args:
        model: a model after `apply_tensor_parallel`'s layer swaps (any pipeline stage).
        tp_rank: this rank's position in the tp group.
        sequence_parallel: the residual branches hold (B, T/p, H): fork them too.
    """
    rng = TensorParallelRng(tp_rank)
    count = 0
    for module in model.modules():
        if isinstance(module, Attention):
            module.dropout_rng = rng.fork
            count += 1
        elif isinstance(module, EncoderLayer | DecoderLayer):
            module.activation_dropout_rng = rng.fork
            count += 1
            if sequence_parallel:
                module.dropout_rng = rng.fork
                count += 1
        elif isinstance(module, Experts):  # each expert's F is split over tp (parallel.expert.apply)
            module.activation_dropout_rng = rng.fork
            count += 1
    return count
