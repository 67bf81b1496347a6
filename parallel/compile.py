"""Regional compilation: `torch.compile` on each encoder and decoder layer (torchtitan's
`apply_compile`), after tensor parallelism and rematerialisation are applied, and the
count of what dynamo compiled.

Compiling layer by layer rather than the whole model keeps compile time to one
graph per layer kind (layers share their code; parameters are graph inputs), works
under the pipeline split (a stage holds some layers) and lets the executor, the
tensor-parallel collectives between layers and the loss stay eager. Inside a
layer, inductor fuses the elementwise work around the matmuls (dropout, residual
adds, layer norm, activation) into a few kernels. The embeddings, the final norm +
head and the chunked loss stay eager: compiled as regions of their own they cost more
host time than they save (measured in `benchmarks/host_proxy_cpu.md`).

Shapes. Lengths change from micro-batch to micro-batch (`pad_to_multiple_of` keeps
them in buckets). Layers are compiled with dynamic batch and sequence dims from their
first call (`dynamic=True`): one graph per layer kind serves every length, where
`dynamic=None` (static on first sight, dynamic on the second shape) recompiled mid-run
(17 s between steps 10 and 20 of a tiny run on an H100). A compiled model also passes
the source key mask when no row is padded (`M2M100Translation.always_mask`), so a
layer meets one graph structure: after the first step nothing recompiles
(`CompileCounts`, reported in run_summary.json).

Graph breaks. A dense layer at tp=1 is one graph. Tensor-parallel layers call c10d
collectives inside autograd functions, and a sparse (NLLB-MoE) layer routes on the
host and exchanges tokens with an all-to-all: dynamo breaks the graph there and
compiles the pieces between (`docs/precision.md` lists where).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.m2m100 import DecoderLayer, EncoderLayer, M2M100Translation


def apply_compile(model: nn.Module, dynamic: bool = True, backend: str = "inductor") -> int:
    """Compile every encoder/decoder layer of `model` in place; returns how many.

    Args:
        model: the rank's model (after tp, ep and remat are applied).
        dynamic: compile with dynamic batch and sequence dims from the first call; False:
            one static graph per shape (a recompile per new bucket).
        backend: torch.compile's backend ("eager" traces without generating code: tests).
    """
    # Every layer instance and every new shape adds cache entries; the default limit (8)
    # would fall back to eager on a deep stage with varying lengths.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    # Duck sizing gives dims that are equal on the first call one symbol (B = S = 8 in a bucket
    # of 8, or S = T), and recompiles when they part; lengths and batch sizes are independent.
    torch.fx.experimental._config.use_duck_shape = False
    # A layer's floats are its constants (norm eps, dropout p, the MoE aux-loss weight; a value
    # that changes per step comes as a tensor: `MoERun.begin_step`). Traced as symbolic floats
    # (the default), each one a layer specializes makes dynamo restart its whole analysis:
    # 25 -> 21 CPU-s for a tiny model's two layer graphs.
    torch._dynamo.config.specialize_float = True
    if isinstance(model, M2M100Translation):
        model.always_mask = True
    count = 0
    for module in model.modules():
        if isinstance(module, (EncoderLayer, DecoderLayer)):
            module.compile(dynamic=dynamic, backend=backend)
            count += 1
    return count


@dataclass(frozen=True)
class CompileCounts:
    """What dynamo compiled in this process so far: graphs and graph breaks
    (`torch._dynamo.utils.counters`). A recompile is a graph compiled for a region that
    already ran: the difference of two readings taken around the steps after the first."""

    graphs: int = 0
    graph_breaks: int = 0

    @classmethod
    def now(cls) -> CompileCounts:
        counters = torch._dynamo.utils.counters
        return cls(int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values())))

    def __sub__(self, other: CompileCounts) -> CompileCounts:
        return CompileCounts(self.graphs - other.graphs, self.graph_breaks - other.graph_breaks)

    def __add__(self, other: CompileCounts) -> CompileCounts:
        return CompileCounts(self.graphs + other.graphs, self.graph_breaks + other.graph_breaks)
