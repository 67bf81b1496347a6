"""The hashed locks (requirements/lock-cpu*.txt, written by scripts/lock.sh) still match
pyproject.toml: every dependency is pinned within its range and hashed, torch and CUDA
packages are left to pip, and the runtime lock agrees with the one holding the extras.
A changed range in pyproject.toml without `scripts/lock.sh` fails here, not at install."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python 3.11+, as the locks

ROOT = Path(__file__).resolve().parents[2]
LOCKS = {"runtime": ROOT / "requirements/lock-cpu.txt", "extras": ROOT / "requirements/lock-cpu-extras.txt"}
PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+) \\$")


def read_lock(path: Path) -> dict[str, tuple[str, int]]:
    """{name: (version, number of hashes)} of a `uv pip compile --generate-hashes` file."""
    pins: dict[str, tuple[str, int]] = {}
    name = None
    for line in path.read_text().splitlines():
        if m := PIN.match(line):
            name = canonicalize_name(m[1])
            pins[name] = (m[2], 0)
        elif line.strip().startswith("--hash=sha256:") and name:
            version, hashes = pins[name]
            pins[name] = (version, hashes + 1)
        elif line and not line.startswith((" ", "#")):
            pytest.fail(f"{path.name}: unexpected line {line!r} (only `name==version \\` and hashes)")
    return pins


def wanted() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = [Requirement(r) for r in project["dependencies"]]
    extras = [Requirement(r) for reqs in project["optional-dependencies"].values() for r in reqs]
    return {"runtime": runtime, "extras": runtime + extras}


@pytest.mark.parametrize("lock", list(LOCKS))
def test_lock_pins_every_dependency_in_range_with_hashes(lock: str) -> None:
    pins = read_lock(LOCKS[lock])
    assert pins, LOCKS[lock]
    unhashed = [n for n, (_, hashes) in pins.items() if hashes == 0]
    assert not unhashed, f"{LOCKS[lock].name}: no --hash for {unhashed}"
    for req in wanted()[lock]:
        name = canonicalize_name(req.name)
        if name == "torch":  # installed by pip (scripts/_setup_env.sh, TORCH_SPEC)
            assert name not in pins, f"{LOCKS[lock].name} pins torch: rerun scripts/lock.sh"
            continue
        assert name in pins, f"{LOCKS[lock].name} lacks {req}: rerun scripts/lock.sh"
        version = pins[name][0]
        assert req.specifier.contains(version, prereleases=True), (
            f"{LOCKS[lock].name}: {name}=={version} is outside pyproject's {req}: rerun scripts/lock.sh"
        )
    cuda = [n for n in pins if n.startswith("nvidia-") or n == "triton"]
    assert not cuda, f"{LOCKS[lock].name} holds CUDA packages {cuda}: lock against the CPU torch build"


def test_runtime_lock_agrees_with_the_extras_lock() -> None:
    runtime, extras = read_lock(LOCKS["runtime"]), read_lock(LOCKS["extras"])
    differ = {
        n: (v, extras.get(n, (None, 0))[0]) for n, (v, _) in runtime.items() if extras.get(n, ("",))[0] != v
    }
    assert not differ, f"lock-cpu.txt vs lock-cpu-extras.txt versions: {differ}"


def _setup_env(tmp_path: Path, version: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """scripts/_setup_env.sh in a copy of the repository's scripts and locks, with PYTHON a stub
    that reports `version` and records what else it is asked to do."""
    for sub in ("scripts", "requirements"):
        shutil.copytree(ROOT / sub, tmp_path / sub)
    log = tmp_path / "python.log"
    fake = tmp_path / "fake-python"
    fake.write_text(
        f'#!/usr/bin/env bash\nif [ "$1" = -c ]; then echo {version}; exit 0; fi\necho "$@" >> {log}; exit 1\n'
    )
    fake.chmod(0o755)
    done = subprocess.run(
        ["bash", str(tmp_path / "scripts/_setup_env.sh")],
        env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return done, log


def test_setup_refuses_a_python_the_lock_is_not_for(tmp_path: Path) -> None:
    """Issue 30: on another Python the set-up created .venv, then failed halfway through the hashed
    install; now one line before anything is created says which Python the lock needs."""
    header = LOCKS["runtime"].read_text().splitlines()[1]
    locked = re.search(r"# Python (\d+\.\d+),", header)
    assert locked, header
    other = "3.99" if locked[1] != "3.99" else "3.98"
    done, log = _setup_env(tmp_path, other)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and f"is Python {other} but requirements/lock-cpu.txt is locked for Python {locked[1]}" in lines[0]
    )
    assert f"PYTHON=python{locked[1]}" in lines[0]
    assert not (tmp_path / ".venv").exists() and not log.exists()


def test_setup_takes_the_python_the_lock_is_for(tmp_path: Path) -> None:
    locked = re.search(r"# Python (\d+\.\d+),", LOCKS["runtime"].read_text())
    assert locked
    done, log = _setup_env(tmp_path, locked[1])
    assert done.returncode != 0  # the stub creates no venv: the script stops there
    assert log.read_text().split()[:3] == ["-m", "venv", ".venv"]  # past the check, to the venv
