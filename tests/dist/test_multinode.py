"""Multi-node placement on one machine: two torchruns (two "nodes") form one 4-rank job.

Each test starts two `torchrun --nnodes 2 --nproc-per-node 2` agents with c10d
rendezvous on 127.0.0.1 and a free port, the way `scripts/launch_multinode.sh`
runs on two real nodes. Checks:

- placement (tests/dist/multinode_workers.py, pp=2 x tp=2): every tp group lies
  inside one node (same GROUP_RANK) and really connects its members, pp groups
  cross nodes, and coordinates follow rank = (pp_i * dp + dp_i) * tp + tp_i;
- the real trainer (configs/tiny.yaml, pp=2 x tp=2, 3 steps) through
  scripts/launch_multinode.sh: 3 finite losses in metrics.jsonl and a checkpoint;
- tp larger than a node (tp=4 with 2 processes per node) is refused with
  ParallelDims.validate's `tensor_parallel_size=4 > LOCAL_WORLD_SIZE(2)` error: inside the placement
  job (LOCAL_WORLD_SIZE from torchrun) and as a unit check.

Every subprocess runs in its own session under a deadline and is killed (with
its workers) on timeout or failure; a failure shows both nodes' output.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest

from parallel.mesh import ParallelDims, coords_to_rank, rank_to_coords
from tests.dist.harness import free_port
from tests.served import Served

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "scripts" / "launch_multinode.sh"
TIMEOUT_S = 240
NNODES, NPROC = 2, 2

def _env(served: Served, **extra: str) -> dict[str, str]:
    """A launcher's environment: the session's served one (tests/served.py), `extra` on top."""
    return served.environ(**extra)


def _torchrun(served: Served) -> str:
    """torchrun, its agent and ranks served by the session's preloaded Python."""
    return served.torchrun()[0]


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill a launcher and the workers it started (its own session)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


class TwoNodes:
    """Two launcher processes ("nodes") on this machine, run to completion under one deadline."""

    def __init__(self, cmds: Sequence[Sequence[str]], envs: Sequence[dict[str, str]], log_dir: Path) -> None:
        self.logs = [log_dir / f"node{i}.log" for i in range(len(cmds))]
        self.returncodes: list[int | None] = []
        self.timed_out = False
        self.wall_s = 0.0
        self.timeout = float(TIMEOUT_S)
        self._cmds, self._envs = cmds, envs

    def run(self, timeout: float = TIMEOUT_S) -> TwoNodes:
        procs: list[subprocess.Popen[bytes]] = []
        self.timeout = timeout
        start = time.monotonic()
        try:
            for cmd, env, log in zip(self._cmds, self._envs, self.logs):
                with open(log, "wb") as fh:  # the child keeps its own handle
                    procs.append(
                        subprocess.Popen(
                            list(cmd),
                            cwd=REPO,
                            env=env,
                            stdout=fh,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
            deadline = start + timeout
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    self.timed_out = True
                    break
                if any(p.poll() not in (None, 0) for p in procs):
                    # One node failed: give the other a moment to fail on its own, then stop it.
                    grace = time.monotonic() + 20
                    while any(p.poll() is None for p in procs) and time.monotonic() < min(grace, deadline):
                        time.sleep(0.2)
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                _kill(p)
            self.wall_s = time.monotonic() - start
        self.returncodes = [p.returncode for p in procs]
        return self

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)

    def output(self, node: int) -> str:
        return self.logs[node].read_text(errors="replace")

    def report(self, tail: int = 8000) -> str:
        """Both nodes' output (the last `tail` characters each), for failure messages."""
        head = f"timed out after {self.timeout:.0f}s; " if self.timed_out else ""
        parts = [f"{head}return codes {self.returncodes}, {self.wall_s:.1f}s"]
        for i in range(len(self.logs)):
            text = self.output(i)
            parts.append(f"----- node {i} output ({len(text)} chars, last {tail}) -----\n{text[-tail:]}")
        return "\n".join(parts)


def _torchrun_nodes(served: Served, script_args: list[str], log_dir: Path) -> TwoNodes:
    """`torchrun --nnodes 2 --nproc-per-node 2` twice, meeting at a fresh c10d endpoint."""
    port, run_id = free_port(), f"test-{uuid.uuid4().hex[:8]}"
    cmd = [
        _torchrun(served),
        "--nnodes",
        str(NNODES),
        "--nproc-per-node",
        str(NPROC),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        "join_timeout=120",
        "--max-restarts",
        "0",
        *script_args,
    ]
    return TwoNodes([cmd, cmd], [_env(served), _env(served)], log_dir)


def _launcher_nodes(served: Served, trainer_args: list[str], log_dir: Path) -> TwoNodes:
    """scripts/launch_multinode.sh on two simulated nodes (NODE_RANK 0 and 1)."""
    port, run_id = free_port(), f"test-{uuid.uuid4().hex[:8]}"
    common = {
        "NNODES": str(NNODES),
        "NPROC_PER_NODE": str(NPROC),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "JOB_ID": run_id,
        "MAX_RESTARTS": "0",
        "RDZV_CONF": "join_timeout=120",
        "TORCHRUN": _torchrun(served),
    }
    envs = [_env(served, **common, NODE_RANK=str(r)) for r in range(NNODES)]
    cmd = ["bash", str(LAUNCHER), *trainer_args]
    return TwoNodes([cmd, cmd], envs, log_dir)


@pytest.mark.dist
def test_placement_tp_inside_nodes_pp_across(served: Served, tmp_path: Path) -> None:
    out = tmp_path / "ranks"
    nodes = _torchrun_nodes(
        served,
        ["-m", "tests.dist.multinode_workers", "--out", str(out), "--pp", "2", "--tp", "2"], tmp_path
    ).run()
    assert nodes.ok, nodes.report()
    recs = {}
    for f in sorted(out.glob("rank*.json")):
        r = json.loads(f.read_text())
        recs[r["rank"]] = r
    assert sorted(recs) == [0, 1, 2, 3], nodes.report()
    shape = (2, 1, 2)
    pp, dp, tp = shape
    by_node: dict[int, list[int]] = {}
    for rank, r in recs.items():
        assert r["world_size"] == 4 and r["local_world_size"] == NPROC and r["mesh_shape"] == list(shape)
        by_node.setdefault(r["group_rank"], []).append(rank)
        # torchrun numbers ranks node by node
        assert rank == r["group_rank"] * NPROC + r["local_rank"], r
        c = r["coords"]
        assert rank == (c["pp"] * dp + c["dp"]) * tp + c["tp"], r
        assert rank == coords_to_rank((c["pp"], c["dp"], c["tp"]), shape)
        assert rank_to_coords(rank, shape) == (c["pp"], c["dp"], c["tp"])
    assert sorted(by_node) == [0, 1] and all(len(v) == NPROC for v in by_node.values()), by_node

    for rank, r in recs.items():
        tp_members = r["groups"]["tp"]
        expected = sorted(
            q
            for q, o in recs.items()
            if (o["coords"]["pp"], o["coords"]["dp"]) == (r["coords"]["pp"], r["coords"]["dp"])
        )
        assert sorted(tp_members) == expected and len(tp_members) == tp, r
        assert {recs[q]["group_rank"] for q in tp_members} == {r["group_rank"]}, (
            f"tp group crosses nodes: {r}"
        )
        assert r["tp_all_gather"] == sorted(tp_members), f"tp group does not connect its members: {r}"
        pp_members = r["groups"]["pp"]
        assert len(pp_members) == pp and rank in pp_members, r
        assert len({recs[q]["group_rank"] for q in pp_members}) == pp, f"pp group inside one node: {r}"
        assert {recs[q]["coords"]["tp"] for q in pp_members} == {r["coords"]["tp"]}, r
        # with tp == procs per node, each pipeline stage is exactly one node
        assert r["coords"]["pp"] == r["group_rank"], r
        # tp=4 > LOCAL_WORLD_SIZE=2 (from torchrun's environment) is refused by the trainer's size check
        assert r["tp_across_nodes_error"] is not None, r
        assert "tensor_parallel_size=4 > LOCAL_WORLD_SIZE(2)" in r["tp_across_nodes_error"], r


@pytest.mark.dist
def test_two_simulated_nodes_train_tiny_model(served: Served, tmp_path: Path) -> None:
    out = tmp_path / "run"
    nodes = _launcher_nodes(
        served,
        [
            "--config",
            "configs/tiny.yaml",
            "--pipeline_parallel_size",
            "2",
            "--tensor_parallel_size",
            "2",
            "--num_microbatches",
            "4",
            "--max_steps",
            "3",
            "--do_eval",
            "false",
            "--output_dir",
            str(out),
        ],
        tmp_path,
    ).run()
    assert nodes.ok, nodes.report()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3], nodes.report()
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["mesh"] == {"pp": 2, "dp": 1, "tp": 2} and summary["steps"] == 3, summary
    mem = summary["memory"]  # every rank's peaks, gathered by the logging rank
    host, startup, train = (
        mem["peak_host_bytes"],
        mem["startup_peak_host_bytes"],
        mem["train_peak_host_bytes"],
    )
    assert len(host) == len(startup) == len(train) == 4, mem
    assert all(100 * 2**20 < s <= t <= h < 8 * 2**30 for s, t, h in zip(startup, train, host)), mem
    assert mem["peak_cuda_allocated_bytes"] is None and mem["peak_cuda_reserved_bytes"] is None
    ckpt = out / "checkpoint-3"
    assert ckpt.is_dir() and any(ckpt.iterdir()), nodes.report()


def test_tp_larger_than_a_node_is_refused() -> None:
    dims = ParallelDims(pp=1, dp=-1, tp=4, world_size=4, local_world_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 > LOCAL_WORLD_SIZE\(2\)"):
        dims.validate()
    # the same sizes inside one 4-process node are fine, and the override lifts the check
    assert ParallelDims(pp=1, dp=-1, tp=4, world_size=4, local_world_size=4).validate().dp == 1
    assert (
        ParallelDims(pp=1, dp=-1, tp=4, world_size=4, local_world_size=2, allow_tp_across_nodes=True)
        .validate()
        .dp
        == 1
    )
