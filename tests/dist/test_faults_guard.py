"""Failure, part 1: a non-finite loss or gradient never reaches the weights or a committed
checkpoint (`nan_policy`), and SIGTERM / SIGUSR1 save a committed checkpoint and exit 75.

The story (issue 11): with `--learning_rate 1e6` the loss and grad norm were NaN from step 3
to the end, every NaN checkpoint was marked COMMITTED and the run exited 0; SIGTERM to
torchrun killed the workers in 0.6 s with no checkpoint and a torn one left behind.

One spawned 2-rank pp=2 group runs the trainer in-process through every scenario (the
non-finite value or the signal is placed on one rank only, so the ranks' agreement is what
is tested); two subprocesses check the exit codes through `python -m trainer.train` and
torchrun.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist.guard_workers import guard_cases
from tests.dist.harness import run_distributed
from tests.dist.train_workers import base_config, mesh_overrides

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]
SMALL_DATA = {"builtin_size": 300, "max_train_samples": 128, "max_eval_samples": 8}  # setup dominates


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> tuple[dict[str, Any], Path]:
    tmp = tmp_path_factory.mktemp("guard")
    base = {**base_config(str(tmp)), **mesh_overrides(pp=2, m=2), **SMALL_DATA, "max_steps": 6}
    base["warmup_steps"] = 0  # step 1 updates the weights (lr 0 at a warmup step would not)
    results = run_distributed(guard_cases, 2, args=(base,), timeout=400, collective_timeout=120)
    return results[1], tmp  # rank 1 is the last stage: the logging rank


def _checkpoint_values_finite(path: Path, tmp: Path) -> bool:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp / f"{path.parent.name}-{path.name}.pt"
    dcp_to_torch_save(str(path), str(target))
    state = torch.load(target, weights_only=False)
    tensors = list(state["model"].values()) + [t for s in state["optim"].values() for t in s.values()]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def test_one_device_read_per_guarded_step(cases) -> None:
    """The guard's flags are the step's only read (tests/dist/test_host_reads.py: none in the flushes)."""
    assert cases[0]["reads_in_guarded_step"] == [1]


def test_sigterm_on_one_rank_saves_and_resume_matches(cases) -> None:
    res, tmp = cases
    name, step, signum, msg, steps = res["preempt"]
    assert (name, step, signum) == ("Preempted", 3, signal.SIGTERM), msg
    assert steps == [1, 2, 3] and "exit code 75" in msg
    ckpt = tmp / "run-preempt" / "checkpoint-3"
    assert (ckpt / "COMMITTED").is_file()
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == 3
    straight = dict(res["straight"])
    resumed = dict(res["resumed"])
    assert sorted(resumed) == [4, 5, 6], resumed
    for s, loss in resumed.items():
        assert abs(loss - straight[s]) <= 1e-5 * abs(straight[s]), (s, loss, straight[s])


def test_sigterm_during_evaluation_saves_right_after_it(cases) -> None:
    res, tmp = cases
    name, step, msg, rows = res["preempt_eval"]
    assert (name, step) == ("Preempted", 2), msg
    assert rows == [(1, False), (2, False), (2, True)]  # the evaluation finished; step 3 never ran
    assert (tmp / "run-preempt-eval" / "checkpoint-2" / "COMMITTED").is_file()


def test_skip_policy_leaves_weights_unchanged_and_stops_after_the_limit(cases) -> None:
    name, msg, unchanged, rows = cases[0]["skip"]
    assert name == "DivergenceError" and msg.startswith("step 6: non-finite grad norm in 3 consecutive"), msg
    assert "nan_max_consecutive_skips=2" in msg
    # Step 2's NaN loss was seen by the last stage only, steps 4-5's NaN grads by the first only.
    assert unchanged == {1: False, 2: True, 3: False, 4: True, 5: True}
    by_step = {r["step"]: r for r in rows}
    assert [by_step[s]["skipped_steps"] for s in (1, 2, 3, 4, 5)] == [0, 1, 1, 2, 3]
    assert "loss" not in by_step[2] and by_step[2]["grad_norm"] is not None  # the loss was the NaN
    assert by_step[4]["grad_norm"] is None  # JSON null, not NaN
    assert all(r["loss"] == r["loss"] for r in rows if "loss" in r)  # no NaN reached a mean
    assert by_step[2]["lr"] == by_step[1]["lr"]  # no scheduler step for a skipped update
    assert by_step[3]["lr"] != by_step[2]["lr"]


def test_stop_policy_never_commits_non_finite_state(cases) -> None:
    res, tmp = cases
    name, msg, steps = res["stop"]
    assert name == "DivergenceError", msg
    bad = int(msg.split()[1].rstrip(":"))
    assert msg.startswith(f"step {bad}: non-finite loss") and "nan_policy=stop" in msg
    assert steps == list(range(1, bad)) and bad >= 2
    run = tmp / "run-stop"
    committed = sorted(p.name for p in run.glob("checkpoint-*") if (p / "COMMITTED").is_file())
    assert (
        committed == [f"checkpoint-{s}" for s in range(1, bad)] and not (run / f"checkpoint-{bad}").exists()
    )
    assert all(_checkpoint_values_finite(run / c, tmp) for c in committed)


def test_a_non_finite_parameter_is_never_saved(cases) -> None:
    res, tmp = cases
    name, msg = res["refuse"]
    assert name == "DivergenceError" and msg.startswith("refusing to save checkpoint-2"), msg
    assert "rank(s) [1]" in msg
    assert not any((tmp / "run-refuse").glob("checkpoint-*"))


def _env(**extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        **extra,
    }
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _train_args(out: Path, *extra: str) -> list[str]:
    small = [str(x) for kv in SMALL_DATA.items() for x in (f"--{kv[0]}", kv[1])]
    return ["-m", "trainer.train", "--config", "configs/tiny.yaml", "--do_eval", "false", *small,
            "--output_dir", str(out), *extra]  # fmt: skip


def test_exit_codes_through_main_and_torchrun(tmp_path) -> None:
    """`python -m trainer.train` with lr 1e6 exits 3 with one line naming the step; SIGUSR1 to
    torchrun's workers (SLURM `--signal=USR1@N`) saves a committed checkpoint and both exit 75; a
    config error under torchrun is printed once and torchrun's summary names it, one failure listed
    (issue 36: each rank printed it, and the summary listed every rank with a link as the cause)."""
    diverge = subprocess.Popen(
        [sys.executable, *_train_args(tmp_path / "nan", "--learning_rate", "1e6")],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out = tmp_path / "usr1"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    preempt = subprocess.Popen(
        [*torchrun, *_train_args(out, "--pipeline_parallel_size", "2", "--max_steps", "500")],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    bad = subprocess.Popen(  # the grace covers ranks that reach the error far apart on a loaded host
        [*torchrun, *_train_args(tmp_path / "bad", "--max_steps", "0")],
        cwd=ROOT, env=_env(TRAINER_EXIT_GRACE_S="120"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        bad_log, _ = bad.communicate(timeout=240)
        deadline = time.monotonic() + 240
        while not _logged_step(out / "metrics.jsonl", 2):
            assert preempt.poll() is None and time.monotonic() < deadline, "torchrun ended or stalled"
            time.sleep(0.2)
        workers = _children(preempt.pid)
        assert len(workers) == 2, workers
        for pid in workers:
            os.kill(pid, signal.SIGUSR1)
        log, _ = preempt.communicate(timeout=120)
        _, err = diverge.communicate(timeout=240)
    finally:
        for proc in (preempt, diverge, bad):
            if proc.poll() is None:
                proc.kill()
    line = "error: ConfigError: max_steps=0 must be >= 1, or -1 to train num_train_epochs"
    assert bad.returncode == 1 and bad_log.count(line) == 2, bad_log  # printed by rank 0, and in the summary
    assert f"traceback : {line}" in bad_log and "<NO_OTHER_FAILURES>" in bad_log, bad_log
    assert bad_log.startswith(line) and not (tmp_path / "bad").exists(), bad_log
    last = [ln for ln in err.strip().splitlines() if ln.strip()][-1]
    assert diverge.returncode == 3, err[-3000:]
    assert last.startswith("error: DivergenceError: step ") and "non-finite loss" in last, last
    assert preempt.returncode == 1, log[-3000:]  # torchrun reports failed workers with 1
    # The first worker to exit is the root cause; torchrun then SIGTERMs the other, which may
    # still be tearing down after its own save and exit with 75 or be ended by that signal.
    codes = [int(c) for c in re.findall(r"exitcode\s*: (-?\d+)", log)]
    root = log.split("Root Cause", 1)[-1]
    assert re.search(r"exitcode\s*: 75\b", root) and set(codes) <= {75, -15}, log[-3000:]
    saved = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if (p / "COMMITTED").is_file())
    assert len(saved) == 1 and saved[0] >= 2 and f"SIGUSR1 at step {saved[0]}" in log, (saved, log[-3000:])


def _logged_step(path: Path, step: int) -> bool:
    if not path.is_file():
        return False
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) >= step:
                return True
        except json.JSONDecodeError:  # a line being written
            pass
    return False


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]
