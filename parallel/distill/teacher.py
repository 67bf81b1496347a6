"""Word-level distillation on the mesh: the frozen teacher's forward per flush, and the student's loss.

The teacher is a second `ParallelModel` on the student's mesh, built stage-local like any model
here (meta -> its own stage split over the same pp ranks -> tp -> ep -> only this rank's slices
read: `trainer.run.distill`), so no rank holds it whole. `Teacher` freezes it (no gradient, eval
mode, never given to an optimizer or a checkpoint) and holds its weights in the working precision.

    per training flush (`ParallelModel.train_with`):

    Teacher.forward(micro-batches, step)      forward-only flush of the teacher over the same
                                              micro-batches (`ParallelModel.forward_flush`: its
                                              stages, p2p, tp, and the ep all-to-all, since each
                                              replica holds its own); its head block stops after
                                              decoder.layer_norm (`FinalHidden`), so its last stage
                                              keeps (B, T, H) per micro-batch, by slot
    student flush, last stage:
    DistillationLoss(logits, micro-batch)     that slot's hidden states and the teacher's head shard
                                              -> `parallel.distill.loss` (the teacher's logits made
                                              chunk by chunk, vocab-parallel), the CE and KD sums
                                              kept apart on the device for the logs

The teacher's last stage sits on the student's last stage's pp rank: both are cut with the
student's schedule and stages per rank (`Teacher.check_placement`). What the teacher adds to a
last-stage rank's memory between its flush and the student's is m x (B, T, H) in the working
dtype: (N, H) per micro-batch, not the (N, V/p) of its logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from models.config import ModelConfig
from models.m2m100 import M2M100Translation, Seq2SeqBatch
from parallel.distill.loss import DistillSettings, VocabSlice, distillation_loss_sum
from parallel.mixed_precision import hold_in
from parallel.parallelize import ParallelModel


class FinalHidden(nn.Module):
    """The teacher's head without the product: the final hidden states (after `decoder.layer_norm`),
    in the head weight's dtype (what autocast would have multiplied), for the loss to project."""

    def forward(self, h: Tensor, weight: Tensor) -> Tensor:  # (B, T, H) -> (B, T, H)
        return h.to(weight.dtype)


def meta_teacher(config: ModelConfig, dtype: torch.dtype | None) -> M2M100Translation:
    """The teacher on the meta device with its weights in `dtype` (`hold_in`: layer norms and the
    router stay fp32), for `build_parallel_model`: each rank then materialises its shard straight
    in the working dtype, never an fp32 copy of it."""
    with torch.device("meta"):
        model = M2M100Translation(config)
    if dtype is not None:
        hold_in(model, dtype)
    return model


class Teacher:
    """This rank's share of the frozen teacher and the hidden states of the flush in flight.

    Args:
        pm: the teacher built on the student's mesh (`build_parallel_model` of a `meta_teacher`,
            weights loaded).
    """

    def __init__(self, pm: ParallelModel) -> None:
        self.pm = pm
        model = pm.model
        for p in model.parameters():
            p.requires_grad_(False)
        # Under autocast the residual stream stays fp32 (bf16 branches add into it), so what crosses
        # a stage boundary is fp32 whatever the weights are held in.
        pm.master_dtype = torch.float32
        model.eval()
        self.is_last = model.lm_head is not None
        if self.is_last:
            model.lm_head = FinalHidden()
        pm.loss_fn = self._keep  # the forward-only flush hands each micro-batch's output here
        self.hidden: dict[int, Tensor] = {}  # slot -> (B, T, H), the flush in flight

    @property
    def parameter_bytes(self) -> int:
        """Bytes of this rank's teacher weights (what the formula params x bytes / (pp tp ep) predicts)."""
        return sum(p.numel() * p.element_size() for p in self.pm.model.parameters())

    def check_placement(self, student: ParallelModel) -> None:
        """Raises: ValueError: the teacher's last stage is not on this rank where the student's is."""
        if self.is_last != (student.model.lm_head is not None):
            raise ValueError(
                "the teacher's last stage is on another pp rank than the student's: cut both with "
                "the same schedule and stages per rank"
            )

    def _keep(self, hidden: Tensor, batch: Seq2SeqBatch) -> Tensor:
        self.hidden[batch.slot] = hidden
        return hidden.new_zeros((), dtype=torch.float32)

    @torch.no_grad()
    def forward(self, microbatches: Sequence[Seq2SeqBatch], step: int) -> None:
        """The teacher over one flush's micro-batches (collective over the mesh); the last stage
        keeps their hidden states until the student's loss takes them."""
        if self.hidden:
            raise RuntimeError(f"the teacher's states of slots {sorted(self.hidden)} were never used")
        self.pm.model.moe.begin_step(self.pm.seed, step, 0.0)  # keys the routing noise, if any
        self.pm.forward_flush(microbatches, replicated=False)

    def take(self, slot: int) -> Tensor:
        """The hidden states of the micro-batch in `slot` (dropped here once taken)."""
        return self.hidden.pop(slot)

    @property
    def head_weight(self) -> Tensor:
        """The teacher's head: its tied embedding's rows of this rank's vocabulary columns (V/p, H)."""
        shared = self.pm.model.shared
        assert shared is not None, "the head lives on the last stage"
        weight = shared.weight
        assert isinstance(weight, Tensor)
        return weight


class DistillationLoss:
    """The student's training loss (`ParallelModel.train_with`): (1 - alpha) CE + alpha KD per
    micro-batch, with the two sums added up apart on the device until `take_sums`.

    Args:
        teacher: this rank's teacher (its states are read on the last stage only).
        settings: alpha, temperature, label smoothing.
        student: the student, for its vocabulary columns under tp.
    """

    def __init__(self, teacher: Teacher, settings: DistillSettings, student: ParallelModel) -> None:
        self.teacher, self.settings = teacher, settings
        info = student.tp_info
        self.vocab = None if info is None else VocabSlice(info.group, info.vocab_start, info.vocab_size)
        zero = torch.zeros((), dtype=torch.float32, device=student.device)
        self.sums = [zero, zero.clone()]  # CE, KD: this rank's micro-batches since `take_sums`

    def __call__(self, logits: Tensor, batch: Seq2SeqBatch) -> Tensor:
        hidden = self.teacher.take(batch.slot)
        loss, ce, kd = distillation_loss_sum(
            logits, hidden, self.teacher.head_weight, batch.labels, self.settings, self.vocab
        )
        self.sums[0] += ce
        self.sums[1] += kd
        return loss

    def take_sums(self) -> tuple[Tensor, Tensor]:
        """(CE sum, KD sum) of the micro-batches since the last call (device scalars), reset."""
        ce, kd = self.sums
        self.sums = [torch.zeros_like(ce), torch.zeros_like(kd)]
        return ce, kd
