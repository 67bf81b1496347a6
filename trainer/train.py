"""Entry point: `torchrun --nproc-per-node N -m trainer.train --config configs/X.yaml [--field value ...]`.

Also `python -m trainer.train ...` for one process. Parses the config, initialises the process
group and calls `trainer.run.loop.run`; the pieces live under trainer/run/ (set-up, the loop,
the step, the guard), trainer/data/, trainer/checkpoint/ and trainer/eval/.
Exit status: 0 done, 2 bad input (`trainer.errors.BAD_INPUT`, one line), 3 diverged, 1 a failed checkpoint
write (one line) or an internal error (its traceback), EXIT_PREEMPTED preempted, EXIT_INTERRUPTED
after Ctrl-C (saved, or stopped at once by a second one; trainer/run/guard.py). Under torchrun a
one-line error is printed once per node and names the cause in torchrun's summary (`trainer.exit_status`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any, NoReturn

import torch.distributed as dist

from parallel.mesh import init_distributed
from trainer.checkpoint import dcp as ckpt
from trainer.config.parse import parse_config
from trainer.errors import BAD_INPUT
from trainer.exit_status import fail_in_one_line
from trainer.lifetime import ParentWatch
from trainer.run.guard import EXIT_DIVERGED, EXIT_INTERRUPTED, DivergenceError, Preempted
from trainer.run.loop import run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the config, initialise the process group, train, tear down."""
    launcher = ParentWatch.for_launcher()  # first: the agent may die at any moment (trainer/lifetime.py)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse_config(argv)
    init_distributed(timeout_s=cfg.parallel.dist_timeout_s)
    try:
        return run(cfg, launcher)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# One line instead of a traceback: bad input (2), divergence (3), a failed checkpoint write (1).
ONE_LINE: tuple[type[Exception], ...] = (*BAD_INPUT, DivergenceError, ckpt.CheckpointWriteError)


def cli(argv: list[str] | None = None) -> int:
    """`main` with the exit statuses of the module docstring; anything not in ONE_LINE (an internal
    ValueError included) propagates with its traceback (exit status 1). Ctrl-C during the steps is
    `Preempted` (saved); before them (set-up, the evaluation before training) it is one line too."""
    try:
        main(argv)
    except Preempted as e:  # a committed checkpoint was written: requeue and resume (trainer/run/guard.py)
        print(f"{'interrupted' if e.exit_code == EXIT_INTERRUPTED else 'preempted'}: {e}", file=sys.stderr)
        return e.exit_code
    except ONE_LINE as e:
        if os.environ.get("TRAINER_TRACEBACK"):
            raise
        status = 2
        if isinstance(e, DivergenceError | ckpt.CheckpointWriteError):
            status = EXIT_DIVERGED if isinstance(e, DivergenceError) else 1
        # once per node under torchrun, its summary naming the cause (trainer.exit_status)
        return fail_in_one_line(
            f"error: {type(e).__name__}: {e} (TRAINER_TRACEBACK=1 for the traceback)", status
        )
    except KeyboardInterrupt:  # Ctrl-C before the loop's handlers (set-up) or after them: nothing to save
        if os.environ.get("TRAINER_TRACEBACK"):
            raise
        print(f"interrupted: SIGINT outside the training steps, nothing saved now; committed checkpoints "
              f"are kept (exit code {EXIT_INTERRUPTED})", file=sys.stderr)  # fmt: skip
        return EXIT_INTERRUPTED
    return 0


def exit_with(status: int) -> NoReturn:
    """Exit with `status`; EXIT_INTERRUPTED by dying of SIGINT, as Python ends on an unhandled Ctrl-C:
    the status is the same 130, and a calling shell script then stops too instead of going on to its
    next command (a shell takes a plain exit as "the program handled the interrupt")."""
    if status == EXIT_INTERRUPTED:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.raise_signal(signal.SIGINT)
    sys.exit(status)


if __name__ == "__main__":
    exit_with(cli())
