"""Rematerialisation (activation recomputation) policies, applied from outside the model.

    none       keep every activation
    full       checkpoint every encoder/decoder layer: keep only layer inputs
    selective  checkpoint only the attention sub-modules (their softmax/probabilities
               are the large, cheap-to-recompute activations; Korthikanti et al. 2022)
    stage      GPipe (Huang et al. 2019, sec 2.2): keep only each micro-batch's stage
               input and recompute the whole stage in backward (`PipelineStage`)

All use non-reentrant `torch.utils.checkpoint` with `preserve_rng_state=True`, so
dropout masks replay exactly and gradients equal the no-remat run. Wrapping
replaces the module's `forward` on the instance, so parameter names (and hence
checkpoints) are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from models.m2m100 import Attention, DecoderLayer, EncoderLayer

POLICIES = ("none", "full", "stage", "selective")

# Set by parallel.pipeline.memory.ActivationMeter while it records a forward: rematerialised
# regions keep their tensor inputs outside autograd's saved-tensor hooks, so they
# report them here to be counted.
KEPT_INPUT_OBSERVER: ContextVar[Callable[[Tensor], None] | None] = ContextVar(
    "kept_input_observer", default=None
)


@torch._dynamo.disable  # host bookkeeping for the activation meter: never traced into a graph
def _report_kept_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    observe = KEPT_INPUT_OBSERVER.get()
    if observe is not None:
        for a in (*args, *kwargs.values()):
            if isinstance(a, Tensor) and a.is_floating_point():
                observe(a)


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        # Traced by dynamo (a compiled layer), the checkpoint becomes part of the compiled
        # autograd function, whose saved tensors (the kept inputs among them) the meter's hooks
        # see: nothing to report, and no call that would break the layer's graph.
        if not torch.compiler.is_compiling():
            _report_kept_inputs(args, kwargs)
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    return run


def apply_remat(model: nn.Module, policy: str) -> int:
    """Wrap the modules `policy` names; returns how many were wrapped.

    Raises:
        ValueError: unknown policy.
    """
    if policy not in POLICIES:
        raise ValueError(f"activation_checkpointing={policy!r} is not valid; choose one of {list(POLICIES)}")
    if policy in ("none", "stage"):
        return 0  # "stage" is applied by PipelineStage around the whole stage
    kinds: tuple[type, ...] = (EncoderLayer, DecoderLayer) if policy == "full" else (Attention,)
    wrapped = 0
    for module in model.modules():
        if isinstance(module, kinds) and not getattr(module, "_remat", False):
            module.forward = _checkpointed(module.forward)  # type: ignore[method-assign]
            module._remat = True  # type: ignore[assignment]
            wrapped += 1
    return wrapped
