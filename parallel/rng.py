"""Dropout randomness on the mesh: which generator state each mask is drawn from.

The rule (Megatron's, made independent of the mesh). A mask is a function of the seed
and of the data it drops, never of where the work runs, except for the tp shard:

    micro-batch key   K = hash(seed, step, slot)       slot: the micro-batch's place in the
                                                       global batch (`BatchLayout.slot`)
    block stream      the device's default generator (and the CPU's) seeded with
                      hash(K, block name) when the block starts, restored when it ends
                      (`keyed_block`, entered by `parallel.pipeline.stage`)
    replicated sites  draw from the block stream: identical on every tp rank
                      (embedding dropout; the residual branches without sequence parallelism)
    tp-split sites    draw from a per-tp-rank fork of the block stream (`parallel.tp.rng`):
                      attention probabilities of the local heads, the FFN hidden of the local
                      columns, and under sequence parallelism the residual branches, whose
                      T/p slices are different tokens

What follows, axis by axis:

* pp: a block's masks do not depend on which stage holds it, on the schedule's order of
  micro-batches, on virtual stages or on what ran before it on the rank (Megatron instead
  offsets the seed per pp rank, so its masks change with the pipeline cut);
* dp: replicas hold different slots, so they draw different masks (Megatron's replicas share
  one stream on different data); a slot's masks are the same on any (pp, dp, m,
  gradient-accumulation) cut with the same global batch and tp, because the slot's
  examples are (`trainer.data.batching`);
* tp: the mesh changes the masks only through the tp size and rank (tp-split sites draw
  shapes and streams of the rank's shard): tp=2 and tp=1 agree in distribution, not bit
  for bit (measured in `tests/dist/test_tensor_parallel.py`);
* ep: the exception. An expert's dropout (`models.moe.Experts`) masks its buffer of tokens
  gathered from the ep group with the stream of the micro-batch its rank runs, so these masks
  change with ep (their distribution does not);
* restarts: nothing to save: the key holds the step, so a resumed run draws the masks the
  uninterrupted one drew (the RNG files of `trainer.checkpoint` are for everything else);
* remat: every block re-seeds at its start, and a tp fork takes its seed from the CPU
  generator, which `torch.utils.checkpoint(preserve_rng_state=True)` restores with the
  device's before it recomputes, so `full`, `selective` and `stage` recompute the masks
  their forwards drew, also when a zero-bubble schedule recomputes in its I action (its W
  reuses what I saved).

Without keys (a runner that does not pass them, evaluation) the model draws from the global
generators as it is, which every rank seeds alike (`trainer.run.setup`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from models.config import ModelConfig
from models.init import stable_seed
from models.m2m100 import BlockSpec


def uses_dropout(config: ModelConfig) -> bool:
    """Whether any dropout site of the model draws masks in training."""
    return max(config.dropout, config.attention_dropout, config.activation_dropout) > 0.0


def microbatch_keys(seed: int, step: int, slots: Sequence[Sequence[int]]) -> list[list[int]]:
    """K = hash(seed, step, slot) for each micro-batch of a replica's flushes ([flush][micro])."""
    return [[stable_seed(seed, f"dropout/{step}", slot) for slot in flush] for flush in slots]


def block_seed(key: int, spec: BlockSpec) -> int:
    """The seed of block `spec`'s stream for the micro-batch of key `key`."""
    return stable_seed(key, spec.name)


def current_device() -> torch.device:
    """The device whose default generator dropout draws from: the current CUDA device once
    CUDA is in use, else the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextmanager
def seeded(seed: int, device: torch.device | None = None, cpu: bool = True) -> Iterator[None]:
    """Within: `device`'s default generator (default `current_device()`) and, with `cpu`, the
    CPU's start from `seed`; on exit they are back where they were.

    A block seeds both, because dropout on a GPU draws from the device's generator while a tp
    fork takes its seed from the CPU's (`parallel.tp.rng`); the fork itself needs only the
    device's. Host work only: a CUDA generator's state is its seed and offset.
    """
    device = current_device() if device is None else device
    generators = [torch.default_generator] if cpu or device.type == "cpu" else []
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        generators.append(torch.cuda.default_generators[index])
    states = [g.get_state() for g in generators]
    try:
        for g in generators:
            g.manual_seed(seed)
        yield
    finally:
        for g, state in zip(generators, states):
            g.set_state(state)


@contextmanager
def keyed_block(key: int | None, spec: BlockSpec, device: torch.device | None = None) -> Iterator[None]:
    """Run block `spec` of the micro-batch keyed `key` on its own stream (`block_seed`);
    None: on the global generators as they are."""
    if key is None:
        yield
        return
    with seeded(block_seed(key, spec), device):
        yield
