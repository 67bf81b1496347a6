"""The `slow` tier: the quick tier is `pytest -m "not slow"`.

Every test under tests/dist spawns process groups, runs the trainer or launches torchrun
(seconds to a minute each on 2 cores), so it is `slow`, except the modules in QUICK_DIST:
one shared group of a few seconds that keeps multi-process coverage in the quick tier.
Slow tests elsewhere carry `@pytest.mark.slow` themselves.

Also the `multi30k` fixture: the tests' parallel text, found or generated (tests/corpus_data.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import corpus_data
from tests.served import Served, serve

DIST = Path(__file__).parent / "dist"
QUICK_DIST = {"test_tensor_parallel.py"}
# No order of modules is set here: under pytest-xdist (`--dist loadfile`, scripts/test.sh) xdist
# starts the modules with the most tests first, which interleaves the unit modules' one-process work
# with the group tests' waits (rendezvous, signals). Measured on 2 cores within one hour: 12 min 32 s
# that way (an outlier: the same code took 16-18 min later), 14 min 45 s with the longest modules
# first, 16 min 31 s with the compiled-parity module first (docs/development.md).


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent == DIST and item.path.name not in QUICK_DIST:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The session's preloaded Python (tests/served.py): `served.cmd(...)`, `served.torchrun(...)`."""
    with serve(tmp_path_factory.mktemp("served")) as s:
        yield s


def pytest_configure(config: pytest.Config) -> None:
    corpus_data.found()  # a bad MULTI30K_DIR stops the session in one line, before collection


def pytest_report_header(config: pytest.Config) -> str:
    return f"multi30k: {corpus_data.describe()}"


@pytest.fixture(scope="session")
def multi30k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of multi30k's files: the real ones where found, else the built-in corpus written
    in that layout (tests/corpus_data.py)."""
    real = corpus_data.found()
    return real if real is not None else corpus_data.generate(tmp_path_factory.mktemp("multi30k-generated"))
