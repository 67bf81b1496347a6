"""The planner's options: its flags, parsed and checked once into a typed `PlanOptions`.

`parse_args` builds it from `python -m trainer.plan`'s command line; every planner function
takes the `PlanOptions` (or the fields it needs), never the raw `argparse.Namespace`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from trainer.config.flags import argument_error, checked, one_line
from trainer.planner.space import REMAT_SPACE, SCHEDULE_SPACE, SHARDING_SPACE

DESCRIPTION = (
    "`python -m trainer.plan`: rank the layouts a job can run with, by predicted step time and memory."
)


@dataclass(frozen=True)
class PlanOptions:
    """The planner's own flags (the job's config and overrides are parsed by `trainer.config`)."""

    config: str  # the job's YAML/JSON config
    world_size: int  # ranks in all
    gpus_per_node: int | None = None  # ranks per node; None: one node
    device_memory_gib: float | None = None  # memory per rank; None: from the device table
    device: str | None = None  # cost this device from the table instead of measuring here
    memory_headroom: float = 0.9  # usable share of device memory
    top: int = 10  # candidates printed
    output: str = "plan.json"
    validate: int = 0  # run the top K with trainer.train
    validate_steps: int = 24
    validate_warmup: int = 4
    validate_repeats: int = 3
    validate_timeout: float = 600
    validate_dir: str | None = None
    calibrate: str = "auto"  # auto | true | false
    seq_len: int | None = None  # fixed sentence length instead of the data's
    max_microbatches: int = 64
    keep: int = 50  # fitting layouts simulated before pruning by bound
    schedules: list[str] | None = None  # only these schedules
    remat: list[str] | None = None  # only these remat policies
    sharding: list[str] | None = None  # only these data_parallel_sharding modes (where dp > 1)
    host_baseline_gib: float | None = (
        None  # the process's own bytes; None: measured constant on CPU, 0 on a device
    )
    repeats: int = 5  # timed repetitions per block
    link_gbps: float | None = None  # skip the link measurement
    link_latency_us: float = 50.0
    inter_node_gbps: float | None = None

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> PlanOptions:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})


def _names(text: str) -> list[str]:
    return [x for x in text.replace(" ", "").split(",") if x]


def parse_args(argv: list[str] | None) -> tuple[PlanOptions, list[str]]:
    """The planner's flags, and the rest (config overrides, as trainer.train takes them).

    Raises:
        ConfigError: a missing or bad planner flag, in one line (no usage block: `one_line`).
    """
    ap = one_line(argparse.ArgumentParser(prog="python -m trainer.plan", description=DESCRIPTION))
    ap.add_argument("--config", required=True, help="The job's YAML/JSON config (as for trainer.train).")
    ap.add_argument("--world_size", type=int, required=True, help="Ranks (processes / GPUs) in all.")
    ap.add_argument("--gpus_per_node", type=int, default=None, help="Ranks per node; default: one node.")
    ap.add_argument("--device_memory_gib", type=float, default=None, help="Memory per rank; default: table.")
    ap.add_argument("--device", default=None, help="Cost another device from the table (H100, H200, A100).")
    ap.add_argument("--memory_headroom", type=float, default=0.9, help="Usable share of device memory.")
    ap.add_argument("--top", type=int, default=10, help="Candidates to print.")
    ap.add_argument("--output", default="plan.json", help="Where the ranked candidates are written.")
    ap.add_argument("--validate", type=int, default=0, help="Run the top K with trainer.train.")
    ap.add_argument("--validate_steps", type=int, default=24)
    ap.add_argument("--validate_warmup", type=int, default=4)
    ap.add_argument(
        "--validate_repeats", type=int, default=3, help="Runs per layout (median of their medians)."
    )
    ap.add_argument("--validate_timeout", type=float, default=600)
    ap.add_argument(
        "--validate_dir", default=None, help="Output dirs of the calibration and validation runs."
    )
    ap.add_argument(
        "--calibrate", choices=("auto", "true", "false"), default="auto",
        help="Fit each mesh's compute scale and step offset from one short trainer run (auto: when the "
        "world runs on this machine and costs are measured here). --validate_steps/_warmup apply.",
    )  # fmt: skip
    ap.add_argument("--seq_len", type=int, default=None, help="Fixed sentence length instead of the data's.")
    ap.add_argument("--max_microbatches", type=int, default=64)
    ap.add_argument("--keep", type=int, default=50, help="Fitting layouts simulated before pruning by bound.")
    ap.add_argument("--schedules", type=_names, default=None, help="Only these schedules (comma list).")
    ap.add_argument("--remat", type=_names, default=None, help="Only these remat policies (comma list).")
    ap.add_argument(
        "--sharding", type=_names, default=None, help="Only these data_parallel_sharding modes (comma list)."
    )
    ap.add_argument(
        "--host_baseline_gib", type=float, default=None,
        help="Memory a rank's process holds besides the model (interpreter, torch, data); default: "
        "trainer.planner.memory.HOST_BASELINE_BYTES when costing this host's CPU, 0 for a --device.",
    )  # fmt: skip
    ap.add_argument("--repeats", type=int, default=5, help="Timed repetitions per block.")
    ap.add_argument("--link_gbps", type=float, default=None, help="Skip the link measurement: GB/s.")
    ap.add_argument("--link_latency_us", type=float, default=50.0)
    ap.add_argument("--inter_node_gbps", type=float, default=None)
    for action in ap._actions:  # `--top ten`: "top='ten' is not an integer", as trainer.train says it
        if action.type in (int, float):
            action.type = checked(action.dest, action.type.__name__, action.type)  # type: ignore[union-attr]
    try:
        opts, rest = ap.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise argument_error(e) from None
    for name in (
        "world_size",
        "top",
        "keep",
        "max_microbatches",
        "repeats",
        "validate_steps",
        "validate_repeats",
    ):
        if getattr(opts, name) < 1:
            ap.error(f"--{name}={getattr(opts, name)} must be >= 1")
    for flag, given, known in (("schedules", opts.schedules, [n for n, _ in SCHEDULE_SPACE]),
                               ("remat", opts.remat, list(REMAT_SPACE)),
                               ("sharding", opts.sharding, list(SHARDING_SPACE))):  # fmt: skip
        bad = sorted(set(given or []) - set(known))
        if bad:
            ap.error(f"--{flag} {bad} unknown; choose from {known}")
    if opts.host_baseline_gib is not None and opts.host_baseline_gib < 0:
        ap.error(f"--host_baseline_gib={opts.host_baseline_gib} must be >= 0")
    if opts.validate < 0 or opts.validate_warmup >= opts.validate_steps:
        ap.error("--validate must be >= 0 and --validate_warmup < --validate_steps")
    if opts.gpus_per_node is not None and (opts.gpus_per_node < 1 or opts.world_size % opts.gpus_per_node):
        ap.error(
            f"--gpus_per_node={opts.gpus_per_node} must be >= 1 and divide --world_size={opts.world_size}"
        )
    return PlanOptions.from_namespace(opts), rest
