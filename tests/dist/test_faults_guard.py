"""Failure, part 1: a non-finite loss or gradient never reaches the weights or a committed
checkpoint (`nan_policy`), and SIGTERM / SIGUSR1 save a committed checkpoint and exit 75.

The story (issue 11): with `--learning_rate 1e6` the loss and grad norm were NaN from step 3
to the end, every NaN checkpoint was marked COMMITTED and the run exited 0; SIGTERM to
torchrun killed the workers in 0.6 s with no checkpoint and a torn one left behind.

One spawned 2-rank pp=2 group runs the trainer in-process through every scenario (the
non-finite value or the signal is placed on one rank only, so the ranks' agreement is what
is tested); four launches at once check the exit codes and lines through `python -m
trainer.train` and torchrun: divergence, SIGUSR1 to the workers, Ctrl-C to torchrun, and
torchrun's agent SIGKILLed (issue 36: Ctrl-C gave 149 lines, 4 tracebacks and exit 1 and lost
the steps since the last checkpoint; a killed agent's ranks trained on to the end).
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
from tests.served import Served

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


def _env() -> dict[str, str]:
    """A real interpreter's environment (the served launches take `served.environ()`)."""
    env = {**os.environ, "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _train_args(out: Path, *extra: str) -> list[str]:
    small = [str(x) for kv in SMALL_DATA.items() for x in (f"--{kv[0]}", kv[1])]
    return ["-m", "trainer.train", "--config", "configs/tiny.yaml", "--do_eval", "false", "--plots", "false", *small,
            "--output_dir", str(out), *extra]  # fmt: skip


TORCHRUN_JOBS = ("usr1", "ctrl_c", "agent_killed")  # what is done to each 2-rank job at its step 2


@pytest.fixture(scope="module")
def launched(tmp_path_factory, served: Served) -> dict[str, dict[str, Any]]:
    """Five launches at once: `python -m trainer.train` with lr 1e6 (diverges); a torchrun job of 2
    ranks with a config error; and three torchrun jobs on 2 ranks (pp=2) that, once they log step 2,
    get: SIGUSR1 to their workers (SLURM `--signal=USR1@N`); Ctrl-C (SIGINT to torchrun's process
    group, as a terminal sends it); a SIGKILL of torchrun's agent alone. Per launch: its exit status
    (None where it is not ours to reap), its output, its output_dir, the worker pids and whether
    they were gone in time. The three signalled jobs run in real interpreters, not tests/served.py's:
    their tests look at the process tree (the agent's children, a dead agent); the other two are
    served (5 CPU-s of imports saved per interpreter)."""
    tmp = tmp_path_factory.mktemp("launched")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    procs: dict[str, subprocess.Popen[str]] = {}
    jobs: dict[str, dict[str, Any]] = {}

    def start(name: str, cmd: list[str], env: dict[str, str]) -> None:
        jobs[name] = {"out": tmp / name, "log": tmp / f"{name}.log", "workers": []}
        with jobs[name]["log"].open("w") as log:  # a file, not a pipe: no writer can block on it
            procs[name] = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )

    start("diverge", served.cmd(*_train_args(tmp / "diverge", "--learning_rate", "1e6")), served.environ())
    # the grace covers ranks that reach the error far apart on a loaded host
    bad = served.torchrun("--standalone", "--nproc-per-node", "2", *_train_args(tmp / "bad", "--max_steps", "0"))
    start("bad", bad, served.environ(TRAINER_EXIT_GRACE_S="120"))
    for name in TORCHRUN_JOBS:
        args = _train_args(tmp / name, "--pipeline_parallel_size", "2", "--max_steps", "500")
        start(name, [*torchrun, *args], _env())
    try:
        waiting, deadline = list(TORCHRUN_JOBS), time.monotonic() + 240
        while waiting:
            for name in [n for n in waiting if _logged_step(jobs[n]["out"] / "metrics.jsonl", 2)]:
                waiting.remove(name)
                jobs[name]["agent"] = pid = procs[name].pid
                jobs[name]["workers"] = workers = _children(pid)
                assert len(workers) == 2, (name, workers)
                if name == "usr1":
                    for w in workers:
                        os.kill(w, signal.SIGUSR1)
                elif name == "ctrl_c":
                    os.killpg(pid, signal.SIGINT)
                else:
                    os.kill(pid, signal.SIGKILL)
                jobs[name]["signalled"] = time.monotonic()
            for name in waiting:
                ended = procs[name].poll() is not None
                assert not ended and time.monotonic() < deadline, f"{name}: torchrun ended or stalled"
            time.sleep(0.2)
        for name, proc in procs.items():
            jobs[name]["code"] = proc.wait(timeout=240)
        for name in TORCHRUN_JOBS:  # the workers, also those whose agent is gone
            deadline = jobs[name]["signalled"] + 60
            while any(_running(w) for w in jobs[name]["workers"]) and time.monotonic() < deadline:
                time.sleep(0.2)
            jobs[name]["workers_gone_s"] = time.monotonic() - jobs[name]["signalled"]
            jobs[name]["workers_left"] = [w for w in jobs[name]["workers"] if _running(w)]
    finally:
        for name, proc in procs.items():
            for pid in [*jobs[name]["workers"], proc.pid]:
                if _running(pid):
                    os.kill(pid, signal.SIGKILL)
            proc.wait(timeout=30)
    for job in jobs.values():
        job["text"] = job["log"].read_text()
    return jobs


def _committed(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if (p / "COMMITTED").is_file())


def _last_logged(out: Path) -> int:
    return max(json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines())


def test_config_error_under_torchrun_is_one_line_once(launched) -> None:
    """A config error under torchrun is printed once and torchrun's summary names it, one failure
    listed (issue 36: each rank printed it, and the summary listed every rank with a link as the cause)."""
    job = launched["bad"]
    log, line = job["text"], "error: ConfigError: max_steps=0 must be >= 1, or -1 to train num_train_epochs"
    assert job["code"] == 1 and log.count(line) == 2, log  # printed by rank 0, and in the summary
    assert f"traceback : {line}" in log and "<NO_OTHER_FAILURES>" in log, log
    assert log.startswith(line) and not job["out"].exists(), log


def test_divergence_exits_3_with_one_line(launched) -> None:
    """`python -m trainer.train` with lr 1e6 exits 3 with one line naming the step."""
    job = launched["diverge"]
    last = [ln for ln in job["text"].strip().splitlines() if ln.strip()][-1]
    assert job["code"] == 3, job["text"][-3000:]
    assert last.startswith("error: DivergenceError: step ") and "non-finite loss" in last, last


def test_sigusr1_to_torchrun_workers_saves_and_exits_75(launched) -> None:
    """SIGUSR1 to torchrun's workers (SLURM `--signal=USR1@N`) saves a committed checkpoint and both exit 75."""
    job = launched["usr1"]
    log = job["text"]
    assert job["code"] == 1, log[-3000:]  # torchrun reports failed workers with 1
    # The first worker to exit is the root cause; torchrun then SIGTERMs the other, which may
    # still be tearing down after its own save and exit with 75 or be ended by that signal.
    codes = [int(c) for c in re.findall(r"exitcode\s*: (-?\d+)", log)]
    root = log.split("Root Cause", 1)[-1]
    assert re.search(r"exitcode\s*: 75\b", root) and set(codes) <= {75, -15}, log[-3000:]
    saved = _committed(job["out"])
    assert len(saved) == 1 and saved[0] >= 2 and f"SIGUSR1 at step {saved[0]}" in log, (saved, log[-3000:])


def test_ctrl_c_under_torchrun_saves_and_exits_130_in_a_few_lines(launched) -> None:
    """Issue 36: Ctrl-C to torchrun gave 149 lines, 4 tracebacks (KeyboardInterrupt, gloo's
    "Connection closed by peer"), exit 1, and lost the steps since the last save_steps checkpoint.
    Now torchrun's SIGINT reaches the workers as a stop signal: one line, the step saved, 130."""
    job = launched["ctrl_c"]
    log = job["text"]
    done = re.findall(r"^interrupted: SIGINT at step (\d+): saved (\S+); resume with "
                      r"--resume_from_checkpoint latest \(exit code 130\)$", log, re.M)  # fmt: skip
    assert len(done) == 2 and done[0] == done[1], log[-3000:]  # each rank's line, the same step
    step = int(done[0][0])
    assert _committed(job["out"]) == [step] and step == _last_logged(job["out"]) >= 2  # nothing lost
    assert log.count("SIGINT: a checkpoint is saved at the next step boundary") == 1, log[-3000:]
    # torchrun itself ends with its own SignalException traceback (torch's agent), status 1
    assert log.count("Traceback") == 1 and "SignalException" in log and job["code"] == 1, log[-3000:]
    assert "Connection closed by peer" not in log and "KeyboardInterrupt" not in log
    after = log[log.index("death signal") :].splitlines()
    assert len(after) <= 40, "\n".join(after)
    assert not job["workers_left"], job


def test_a_rank_whose_launcher_is_killed_saves_and_exits(launched) -> None:
    """Issue 36: after `kill -9` of torchrun's agent alone, both ranks trained on to the end without
    supervision. Now they see their parent gone at the next step, save it and exit 75."""
    job = launched["agent_killed"]
    log = job["text"]
    assert job["code"] == -signal.SIGKILL  # the agent
    assert not job["workers_left"], (job["workers_gone_s"], log[-3000:])
    agent = re.escape(f"the launcher (torchrun agent, pid {job['agent']}) died")
    done = re.findall(rf"^preempted: {agent} at step (\d+): saved \S+; .*\(exit code 75\)$", log, re.M)
    assert len(done) == 2 and done[0] == done[1], log[-3000:]
    step = int(done[0])
    assert _committed(job["out"]) == [step] and step == _last_logged(job["out"]) >= 2
    assert "Traceback" not in log, log[-3000:]


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
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, timeout=30).stdout
    return [int(x) for x in out.split()]


def _running(pid: int) -> bool:
    """Alive and not a zombie (a dead worker of a killed agent is reaped by init, or waits as one)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
