"""Every command of README.md and docs/*.md runs, at tiny scale (STYLE: "a command shown to a user
is a command some test runs").

The blocks and their markers are read by tests/dist/doc_blocks.py (its docstring is the
convention). Each page is one test: its blocks run in order with bash in a directory of their own
that holds a copy of the repository's files, so `configs/tiny.yaml` and `scripts/demo.sh` are
where the docs say, and what the commands write (`outputs/`, `models/...`) stays there. The environment:

- `python` and `torchrun` are tests/dist/doc_shell.py's clients of one server that imported torch,
  transformers and the trainer once (a rank starts in milliseconds, not seconds of imports);
  scripts/launch_multinode.sh finds that torchrun through TORCHRUN, scripts/demo.sh through a
  `.venv` whose `activate` puts it first (`.venv/bin/python` is this interpreter, the install
  stamp is fresh, so scripts/_setup_env.sh checks the Python version and installs nothing);
- `sbatch` runs the job script with SLURM's variables for its `#SBATCH` lines (`--nodes`,
  `--gpus-per-node`, `--job-name`, ...), `srun` its command once per node at once
  (`SLURM_NODEID`), once in check mode; `scontrol show hostnames` names 127.0.0.1 per node;
- `hf download` is tests/dist/doc_fixtures.py: a tiny model of the family in the hub cache of
  this test, which the runs read with HF_HUB_OFFLINE=1; W&B is disabled.

A page fails on the first block that exits non-zero, a `check:` block that checked no launch, or
a block over its time limit; the message holds the script and the end of its output.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.dist.doc_blocks import ROOT, Block, doc_pages, read_blocks
from tests.dist.harness import free_port
from tests.served import Served

# Not copied into a page's directory: version control, environments, caches and earlier outputs.
NOT_COPIED = (".git", ".venv", "outputs", "wandb", "runs", "__pycache__", ".*_cache", "*.egg-info", "build")

SBATCH = r"""#!/usr/bin/env bash
# doc-test sbatch: run the job script here with SLURM's variables (no scheduler).
set -euo pipefail
opts=(); while [[ $# -gt 0 && "$1" == -* ]]; do opts+=("$1"); shift; done
script="$1"; shift
val() {  # the option's value: the command line's, else the script's #SBATCH line, else $2
  local v; v="$(printf '%s\n' "${opts[@]}" | sed -n "s/^--$1=//p" | tail -n 1)"
  [[ -n "$v" ]] || v="$(sed -n "s/^#SBATCH --$1=//p" "$script" | tail -n 1)"
  echo "${v:-$2}"
}
export SLURM_JOB_ID="$((RANDOM + 1000))" SLURM_JOB_NAME="$(val job-name "$(basename "$script")")"
export SLURM_NNODES="$(val nodes 1)" SLURM_GPUS_ON_NODE="$(val gpus-per-node 0)"
export SLURM_CPUS_PER_TASK="$(val cpus-per-task 1)" SLURM_SUBMIT_DIR="$PWD"
export SLURM_JOB_NODELIST="node[1-$SLURM_NNODES]"
[[ "$SLURM_GPUS_ON_NODE" != 0 ]] || unset SLURM_GPUS_ON_NODE
echo "Submitted batch job $SLURM_JOB_ID"
exec bash "$script" "$@"
"""
SRUN = r"""#!/usr/bin/env bash
# doc-test srun: the step's command once per node, at once (once when only checked).
while [[ $# -gt 0 && "$1" == -* ]]; do shift; done
n="${SLURM_NNODES:-1}"; [[ "${DOC_TEST_MODE:-run}" == check ]] && n=1
pids=(); for ((i = 0; i < n; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" & pids+=($!); done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""
SCONTROL = r"""#!/usr/bin/env bash
# doc-test scontrol: `show hostnames`: every node is this machine.
for ((i = 0; i < ${SLURM_NNODES:-1}; i++)); do echo 127.0.0.1; done
"""


def _write(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture(scope="module")
def shell(served: Served, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment a block runs in: the session's served `python` / `torchrun` (tests/served.py),
    `hf` and SLURM's commands on the PATH, progress bars off."""
    shims = tmp_path_factory.mktemp("doc_shims")
    _write(shims / "hf", f'#!/bin/sh\nexec {served.python} -m tests.dist.doc_fixtures hf "$@"\n')
    _write(shims / "sbatch", SBATCH)
    _write(shims / "srun", SRUN)
    _write(shims / "scontrol", SCONTROL)
    for name in ("python", "python3", "torchrun"):
        (shims / name).symlink_to(served.bin / name)
    env = served.environ()
    env.update(
        {"PATH": f"{shims}{os.pathsep}{served.bin}{os.pathsep}{env['PATH']}", "DOC_TEST_SHIMS": str(shims)}
    )
    return env


def sandbox(path: Path, shims: str) -> Path:
    """A copy of the repository (its files, not its caches or outputs) where the page's commands write
    (`outputs/`, `models/<name>` of an `hf download --local-dir`, ...), never into the repository, and
    a `.venv` that scripts/_setup_env.sh takes as installed and whose `activate` puts the shims first."""
    shutil.copytree(ROOT, path, ignore=shutil.ignore_patterns(*NOT_COPIED), symlinks=True)
    venv = path / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "bin" / "activate").write_text(f'export VIRTUAL_ENV="{venv}"\nexport PATH="{shims}:$PATH"\n')
    for stamp in (".installed", ".installed-test"):
        (venv / stamp).touch()
    return path


def run_block(block: Block, cwd: Path, env: dict[str, str]) -> str:
    """Run one block; returns its output, or fails the test with the script and the output's end."""
    script = block.script(port=free_port())
    env = {**env, "DOC_TEST_MODE": "check" if block.check else "run",
           "DOC_TEST_TRAIN_ARGS": " ".join(block.train)}  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=block.timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        timed_out = True
    text = out.decode(errors="replace")
    took = time.monotonic() - start
    what = f"{block.where} ({block.language} block, {took:.1f} s)"
    failed = (
        f"timed out after {block.timeout:.0f} s" if timed_out
        else f"exit status {proc.returncode}" if proc.returncode
        else "`check:` but no launch was checked" if block.check and "doc-test check:" not in text
        else None
    )  # fmt: skip
    if failed:
        pytest.fail(f"{what}: {failed}\n----- script -----\n{script}----- output (end) -----\n{text[-6000:]}")
    print(f"{what}: ok{' (checked)' if block.check else ''}")
    return text


@pytest.mark.dist
@pytest.mark.parametrize("page", [str(p.relative_to(ROOT)) for p in doc_pages()])
def test_page_commands_run(page: str, shell: dict[str, str], tmp_path: Path) -> None:
    blocks = read_blocks(ROOT / page)
    cwd = sandbox(tmp_path / "repo", shell["DOC_TEST_SHIMS"])
    for block in blocks:
        if block.skip:
            print(f"{block.where}: skipped: {block.skip}")
            continue
        run_block(block, cwd, shell)
