"""The project runs on a clone anywhere: no tracked file names a path of the machine it was made on.

Issue 36, item 10: 8 test files, two scripts and a config comment read multi30k from this
machine's fixed absolute path, so a user's clone could neither run the tests nor the streaming
example of docs/data.md. Data comes from an argument (`--data_dir`), `MULTI30K_DIR` or the
`multi30k` fixture (tests/corpus_data.py) instead. Benchmark results under benchmarks/ are records
of where a run wrote (its config, as it was); their README is instructions and is checked.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Built from parts so that this file does not match itself.
MACHINE_PATHS = tuple("/" + part for part in ("work/", "root/", "tmp/pytest-"))


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name]


def is_result_record(name: str) -> bool:
    return name.startswith("benchmarks/") and name != "benchmarks/README.md"


def machine_paths(root: Path, names: list[str]) -> list[str]:
    """`file:line: path` for each line of the files `names` under `root` that holds such a path."""
    found = []
    for name in names:
        path = root / name
        if is_result_record(name) or not path.is_file():  # not a file: a deletion not yet committed
            continue
        for number, line in enumerate(path.read_bytes().splitlines(), 1):
            hits = [p for p in MACHINE_PATHS if p.encode() in line]
            if hits:
                found.append(f"{name}:{number}: {hits[0]}")
    return found


def test_no_tracked_file_names_a_path_of_this_machine() -> None:
    names = tracked_files()
    assert "pyproject.toml" in names and "tests/conftest.py" in names  # git listed the checkout
    found = machine_paths(ROOT, names)
    assert not found, "absolute paths of one machine in tracked files:\n" + "\n".join(found)


def test_the_scan_finds_such_a_path(tmp_path: Path) -> None:
    """What the scan would have said of the code before (a test's fixed data path); a benchmark
    result that records where its run wrote is left alone."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "benchmarks").mkdir()
    line = 'DATA = Path("' + MACHINE_PATHS[0] + 'shared/data/multi30k")\n'
    for name in ("tests/test_x.py", "benchmarks/run.json", "benchmarks/README.md"):
        (tmp_path / name).write_text("import gzip\n" + line)
    names = ["tests/test_x.py", "benchmarks/run.json", "benchmarks/README.md", "gone.py"]
    assert machine_paths(tmp_path, names) == [
        f"tests/test_x.py:2: {MACHINE_PATHS[0]}",
        f"benchmarks/README.md:2: {MACHINE_PATHS[0]}",
    ]
