"""A pipeline plan: the model's blocks cut into stages, the schedule, and where it places them.

Pure data (no `torch.distributed`): `make_plan` cuts the block list by a balance and builds
the schedule's action lists; `PipelinePlan` answers which blocks and stages a pp rank holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from models.m2m100 import BlockSpec
from parallel.pipeline.schedule import Action, ActionType, Placement, build_schedule, placement_for


@dataclass
class PipelinePlan:
    """Pure description of the split: blocks per stage (n = p * v stages), the schedule, and
    where the schedule places the stages (`placement`: interleaved, or a V for ZB-V)."""

    stage_blocks: list[list[BlockSpec]]
    p: int
    v: int
    m: int
    schedule_name: str
    schedule: list[list[Action]] = field(default_factory=list)

    @property
    def n_stages(self) -> int:
        return len(self.stage_blocks)

    @property
    def placement(self) -> Placement:
        return placement_for(self.schedule_name, self.p, self.v)

    @property
    def last_stage_rank(self) -> int:
        """pp rank of the last stage (the loss): p - 1, or 0 under ZB-V's V."""
        return self.placement.rank_of(self.n_stages - 1)

    @property
    def split_backward(self) -> bool:
        """Whether the schedule splits backwards into I and W (zero bubble: deferred weight grads)."""
        return any(a.type is ActionType.BACKWARD_WEIGHT for actions in self.schedule for a in actions)

    def rank_blocks(self, pp_rank: int) -> list[BlockSpec]:
        return [b for s in self.placement.stages_of(pp_rank) for b in self.stage_blocks[s]]

    def shared_embedding_ranks(self) -> list[int]:
        """pp ranks whose stages hold a block using the tied embedding (first, tgt_embed, last);
        one rank when all of them share it (ZB-V puts the first and last stage on rank 0)."""
        return sorted(
            {
                self.placement.rank_of(s)
                for s, blocks in enumerate(self.stage_blocks)
                if any(b.uses_shared_embedding for b in blocks)
            }
        )


def make_plan(
    blocks: Sequence[BlockSpec], balance: Sequence[int], p: int, v: int, m: int, schedule_name: str
) -> PipelinePlan:
    """Cut `blocks` by `balance` (block counts per stage) and build the schedule.

    Raises:
        ValueError: balance does not fit the blocks / stages, or the schedule arguments are invalid.
    """
    from parallel.pipeline.partition import validate_balance

    validate_balance(list(balance), len(blocks), p * v)
    cuts: list[list[BlockSpec]] = []
    start = 0
    for n in balance:
        cuts.append(list(blocks[start : start + n]))
        start += n
    return PipelinePlan(cuts, p, v, m, schedule_name, build_schedule(schedule_name, p, m, v))
