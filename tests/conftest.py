"""The `slow` tier: the quick tier is `pytest -m "not slow"`.

Every test under tests/dist spawns process groups, runs the trainer or launches torchrun
(seconds to a minute each on 2 cores), so it is `slow`, except the modules in QUICK_DIST:
one shared group of a few seconds that keeps multi-process coverage in the quick tier.
Slow tests elsewhere carry `@pytest.mark.slow` themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.served import Served, serve

DIST = Path(__file__).parent / "dist"
QUICK_DIST = {"test_tensor_parallel.py"}


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
