"""Dropout under tensor parallelism, checked on a tp group (run by `test_tensor_parallel.py`).

The story: every tp rank used to draw the same masks, also where tp splits the activations,
so the heads of rank 0 and rank 1 (and the FFN columns, and under sequence parallelism the
T/p slices of the residual stream) dropped the same pattern. Now split sites draw per rank
and replicated ones agree; the union of the ranks' masks is one mask of the full
activation, which the single-device model, fed those masks, turns into the same logits.

A sparse (NLLB-MoE) model with tp over its experts' FFN dim (`TensorParallelExperts`) is
checked alike: the experts' hidden (E, C, F/p) is split, their output (E, C, H) replicated.

Masks are read where CPU dropout draws them (`aten.bernoulli_`, in call order, which is
the same on every rank and on one device).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from models.config import ModelConfig
from models.m2m100 import M2M100Translation, Seq2SeqBatch
from models.moe import LocalDispatcher
from parallel.expert.apply import apply_expert_parallel
from parallel.tp.apply import apply_tensor_parallel

D_MODEL, FFN, LENGTH = 32, 96, 8  # FFN / p never equals d_model (p = 2, 4): sites tell apart by shape
EXPERTS = 5  # a sparse model's expert masks (E, C, .) tell apart from (B, T, .) ones (B = 3)


def dropout_config(vocab: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        d_model=D_MODEL,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN,
        dropout=0.3,
        attention_dropout=0.3,
        activation_dropout=0.3,
        max_position_embeddings=64,
    )


class _Masks(TorchDispatchMode):
    """Records every dropout mask drawn inside; or, given masks, draws those instead, in order."""

    def __init__(self, replay: list[Tensor] | None = None) -> None:
        super().__init__()
        self.drawn: list[Tensor] = []
        self.replay = None if replay is None else list(replay)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.bernoulli_.float:
            if self.replay is not None:
                return args[0].copy_(self.replay.pop(0))
            out = func(*args, **(kwargs or {}))
            self.drawn.append(out.detach().clone())
            return out
        return func(*args, **(kwargs or {}))


def _site(mask: Tensor, p: int) -> tuple[str, int | None]:
    """(kind, the dim the ranks split) of a mask from its local shape."""
    if mask.dim() == 3 and mask.shape[0] == EXPERTS:  # the buffer layout (E, C, .)
        return ("expert ffn columns", -1) if mask.shape[-1] == FFN // p else ("expert outputs", None)
    if mask.dim() == 4:
        return "attention heads", 1  # (B, h/p, T, S)
    if mask.shape[-1] == FFN // p:
        return "ffn columns", -1  # (B, T, F/p)
    if mask.shape[1] == LENGTH:
        return "replicated", None  # (B, T, H): embeddings, residual branches without sp
    return "residual T/p slice", 1  # (B, T/p, H) under sequence parallelism


def check_masks_per_rank(
    group: Any, sequence_parallel: bool, batch: Seq2SeqBatch, vocab: int, sparse: bool = False
) -> None:
    """Split sites differ across ranks, replicated ones agree, and their union is the mask the
    single-device model needs for the same logits. `sparse`: every 2nd layer an MoE layer, its
    experts split over tp (the single-device experts on the buffer layout, as tp's)."""
    p = dist.get_world_size(group)
    torch.manual_seed(0)
    config = dropout_config(vocab)
    if sparse:
        config = dataclasses.replace(
            config, num_experts=EXPERTS, encoder_sparse_step=2, decoder_sparse_step=2, moe_token_dropout=0.0
        )
    ref = M2M100Translation(config).train()
    for ffn in ref.sparse_ffns().values():
        ffn.dispatcher = LocalDispatcher(grouped=False)
    model = copy.deepcopy(ref)
    info = apply_tensor_parallel(model, group, sequence_parallel=sequence_parallel)
    apply_expert_parallel(model, None, group)
    torch.manual_seed(7)  # the same global generator state on every rank, as the trainer seeds
    with _Masks() as rec:
        local_logits = model(batch)
    every: list[list[Tensor]] = [[] for _ in range(p)]
    dist.all_gather_object(every, rec.drawn, group=group)
    full, kinds = [], set()
    for i, local in enumerate(rec.drawn):
        kind, dim = _site(local, p)
        kinds.add(kind)
        ranks = [masks[i] for masks in every]
        same = all(torch.equal(ranks[0], m) for m in ranks[1:])
        if dim is None:
            assert same, f"mask {i} ({kind}) differs across tp ranks"
            full.append(ranks[0])
        else:
            assert not same, f"mask {i} ({kind}, {tuple(local.shape)}) is the same on every tp rank"
            full.append(torch.cat(ranks, dim=dim))
    expected = {"attention heads", "ffn columns", "replicated"}
    expected |= {"expert ffn columns", "expert outputs"} if sparse else set()
    assert kinds == expected | ({"residual T/p slice"} if sequence_parallel else set()), kinds
    with _Masks(replay=full):
        ref_logits = ref(batch)
    got = info.gather_logits(local_logits)
    assert torch.allclose(got, ref_logits, atol=1e-5, rtol=1e-4), (got - ref_logits).abs().max()


def expected_loss_gap(group: Any, batch: Seq2SeqBatch, vocab: int, draws: int = 64) -> dict[str, float]:
    """The mean dropout loss of the tp model against the single-device one on the same weights
    and batch, over `draws` mask draws each: their gap in standard errors (z).

    With per-rank masks the tp model's masks have the single-device distribution, so z is a
    draw of N(0, 1); a deterministic set of seeds makes the figure reproducible, not flaky.
    """
    torch.manual_seed(0)
    ref = M2M100Translation(dropout_config(vocab)).train()
    model = copy.deepcopy(ref)
    info = apply_tensor_parallel(model, group)
    losses: dict[str, list[float]] = {"tp": [], "one": []}
    with torch.no_grad():
        for k in range(draws):
            torch.manual_seed(1000 + k)
            losses["tp"].append(float(info.loss(model(batch), batch.labels)) / batch.num_tokens())
            torch.manual_seed(5000 + k)
            losses["one"].append(float(ref.loss(batch)[0]) / batch.num_tokens())
    mean = {k: sum(v) / draws for k, v in losses.items()}
    var = {k: sum((x - mean[k]) ** 2 for x in v) / (draws - 1) for k, v in losses.items()}
    se = math.sqrt((var["tp"] + var["one"]) / draws)
    z = (mean["tp"] - mean["one"]) / se
    assert abs(z) < 4.0, f"tp mean loss {mean['tp']:.4f} vs one device {mean['one']:.4f}: {z:.1f} SE apart"
    return {"mean_tp": mean["tp"], "mean_one": mean["one"], "se": se, "z": z, "draws": draws}
