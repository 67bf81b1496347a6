"""A rank killed mid-run: `--max-restarts` brings the group back and the run ends where an
uninterrupted one does.

The story: under `torchrun --max-restarts` the restarted group used to die in
`init_process_group` with gloo's "connectFullMesh ... Connection refused", because
torchrun's agent keeps one TCPStore for all attempts and the dead attempt's
address keys were still in it (pytorch/pytorch#135712). `init_distributed` now
gives every attempt its own key namespace; the launcher script uses a fresh store
per attempt instead (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).

Two jobs run side by side (configs/tiny.yaml shrunk, pp=2, fp32, dropout 0,
`--save_steps 3 --resume_from_checkpoint latest`): the reference, uninterrupted,
and plain `torchrun --max-restarts 1`, whose rank 1 SIGKILLs itself as it begins
step 5 on the first attempt (`TRAINER_FAULT_INJECT=kill:rank=1:step=5`). The
killed job must restart once, resume from checkpoint-3 and log, step by step,
exactly the reference's loss, grad norm and learning rate. (The launcher's path,
a fresh store per attempt, is torch's own; it was checked by hand, not here, to
keep the suite short.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist.harness import free_port
from tests.dist.test_multinode import TwoNodes, _env, _torchrun
from tests.served import Served

TIMEOUT_S = 300
MAX_STEPS, SAVE_STEPS, KILL_STEP = 8, 3, 5

TRAINER_ARGS = [
    "--config",
    "configs/tiny.yaml",
    "--dataset_name",
    "builtin",
    "--builtin_size",
    "200",
    "--do_eval",
    "false",
    "--plots",
    "false",
    "--pipeline_parallel_size",
    "2",
    "--max_steps",
    str(MAX_STEPS),
    "--save_steps",
    str(SAVE_STEPS),
    "--resume_from_checkpoint",
    "latest",
    "--dropout",
    "0",
    "--attention_dropout",
    "0",
    "--activation_dropout",
    "0",
]


def _rows_by_step(out: Path) -> dict[int, dict[str, float]]:
    """The training rows of metrics.jsonl by step; a step logged twice (before the kill and
    again after the resume) keeps its last row, the one the finished run stands on."""
    rows: dict[int, dict[str, float]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            rows[row["step"]] = {k: row[k] for k in ("loss", "grad_norm", "lr")}
    return rows


@pytest.mark.dist
def test_killed_rank_restarts_resumes_and_matches_uninterrupted_run(served: Served, tmp_path: Path) -> None:
    fault = {"TRAINER_FAULT_INJECT": f"kill:rank=1:step={KILL_STEP}"}
    outs = {name: tmp_path / name for name in ("reference", "killed")}

    def torchrun(out: Path, max_restarts: int) -> list[str]:
        return [
            _torchrun(served),
            "--nproc-per-node",
            "2",
            "--max-restarts",
            str(max_restarts),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}",
            "-m",
            "trainer.train",
            *TRAINER_ARGS,
            "--output_dir",
            str(out),
        ]

    jobs = TwoNodes(
        [torchrun(outs["reference"], 0), torchrun(outs["killed"], 1)], [_env(served), _env(served, **fault)], tmp_path
    ).run(TIMEOUT_S)
    assert jobs.ok, jobs.report()

    reference = _rows_by_step(outs["reference"])
    assert sorted(reference) == list(range(1, MAX_STEPS + 1)), jobs.report()
    log = jobs.output(1)
    # The first attempt really died and the second resumed. torchrun names the failure it dates first:
    # rank 1's SIGKILL (exit code -9), or rank 0's, whose step-5 barrier lost its peer (its error file,
    # written as it exits, can carry the earlier time).
    assert "exitcode: -9" in log or f"barrier that starts step {KILL_STEP} over all ranks, then failed" in log, (
        jobs.report()
    )
    assert f"restart 1 of 1: resuming from {outs['killed'] / f'checkpoint-{SAVE_STEPS}'}" in log, log[-6000:]
    assert "connectFullMesh" not in log, log[-6000:]
    assert _rows_by_step(outs["killed"]) == reference
