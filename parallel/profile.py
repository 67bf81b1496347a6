"""Measure each block's cost on a sample micro-batch, for `partition_method: time | memory`.

Every block runs forward and backward alone on the state the blocks before it
produce (inputs detached, so each timing covers one block only; a random
gradient stands in for the one the next block would send). Time is the median
of `repeats` runs after a warm-up; memory is the block's parameter bytes plus
the bytes autograd saves for its backward (activations), as GPipe/torchgpipe's
balance-by-memory counts them. The head's cost includes the output projection
and the loss over the full vocabulary, which is why the last stage tends to get
fewer decoder layers.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
from torch import Tensor

from models.loss import cross_entropy_sum
from models.m2m100 import BlockKind, BlockSpec, M2M100Translation, Seq2SeqBatch, State


def _saved_bytes(fn) -> tuple[object, int]:  # type: ignore[no-untyped-def]
    seen: set[int] = set()
    total = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if not isinstance(t, torch.nn.Parameter) and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


def profile_blocks(
    model: M2M100Translation, batch: Seq2SeqBatch, repeats: int = 3
) -> tuple[list[float], list[float], list[int]]:
    """(seconds fwd+bwd, bytes params+activations, parameter count) per block of `model.blocks`."""
    times, mems, counts = [], [], []
    state: State = {}
    for spec in model.blocks:
        inputs = {k: v.detach().requires_grad_(True) for k, v in state.items()}
        params = _block_params(model, spec)
        samples = []
        out: State = {}
        act = 0
        for i in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            out, act = _saved_bytes(functools.partial(model.run_block, spec, dict(inputs), batch))  # type: ignore[assignment]
            if spec.kind is BlockKind.HEAD:
                loss = cross_entropy_sum(out["logits"], batch.labels)
                loss.backward()
            else:
                tensors = [t for t in out.values() if t.requires_grad]
                torch.autograd.backward(tensors, [torch.randn_like(t) for t in tensors])
            if i > 0:
                samples.append(time.perf_counter() - t0)
        times.append(statistics.median(samples))
        pbytes = sum(p.numel() * p.element_size() for p in params)
        mems.append(float(pbytes + act))
        counts.append(sum(p.numel() for p in params))
        state = {k: v.detach() for k, v in out.items() if k != "logits"}
    model.zero_grad(set_to_none=True)
    return times, mems, counts


def _block_params(model: M2M100Translation, spec: BlockSpec) -> list[torch.nn.Parameter]:
    """The block's parameters; the tied table counts once, at the source embedding."""
    params = model.block_parameters([spec])
    if spec.kind is BlockKind.SRC_EMBED or model.shared is None:
        return params
    table = {id(p) for p in model.shared.parameters()}
    return [p for p in params if id(p) not in table]
