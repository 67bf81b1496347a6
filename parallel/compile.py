"""Regional compilation: `torch.compile` on each encoder and decoder layer (torchtitan's
`apply_compile`), after tensor parallelism and rematerialisation are applied.

Compiling layer by layer rather than the whole model keeps compile time to one
graph per layer kind (layers share their code; parameters are graph inputs), works
under the pipeline split (a stage holds some layers) and lets the executor, the
tensor-parallel collectives between layers and the loss stay eager. Inside a
layer, inductor fuses the elementwise work around the matmuls (dropout, residual
adds, layer norm, activation) into a few kernels. Sequence lengths change from
micro-batch to micro-batch, so shapes are compiled dynamic (`dynamic=None`:
static on first sight, dynamic on the second shape). Tensor-parallel layers call
c10d collectives inside autograd functions, where dynamo breaks the graph: the
pieces between collectives are still compiled.
"""

from __future__ import annotations

import torch
from torch import nn

from models.m2m100 import DecoderLayer, EncoderLayer


def apply_compile(model: nn.Module) -> int:
    """Compile every encoder/decoder layer of `model` in place; returns how many."""
    # Every layer instance and every new shape adds cache entries; the default limit (8)
    # would fall back to eager on a deep stage with varying lengths.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    count = 0
    for module in model.modules():
        if isinstance(module, (EncoderLayer, DecoderLayer)):
            module.compile()
            count += 1
    return count
