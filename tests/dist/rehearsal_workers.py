"""The ranks of a config rehearsal (tests/dist/test_rehearsal.py): every config of one world size in
one spawned gloo group, in turn.

Per config, each rank runs the trainer twice as `trainer.train` would (`parse_config` of the
command line, then `run`): first with `TRAINER_FAULT_INJECT=term:rank=0:step=3`, which must end in
`Preempted` (the exit-75 path: step 3 committed), then with `--resume_from_checkpoint latest` to
the last step. Each rank returns its wall and CPU seconds per config and the preempted step.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

FAULT_ENV = "TRAINER_FAULT_INJECT"


def rehearse(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rehearse each case (`name`, `term_at`, `first` and `resume` argv) on this rank."""
    import datasets

    from trainer.config.parse import parse_config
    from trainer.run.guard import Preempted
    from trainer.run.loop import run

    datasets.disable_progress_bars()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)
    out = []
    for case in cases:
        wall, cpu = time.perf_counter(), time.process_time()
        os.environ[FAULT_ENV] = f"term:rank=0:step={case['term_at']}"
        preempted_at = None
        try:
            run(parse_config(case["first"]))
        except Preempted as e:
            preempted_at = e.step
        except Exception as e:
            raise RuntimeError(f"rehearsal of {case['name']} failed: {reproduce(case, world, 'first')}") from e
        finally:
            del os.environ[FAULT_ENV]
        try:
            summary = run(parse_config(case["resume"]))
        except Exception as e:
            raise RuntimeError(f"rehearsal of {case['name']} failed: {reproduce(case, world, 'resume')}") from e
        out.append(
            {
                "name": case["name"],
                "preempted_at": preempted_at,
                "final_step": summary["steps"],
                "wall_s": time.perf_counter() - wall,
                "cpu_s": time.process_time() - cpu,
            }
        )
    return out


def reproduce(case: dict[str, Any], world: int, launch: str) -> str:
    """The command that runs the failed launch by hand."""
    fault = f"{FAULT_ENV}=term:rank=0:step={case['term_at']} " if launch == "first" else ""
    return f"{fault}torchrun --nproc-per-node {world} -m trainer.train {' '.join(case[launch])}"
