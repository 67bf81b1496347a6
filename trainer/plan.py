"""`python -m trainer.plan`: rank the layouts a job can run with, by predicted step time and memory.

    python -m trainer.plan --config configs/tiny.yaml --world_size 2 [--gpus_per_node G]
        [--device_memory_gib M] [--device H100] [--top K] [--output plan.json]
        [--validate K] [--field value ...]          (config overrides, as in trainer.train)

    enumerate   meshes (pp, tp, dp) that `ParallelDims` accepts for the world and node size;
                cuts of the config's global batch (micro-batch x m x g x dp = const);
                schedules x virtual stages (`SCHEDULE_SPACE`), remat policies, partitions,
                data_parallel_sharding where dp > 1 (`SHARDING_SPACE`);
                each candidate's trainer flags must pass `trainer.run.preflight.validate_early`
    cost        `trainer.planner.cost`: per-block costs measured here (or from a device
                table), the simulator on the schedule's action lists, a link model
    calibrate   where the world runs here: one short trainer run per mesh and backward kind
                fits a compute scale and step offset (`trainer.planner.calibrate`)
    rank        drop what does not fit in device memory (steady peak or start-up,
                `trainer.planner.memory`); best predicted step first
    validate    run the top K with trainer.train for a few steps; predicted vs measured

Everything rejected is listed with its reason (in plan.json and counted in the printout).

This module parses the flags and calls the library: `trainer.planner (search, space, cost, calibrate, report)`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from trainer.config.parse import parse_config
from trainer.errors import BAD_INPUT
from trainer.planner.options import parse_args
from trainer.planner.report import format_table, format_validation, validate
from trainer.planner.search import plan


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Plan, print, write plan.json; validate the top K when asked."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    opts, overrides = parse_args(argv)
    base_args = ["--config", opts.config, *overrides]
    cfg = parse_config(list(base_args))
    if opts.device is None:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = plan(cfg, base_args, opts)
    print(format_table(result, opts.top), flush=True)
    if opts.validate:
        result["validation"] = validate(result, opts.validate, opts)
        print(format_validation(result["validation"]), flush=True)
    # `--output outputs/plan.json` on a fresh clone: the directory is made, not an error after planning
    Path(opts.output).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.output).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    try:
        main()
    except BAD_INPUT as e:  # one line, exit 2; an internal error keeps its traceback (exit 1)
        if os.environ.get("TRAINER_TRACEBACK"):
            raise
        print(f"error: {type(e).__name__}: {e} (TRAINER_TRACEBACK=1 for the traceback)", file=sys.stderr)
        sys.exit(2)
