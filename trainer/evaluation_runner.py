"""Evaluation during training: loss through the parallel model, BLEU/chrF by generation.

`eval_loss` runs the pipeline's forward-only schedule over the validation batches
on every rank (tensor-parallel, vocab-parallel loss), so it is exactly the
model the optimizer trains. Translation for BLEU/chrF runs on the logging rank on
a gathered single-device copy of the weights (tp shards gathered, pipeline stages
collected): simple and exact, and fine for models that fit one device's memory;
pipelined generation for larger models is not implemented.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from models.config import ModelConfig
from models.m2m100 import M2M100Translation
from parallel.mesh import ParallelMesh
from parallel.parallelize import ParallelModel
from trainer.config import TrainingArguments
from trainer.data import EvalBatch
from trainer.evaluate import SAMPLES_KEY, DirectionTexts, evaluate_directions
from trainer.tokenizer import Tokenizer


def gather_full_state(pm: ParallelModel, mesh: ParallelMesh, dst: int) -> dict[str, torch.Tensor] | None:
    """Collective: the single-device state dict on global rank `dst` (None elsewhere)."""
    if mesh.size("tp") > 1:
        from parallel.tp.apply import gather_full_state_dict

        state = gather_full_state_dict(pm.model, mesh.group("tp"))
    else:
        state = {k: v.detach() for k, v in pm.model.state_dict().items()}
    if dist.get_world_size() == 1:
        return state
    mine = {k: v.cpu() for k, v in state.items()} if mesh.dp_rank == 0 and mesh.tp_rank == 0 else None
    got: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(mine, got, dst=dst)
    if got is None:
        return None
    full: dict[str, torch.Tensor] = {}
    for part in got:
        if part:
            full.update(part)
    return full


class Evaluator:
    """Runs evaluation at a step; the returned metrics are meaningful on the logging rank."""

    def __init__(
        self,
        pm: ParallelModel,
        mesh: ParallelMesh,
        tokenizer: Tokenizer,
        batches: dict[str, list[EvalBatch]],
        args: TrainingArguments,
        log_rank: int,
        model_config: ModelConfig,
    ) -> None:
        self.pm, self.mesh, self.tok, self.batches = pm, mesh, tokenizer, batches
        self.args, self.log_rank, self.model_config = args, log_rank, model_config
        self.device = next(pm.model.parameters()).device
        self.texts = [
            DirectionTexts(
                (d.split("-", 1)[0], d.split("-", 1)[1]),
                [s for b in bs for s in b.sources],  # type: ignore[arg-type]
                [r for b in bs for r in b.references],
            )
            for d, bs in batches.items()
            if bs
        ]

    def losses(self) -> dict[str, float]:
        out: dict[str, float] = {}
        total, count = 0.0, 0
        for direction, batches in self.batches.items():
            if not batches:
                continue
            s, n = self.pm.eval_loss([b.batch.to(self.device) for b in batches])
            if n:
                out[f"eval_loss_{direction}"] = s / n
            total, count = total + s, count + n
        if count:
            out["eval_loss"] = total / count
        return out

    def run(self, step: int, tracker: Any = None) -> dict[str, Any]:
        self.pm.model.eval()
        metrics: dict[str, Any] = self.losses()
        state = gather_full_state(self.pm, self.mesh, self.log_rank)
        if dist.get_rank() == self.log_rank and state is not None and self.texts:
            model = M2M100Translation(self.model_config).to(self.device)
            model.load_state_dict(state)
            result = evaluate_directions(
                model,
                self.texts,
                self.tok,
                num_beams=self.args.generation_num_beams,
                max_length=self.args.generation_max_length,
                batch_size=self.args.per_device_eval_batch_size,
            )
            samples = result.pop(SAMPLES_KEY, [])
            metrics.update(result)
            if tracker is not None:
                tracker.log_samples(step, [tuple(s) for s in samples])
        dist.barrier()
        self.pm.model.train()
        return metrics
