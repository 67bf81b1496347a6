"""`build_optimizer`: the fused AdamW (CPU and CUDA) gives the same update as the
per-parameter loop it replaced, decay groups included."""

from __future__ import annotations

import copy

import torch

from models.config import ModelConfig
from models.m2m100 import M2M100Translation
from tests.dist.pipeline_workers import TINY, random_batch
from trainer.config.training_args import TrainingArguments
from trainer.run.step import build_optimizer


def test_fused_adamw_equals_the_per_parameter_loop() -> None:
    cfg = ModelConfig(**TINY)
    torch.manual_seed(0)
    model = M2M100Translation(cfg)
    reference = copy.deepcopy(model)
    args = TrainingArguments(output_dir="/tmp/opt_test", learning_rate=1e-2, weight_decay=0.1)
    opt = build_optimizer(model, args)
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    ref_opt = build_optimizer(reference, args)
    for group in ref_opt.param_groups:
        group["fused"], group["foreach"] = False, False
    for seed in range(3):  # both take the gradients of `model` (else Adam amplifies ulp differences)
        loss, n = model.loss(random_batch(cfg, 4, seed))
        (loss / n).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            q.grad = p.grad.clone()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7), name
