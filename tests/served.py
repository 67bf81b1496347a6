"""One preloaded Python for the whole test session: `python -m trainer.X` and `torchrun` in milliseconds.

A fresh interpreter spends 3-4 s of CPU importing torch, transformers and the trainer on the 2-core
CI machine; the suite starts about a hundred of them (every `python -m trainer.train` of a CLI test,
every torchrun agent and rank). Tests instead run `served.python` / `served.torchrun`: clients of
one server (tests/dist/doc_shell.py) that imported those modules once and forks a child per
command, with the command's cwd, environment, stdio, signals and exit status (a child killed by a
signal makes its client die of the same signal, and a client killed outright takes its child
with it). The docs' commands run in the same server (tests/dist/test_docs_commands.py).

    def test_x(served, tmp_path):
        proc = subprocess.run(served.cmd("-m", "trainer.train", "--config", "configs/tiny.yaml"),
                              env=served.environ(), cwd=ROOT, ...)

`served.environ()` is the environment a served command needs (the server's socket, PYTHONPATH, an
offline hub cache of its own). A command whose import-time environment differs from the server's
(another PYTHONPATH, HF_HUB_CACHE, OMP_NUM_THREADS, ...) runs in a real interpreter instead, so
serving never changes what a test sees. Keep real interpreters (`sys.executable`) for tests about
the process tree itself (a launcher's parent-death handling: a served rank's parent is the server).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.dist.doc_shell import IMPORT_ENV, import_env
from tests.dist.harness import TRAINER_PRELOAD

ROOT = Path(__file__).resolve().parents[1]
DOC_SHELL = ROOT / "tests" / "dist" / "doc_shell.py"
SERVER_START_S = 120
# Launcher variables a surrounding job (or torchrun running pytest) could leak into the commands.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                "MASTER_PORT", "NNODES", "NODE_RANK", "NPROC_PER_NODE", "JOB_ID")  # fmt: skip


@dataclass(frozen=True)
class Served:
    """The session's server: its shims (`bin/python`, `bin/torchrun`) and their environment."""

    bin: Path
    env: dict[str, str]

    @property
    def python(self) -> str:
        return str(self.bin / "python")

    def cmd(self, *args: str) -> list[str]:
        """`python ARGS`, served."""
        return [self.python, *args]

    def torchrun(self, *args: str) -> list[str]:
        """`torchrun ARGS` (its agent and its ranks served)."""
        return [str(self.bin / "torchrun"), *args]

    def environ(self, **extra: str) -> dict[str, str]:
        """The environment of a served command, with `extra` on top."""
        return {**self.env, **extra}


def _write(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def base_env(base: Path) -> dict[str, str]:
    """The session's environment: this one without launcher variables, plus the suite's settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "TORCHELASTIC_"))}
    for k in _LAUNCH_VARS:
        env.pop(k, None)
    env.update({
        "PYTHONPATH": str(ROOT), "HF_HUB_CACHE": str(base / "hub"), "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
    })  # fmt: skip
    return env


@contextmanager
def serve(base: Path) -> Iterator[Served]:
    """Start the server under `base` (its socket, shims, log and hub cache); stop it on exit."""
    shims, sock, log_path = base / "bin", base / "server.sock", base / "server.log"
    shims.mkdir(parents=True)
    client = f"{sys.executable} {DOC_SHELL} client"
    for name in ("python", "python3", "doc-client"):
        _write(shims / name, f'#!/bin/sh\nexec {client} "$@"\n')
    _write(shims / "torchrun", f'#!/bin/sh\nexec {client} -m torch.distributed.run "$@"\n')
    env = base_env(base)
    env.update({
        "DOC_TEST_SOCKET": str(sock), "DOC_TEST_PYTHON": sys.executable,
        "DOC_TEST_CLIENT": str(shims / "doc-client"), "DOC_TEST_SHIMS": str(shims),
        "TORCHRUN": str(shims / "torchrun"), "DOC_TEST_FALLBACKS": str(base / "fallbacks.jsonl"),
    })  # fmt: skip
    env[IMPORT_ENV] = json.dumps(import_env(env))
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [sys.executable, str(DOC_SHELL), "serve", str(sock), ",".join(TRAINER_PRELOAD)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + SERVER_START_S
            while b"ready" not in log_path.read_bytes():
                assert server.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, "the served-python server did not start"
                time.sleep(0.1)
            yield Served(shims, env)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
