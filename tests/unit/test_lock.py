"""The hashed locks (requirements/lock-cpu*.txt, written by scripts/lock.sh) still match
pyproject.toml: every dependency is pinned within its range and hashed, torch and CUDA
packages are left to pip, and the runtime lock agrees with the one holding the extras.
A changed range in pyproject.toml without `scripts/lock.sh` fails here, not at install."""

from __future__ import annotations

import re
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
