"""Entry point: `torchrun --nproc-per-node N -m trainer.train --config configs/X.yaml [--field value ...]`.

Also `python -m trainer.train ...` for one process. Parses the config, initialises the process
group and calls `trainer.run.loop.run`; the pieces live under trainer/run/ (set-up, the loop,
the step, the guard), trainer/data/, trainer/checkpoint/ and trainer/eval/.
Exit status: 0 done, 2 bad input, 3 diverged, 1 a failed checkpoint write, EXIT_PREEMPTED preempted.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch.distributed as dist

from parallel.mesh import init_distributed
from trainer.checkpoint import dcp as ckpt
from trainer.config.parse import parse_config
from trainer.errors import ConfigError
from trainer.run.guard import EXIT_DIVERGED, EXIT_PREEMPTED, DivergenceError, Preempted
from trainer.run.loop import run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the config, initialise the process group, train, tear down."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse_config(argv)
    init_distributed(timeout_s=cfg.parallel.dist_timeout_s)
    try:
        return run(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Preempted as e:  # a committed checkpoint was written: requeue and resume (trainer/run/guard.py)
        print(f"preempted: {e}", file=sys.stderr)
        sys.exit(EXIT_PREEMPTED)
    except (ConfigError, ValueError, FileNotFoundError, DivergenceError, ckpt.CheckpointWriteError) as e:
        # bad input (2), divergence (3) or a failed checkpoint write (1): one clear line, not a traceback
        if os.environ.get("TRAINER_TRACEBACK"):
            raise
        print(f"error: {type(e).__name__}: {e} (TRAINER_TRACEBACK=1 for the traceback)", file=sys.stderr)
        if isinstance(e, DivergenceError):
            sys.exit(EXIT_DIVERGED)
        sys.exit(1 if isinstance(e, ckpt.CheckpointWriteError) else 2)
