"""Stage-local construction: a model built on the meta device, cut and sharded there, then
given memory only for this rank's blocks and tp shards, on the target device.

    with torch.device("meta"): M2M100Translation(config)     shapes only, nothing drawn
      -> keep_only(this rank's blocks)                        (parallel.parallelize)
      -> apply_tensor_parallel                                local shapes, still meta
      -> fully_shard (dp_sharding fsdp)                       dp shards of the tp shards, still meta
      -> materialize(model, device, fill)                     to_empty + fill, slice by slice

`local_slices` says, for every local parameter, its logical (single-device) name, full
shape and the part this rank holds (`models.init.LocalSlice`, from the tp marks via
`parallel.tp.layers.tp_local_slice` and, for experts cut over ep, the experts it keeps
via `parallel.expert.params.expert_local_slice`: expert-local construction, the same
knowledge `ParallelModel.to_logical` uses). Both fills read it: `keyed_init_fill` draws each part from the keyed generators
(equal to the one-process model's slice for the same seed), `pretrained_fill` reads
each part from an HF directory (`models.hf.read_hf_slices`). Either produces one
tensor at a time, so no rank ever holds more than its shard plus one parameter's part.

Under fsdp the parameters are already FSDP's dp-sharded DTensors when they get memory: each
rank allocates only its dp shard, and keeps only its dp chunk of each part the fill yields
(`parallel.dp.fsdp.dp_chunk`), so start-up peaks at the stage / dp plus one parameter's tp
part, never the whole stage. Without a fill (resume: the checkpoint is loaded next) nothing
is drawn or read: the parameters are zeroed (the vocabulary's tp padding rows, which no
checkpoint holds, must be zero).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.init import LocalSlice
from models.m2m100 import M2M100Translation
from parallel.dp.fsdp import dp_chunk, is_fsdp_param, local
from parallel.expert.params import expert_local_slice

Fill = Callable[[Mapping[str, LocalSlice]], Iterator[tuple[str, Tensor]]]


def local_slices(model: M2M100Translation, tp_size: int = 1, tp_rank: int = 0) -> dict[str, LocalSlice]:
    """Logical name -> the part of it this rank's parameter holds (whole when not tp-sharded)."""
    return {name: expert_local_slice(p, tp_size, tp_rank) for name, p in model.named_parameters()}


def keyed_init_fill(model: M2M100Translation, seed: int) -> Fill:
    """Initial values of each part for `seed` (`M2M100Translation.init_value`)."""

    def fill(parts: Mapping[str, LocalSlice]) -> Iterator[tuple[str, Tensor]]:
        for name, part in parts.items():
            yield name, model.init_value(name, part, seed)

    return fill


def pretrained_fill(path: str | Path, model: M2M100Translation) -> Fill:
    """Each part read from the HF directory at `path` (`models.hf.read_hf_slices`)."""
    from models.hf import read_hf_slices

    def fill(parts: Mapping[str, LocalSlice]) -> Iterator[tuple[str, Tensor]]:
        return read_hf_slices(path, parts, model.config)

    return fill


def is_meta(model: torch.nn.Module) -> bool:
    """True if any parameter of `model` is on the meta device (shapes only)."""
    return any(p.is_meta for p in model.parameters())


@torch.no_grad()
def materialize(
    model: M2M100Translation, device: torch.device, fill: Fill | None, tp_size: int = 1, tp_rank: int = 0
) -> None:
    """Give a meta-built (pruned, sharded) model memory on `device` and fill every parameter.

    The tp marks (`tp_sharded`, ...) survive; computed buffers are recomputed. Each
    value from `fill` is copied in (an FSDP parameter: its dp chunk) and dropped before
    the next is made.

    Args:
        model: the model after `keep_only`, `apply_tensor_parallel` and (fsdp) `fully_shard`,
            parameters on meta.
        device: where this rank's parameters live.
        fill: yields (logical name, tp-local tensor) for the parts it is given; None: every
            parameter zeroed, for a checkpoint to be loaded into.
        tp_size, tp_rank: this rank's place in its tp group (1, 0 without tp).

    Raises:
        ValueError: the fill left a parameter unset, or gave a tensor of the wrong shape.
    """
    parts = local_slices(model, tp_size, tp_rank)
    marks: dict[str, dict[str, Any]] = {n: dict(vars(p)) for n, p in model.named_parameters()}
    model.to_empty(device=device)  # new Parameter objects: the marks are set again below
    params = dict(model.named_parameters())
    for name, param in params.items():
        for key, value in marks[name].items():
            setattr(param, key, value)
    model.reset_buffers()
    if fill is None:
        for param in params.values():
            local(param).zero_()
        return
    unset = set(params)
    for name, value in fill(parts):
        param = params[name]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{name}: filled with shape {tuple(value.shape)}, holds {tuple(param.shape)}")
        local(param).copy_(dp_chunk(param, value) if is_fsdp_param(param) else value)
        unset.discard(name)
    if unset:
        raise ValueError(f"materialize left {len(unset)} parameters unset: {sorted(unset)[:5]}")


def stage_fill(
    model: M2M100Translation,
    seed: int | None,
    pretrained: str | Path | None,
    from_checkpoint: bool,
    before_tp: bool,
) -> Fill | None:
    """How to fill a meta model's shard (None: it has weights, or they come from a checkpoint),
    the arguments checked."""
    given = {
        "seed": seed is not None,
        "pretrained": pretrained is not None,
        "from_checkpoint": from_checkpoint,
    }
    if not is_meta(model):
        if any(given.values()):
            raise ValueError(
                "seed= / pretrained= / from_checkpoint= build stage-local from a ModelConfig or a meta "
                "model; this model already has weights (build it under torch.device('meta') or pass its config)"
            )
        return None
    if before_tp:
        raise ValueError("before_tp needs a model with weights; for a meta model pass pretrained= instead")
    if sum(given.values()) != 1:
        raise ValueError(
            f"a meta model needs exactly one of seed=, pretrained= or from_checkpoint= (got seed={seed}, "
            f"pretrained={pretrained}, from_checkpoint={from_checkpoint})"
        )
    if pretrained is not None:
        return pretrained_fill(pretrained, model)
    return keyed_init_fill(model, seed) if seed is not None else None
