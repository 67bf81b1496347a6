"""A layout: one way to run the job (mesh, batch cut, schedule, remat, partition), the trainer
flags that run it, its one-line description and its calibration family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config.schema import ParallelArguments


@dataclass(frozen=True)
class Layout:
    """One way to run the job: mesh, batch cut, schedule, remat and the partition.

    `microbatch` is sentences per micro-batch, or its token cap when `token_mode`.
    """

    pp: int
    tp: int
    dp: int
    m: int
    g: int
    microbatch: int
    schedule: str
    v: int
    remat: str
    partition: str
    balance: tuple[int, ...] = ()
    token_mode: bool = False
    sharding: str = "none"  # data_parallel_sharding: none | zero1 | fsdp
    ep: int = 1  # expert_parallel_size (NLLB-MoE): a divisor of dp


def layout_fields(layout: Layout, sequence_parallel: bool = False) -> dict[str, Any]:
    """The trainer fields that run `layout` over the job's config: the one home of that mapping,
    which both the flags (`layout_args`) and the planner's check of them (`TrainerCheck`) read.

    `virtual_pipeline_stages` is None (unset) for every schedule but interleaved_1f1b: the trainer
    refuses it elsewhere (it would do nothing). `sequence_parallel`: the job asks for it, so a tp = 1
    layout turns it off (the trainer refuses it there)."""
    out: dict[str, Any] = {
        "pipeline_parallel_size": layout.pp,
        "tensor_parallel_size": layout.tp,
        "data_parallel_size": layout.dp,
        "num_microbatches": layout.m,
        "gradient_accumulation_steps": layout.g,
        "max_tokens_per_microbatch"
        if layout.token_mode
        else "per_device_train_batch_size": layout.microbatch,
        "pipeline_schedule": layout.schedule,
        "virtual_pipeline_stages": layout.v if layout.schedule == "interleaved_1f1b" else None,
        "activation_checkpointing": layout.remat,
        "partition_method": ",".join(str(b) for b in layout.balance)
        if len(layout.balance) > 1
        else "uniform",
        "data_parallel_sharding": layout.sharding,
    }
    if layout.ep > 1:
        out["expert_parallel_size"] = layout.ep
    if sequence_parallel and layout.tp == 1:
        out["sequence_parallel"] = False
    return out


def layout_args(layout: Layout, base: list[str], job: ParallelArguments | None = None) -> list[str]:
    """The trainer.train flags that run `layout` (after the config and the user's overrides): its
    `layout_fields`. `job`: the config's parallel section (None: the defaults); an unset field is
    left out, or given as `null` where the config sets it (a virtual_pipeline_stages that a
    schedule other than interleaved_1f1b must not inherit)."""
    flags = [*base]
    fields = layout_fields(layout, job.sequence_parallel if job else False)
    for name, value in fields.items():
        if value is None and getattr(job, name, None) is None:
            continue
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        flags += [f"--{name}", text]
    return flags


Family = tuple[int, int, int, bool]  # (pp, tp, dp, split backward): a calibration family
SPLIT_BACKWARD = ("zero_bubble", "zbv")


def family(layout: Layout) -> Family:
    """The calibration family of a layout: its mesh and whether its backward is split."""
    return layout.pp, layout.tp, layout.dp, layout.schedule in SPLIT_BACKWARD


def describe(layout: Layout) -> str:
    mb = f"{layout.microbatch} tok" if layout.token_mode else f"b={layout.microbatch}"
    return (
        f"pp={layout.pp} tp={layout.tp} dp={layout.dp}{f' ep={layout.ep}' if layout.ep > 1 else ''} m={layout.m} g={layout.g} {mb} "
        f"{layout.schedule}(v={layout.v}) remat={layout.remat} partition={layout.partition}"
        + (f" sharding={layout.sharding}" if layout.sharding != "none" else "")
    )
