"""A layout: one way to run the job (mesh, batch cut, schedule, remat, partition), the trainer
flags that run it, its one-line description and its calibration family.
"""

from __future__ import annotations

from dataclasses import dataclass


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


def layout_args(layout: Layout, base: list[str], sequence_parallel: bool = False) -> list[str]:
    """The trainer.train flags that run `layout` (after the config and the user's overrides);
    `sequence_parallel`: the job asks for it, so a tp = 1 layout turns it off (the trainer
    refuses it there: it would do nothing)."""
    size = "--max_tokens_per_microbatch" if layout.token_mode else "--per_device_train_batch_size"
    balance = ",".join(str(b) for b in layout.balance) if len(layout.balance) > 1 else "uniform"
    return [
        *base,
        "--pipeline_parallel_size", str(layout.pp),
        "--tensor_parallel_size", str(layout.tp),
        "--data_parallel_size", str(layout.dp),
        "--num_microbatches", str(layout.m),
        "--gradient_accumulation_steps", str(layout.g),
        size, str(layout.microbatch),
        "--pipeline_schedule", layout.schedule,
        "--virtual_pipeline_stages", str(max(layout.v, 2)),
        "--activation_checkpointing", layout.remat,
        "--partition_method", balance,
        "--data_parallel_sharding", layout.sharding,
        *(["--expert_parallel_size", str(layout.ep)] if layout.ep > 1 else []),
        *(["--sequence_parallel", "false"] if sequence_parallel and layout.tp == 1 else []),
    ]  # fmt: skip


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
