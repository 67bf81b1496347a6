"""The `slow` tier: the quick tier is `pytest -m "not slow"`.

Every test under tests/dist spawns process groups, runs the trainer or launches torchrun
(seconds to a minute each on 2 cores), so it is `slow`, except the modules in QUICK_DIST:
one shared group of a few seconds that keeps multi-process coverage in the quick tier.
Slow tests elsewhere carry `@pytest.mark.slow` themselves.
"""

from __future__ import annotations

from pathlib import Path

import pytest

DIST = Path(__file__).parent / "dist"
QUICK_DIST = {"test_tensor_parallel.py"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent == DIST and item.path.name not in QUICK_DIST:
            item.add_marker(pytest.mark.slow)
