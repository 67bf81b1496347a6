"""bf16 (or fp16) working weights over fp32 master weights, cast once per optimizer step.

fp16 uses the same machinery with dtype float16; its small range needs the dynamic loss
scale of parallel/loss_scale.py on top (the gradients reaching the fp32 masters are
scaled by S and unscaled by the trainer's step before clipping).

As Megatron and FSDP2 do it:

    optimizer      fp32 master parameters: the model's `nn.Parameter`s (ZeRO-1 shards them)
    step start     W16 = W32.to(bf16)      one cast per parameter per step, under autograd
    micro-batches  forward and backward read W16; each micro-batch's bf16 weight gradient
                   flows back through the cast into W32.grad, accumulated in fp32
    step end       the modules get W32 back (optimizer, checkpoints, evaluation see fp32)

Autocast stays on for the activations (it casts them to bf16 at each matmul); with
bf16 weights its per-micro-batch weight casts, 18% of device time at m=4 on an
H100 before this, are no-ops. Layer norms keep fp32 weights (autocast runs them in
fp32 anyway), and the residual stream stays fp32 (Megatron's
`fp32_residual_connection`).

Measured on one H100 (`scripts/bench_step.py`, 418M, 4 micro-batches of 8 x 256):
0.257 s/step against 0.348 with autocast alone. With a single micro-batch per step
each weight is read once, autocast's cast per use is the same one cast, and the
working copies measured slower (1.2B: 0.241 against 0.225 s/step), so
`ParallelModel.train_step` uses them only when a step has several micro-batches.

Why one cast can serve every micro-batch: the cast is a single autograd node per
parameter (`ToCopyBackward0`) that saves no tensors, so each micro-batch's backward
may pass through it again. Its output, the fp32 gradient, reaches the master
parameter's AccumulateGrad, so the data-parallel hooks, clipping and the optimizer
see fp32 gradients exactly as in an fp32 run. The working copies live in the
modules' `_parameters` only for the step: nothing outside a step ever sees them.

Evaluation (loss and decoding, `ParallelModel.evaluating`) runs in the run's precision:
under autocast to the working dtype as training's forward does (fsdp: over the gathered
working weights), or, with `bf16_full_eval` / `fp16_full_eval` (the `TrainingArguments`
names), with every weight and floating buffer cast (`cast_weights`) and no autocast, as
`transformers` casts the model for evaluation; the residual stream is then low precision too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn


@contextmanager
def cast_weights(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Within: every floating parameter and buffer of `model` (layer norms and the positions
    table included) is a `dtype` copy outside autograd; each module gets its own back after.

    The modules are walked at entry, so under FSDP (inside `FullySharded.gathered`) the copies
    are of the gathered parameters. A tensor shared by several modules is cast once.
    """
    cast: dict[int, Tensor] = {}
    swapped: list[tuple[dict[str, Tensor | None], str, Tensor]] = []
    for module in model.modules():
        for slots in (module._parameters, module._buffers):
            for name, t in slots.items():
                if t is None or not t.is_floating_point() or t.dtype == dtype:
                    continue
                if id(t) not in cast:
                    cast[id(t)] = t.detach().to(dtype)
                swapped.append((slots, name, t))  # type: ignore[arg-type]
                slots[name] = cast[id(t)]  # type: ignore[assignment]
    try:
        yield
    finally:
        for slots, name, t in reversed(swapped):
            slots[name] = t


@contextmanager
def evaluation_precision(
    model: nn.Module, device_type: str, autocast_dtype: torch.dtype | None, eval_dtype: torch.dtype | None
) -> Iterator[None]:
    """Within: evaluation's precision (see the module docstring).

    eval_dtype      every weight and buffer cast to it, no autocast (`bf16_full_eval`)
    autocast_dtype  autocast to the run's working dtype, as training's forward
    neither         fp32
    """
    if eval_dtype is not None:
        with cast_weights(model, eval_dtype):
            yield
    elif autocast_dtype is not None:
        with torch.autocast(device_type, dtype=autocast_dtype):
            yield
    else:
        yield


def keeps_fp32(module: nn.Module) -> bool:
    """Whether mixed precision leaves `module`'s own weights in fp32: layer norms, and modules
    the model marks `keep_in_fp32` (an fp32 MoE router). Working weights and FSDP's
    low-precision units (`parallel.dp.fsdp`) both follow it; `cast_weights` (full
    low-precision evaluation) casts everything, as `transformers` casts a model."""
    return isinstance(module, nn.LayerNorm) or bool(getattr(module, "keep_in_fp32", False))


class WorkingWeights:
    """The step's low-precision copies of `model`'s parameters (`keeps_fp32` modules excepted).

    Args:
        model: the rank's model (after tensor parallelism: the sharded parameters).
        dtype: the working dtype, e.g. torch.bfloat16.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.slots: list[tuple[nn.Module, str, nn.Parameter]] = [
            (module, name, p)
            for module in model.modules()
            if not keeps_fp32(module)
            for name, p in module._parameters.items()
            if p is not None and p.is_floating_point()
        ]

    @contextmanager
    def swapped(self) -> Iterator[list[Tensor]]:
        """Within: every slot holds the working copy (a tied parameter's one copy everywhere).

        Yields the working copies (so a meter can tell them from activations).
        """
        cast: dict[int, Tensor] = {}
        with torch.enable_grad():
            for module, name, p in self.slots:
                if id(p) not in cast:
                    cast[id(p)] = p.to(self.dtype)
                module._parameters[name] = cast[id(p)]  # type: ignore[assignment]
        try:
            yield list(cast.values())
        finally:
            for module, name, p in self.slots:
                module._parameters[name] = p


@torch.no_grad()
def hold_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast a frozen model's weights to `dtype` for good (`keeps_fp32` modules excepted): the
    working weights a trained model casts each step, without the fp32 masters it would keep.
    It then runs under autocast to `dtype` as a training forward does (a distillation teacher)."""
    for module in model.modules():
        if keeps_fp32(module):
            continue
        for p in module._parameters.values():
            if p is not None and p.is_floating_point():
                p.data = p.data.to(dtype)
