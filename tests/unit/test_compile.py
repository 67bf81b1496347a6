"""Regional compilation without compiling: what dynamo captures of a layer, and the counts.

Tracing with `torch._dynamo.explain` runs no inductor, so these take seconds. The compiled
steps themselves (compiled == eager, recompiles after the first step) are
`tests/dist/test_precision_compile.py`'s.
"""

from __future__ import annotations

import pytest
import torch

from models.config import ModelConfig
from models.m2m100 import DecoderLayer, EncoderLayer, M2M100Translation
from parallel.compile import CompileCounts, apply_compile
from parallel.remat import apply_remat

CFG = ModelConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.1,
                  attention_dropout=0.1, activation_dropout=0.1)  # fmt: skip


@pytest.mark.parametrize("remat", ["none", "full", "selective"])
def test_a_dense_layer_is_one_graph_at_tp1(remat: str) -> None:
    """No graph break inside an encoder or decoder layer (dropout on, key mask given), under every
    per-layer remat policy. Selective remat broke each layer at its attention's checkpoint (the
    activation meter's report, a `torch.compiler.disable`d call): 2 breaks per encoder layer and
    4 per decoder layer before."""
    torch._dynamo.reset()
    enc, dec = EncoderLayer(CFG), DecoderLayer(CFG)
    apply_remat(torch.nn.ModuleList([enc, dec]), remat)
    x = torch.randn(2, 8, 32, requires_grad=True)
    memory = torch.randn(2, 6, 32, requires_grad=True)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 4:] = False
    for name, out in (("encoder", torch._dynamo.explain(lambda *a: enc(*a))(memory, mask)),
                      ("decoder", torch._dynamo.explain(lambda *a: dec(*a))(x, memory, mask))):  # fmt: skip
        reasons = [str(r.reason).splitlines()[0] for r in out.break_reasons]
        assert (out.graph_count, out.graph_break_count) == (1, 0), (name, remat, reasons)


def test_apply_compile_compiles_each_layer_and_passes_the_mask() -> None:
    model = M2M100Translation(CFG, seed=0)
    assert apply_compile(model) == 2
    assert model.always_mask  # one graph structure whether a micro-batch is padded or not


def test_compile_counts_read_dynamo_counters() -> None:
    """A graph compiled between two readings, and a graph break, show in their difference."""
    torch._dynamo.reset()

    def broken(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    before = CompileCounts.now()
    torch.compile(broken, backend="eager")(torch.ones(3))
    diff = CompileCounts.now() - before
    assert diff.graphs == 2 and diff.graph_breaks == 1


def test_varying_lengths_compile_once_per_layer_kind() -> None:
    """Dynamic dims from the first call, no duck sizing: a decoder layer first met with B = S = T = 8
    (a bucket of 8) serves (8, 16, 24) and (8, 24, 8) without recompiling; with `dynamic=None` it
    recompiled on the second shape, and duck sizing (B, S and T one symbol) on the next."""
    torch._dynamo.reset()
    model = M2M100Translation(CFG, seed=0)
    apply_compile(model, backend="eager")
    layer = model.decoder.layers["0"]
    before = CompileCounts.now()
    for t, s in ((8, 8), (16, 24), (24, 8), (8, 16)):
        mask = torch.ones(8, s, dtype=torch.bool)
        mask[0, s // 2 :] = False
        layer(torch.randn(8, t, 32), torch.randn(8, s, 32), mask).sum().backward()
    assert (CompileCounts.now() - before).graphs == 1


def test_a_sparse_layer_traces_on_cpu() -> None:
    """An NLLB-MoE layer in fp32 on a CPU (experts on `torch._grouped_mm` there in eager) traces:
    before, dynamo failed on the op's meta function, which takes bf16 only, so `torch_compile`
    with NLLB-MoE crashed on CPUs; traced, fp32 takes the buffer layout. With capacity the layer
    is one graph; dropless routing reads its largest expert count on the host (a break there)."""
    from models.moe import MoECall

    cfg = ModelConfig(
        **{**CFG.__dict__, "num_experts": 4, "encoder_sparse_step": 1, "moe_token_dropout": 0.0}
    )
    model = M2M100Translation(cfg, seed=0)
    layer = model.encoder.layers["0"]
    x = torch.randn(2, 8, 32, requires_grad=True)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 5:] = False
    for dropless, graphs in ((False, 1), (True, None)):
        model.moe.dropless = dropless
        torch._dynamo.reset()
        out = torch._dynamo.explain(layer)(x, mask, MoECall(pad=~mask, slot=0, num_tokens=10))
        reasons = [str(r.reason).splitlines()[0] for r in out.break_reasons]
        if graphs is not None:
            assert (out.graph_count, out.graph_break_count) == (graphs, 0), reasons
        else:
            assert reasons and all("item()" in r for r in reasons), reasons
