"""Failure handling without process groups: the per-attempt store namespace under torchrun's
shared store (parallel/mesh.py), wait messages, the wrapped error and the watchdog's warning
(parallel/watchdog.py, parallel/pipeline/p2p.py), and the fault-injection spec (trainer/faults.py)."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from parallel import watchdog
from parallel.mesh import elastic_attempt_store
from parallel.pipeline import p2p
from parallel.pipeline.schedule import Action, ActionType
from parallel.watchdog import CommWaitError, RankIdentity
from trainer.run.faults import FaultInjection

ME = RankIdentity(rank=6, shape=(2, 2, 2))  # pp=1 dp=1 tp=0


@pytest.fixture(autouse=True)
def _fresh_watchdog():
    yield
    watchdog.stop_watchdog()
    watchdog.start_watchdog(None, 0)  # identity back to unset, no thread


def test_each_restart_attempt_gets_its_own_keys_in_the_agent_store(monkeypatch) -> None:
    """Regression: a restarted group read the dead attempt's gloo address keys from torchrun's
    shared store (pytorch/pytorch#135712); each attempt now writes under its own prefix."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert elastic_attempt_store(timedelta(seconds=5)) is None  # env:// rendezvous as usual
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        store = elastic_attempt_store(timedelta(seconds=5))
        assert store is not None
        store.set("0/cpu/rank_1", f"address of attempt {attempt}")
    assert agent.get("polyglot3d/attempt0/default_pg/0/cpu/rank_1") == b"address of attempt 0"
    assert agent.get("polyglot3d/attempt1/default_pg/0/cpu/rank_1") == b"address of attempt 1"


def test_rank_and_transfer_descriptions() -> None:
    assert ME.describe() == "pp rank 1 (pp=1 dp=1 tp=0, global rank 6)"
    recv = p2p.Transfer(False, 2, [torch.empty(1)], 5, Action(ActionType.RECV_FORWARD, 1, 3))
    assert recv.describe(ME) == (
        "the activations of micro-batch 3 for stage 1 (RF1.3) from pp rank 0 (global rank 2)"
    )
    send = p2p.Transfer(True, 2, [torch.empty(1)], 5, Action(ActionType.SEND_BACKWARD, 1, 0))
    assert send.describe(ME) == (
        "pp rank 0 (global rank 2) to take the input gradients of micro-batch 0 of stage 1 (SB1.0)"
    )
    assert p2p.Transfer(False, 2, [], 5).describe(None) == "the message with tag 5 from global rank 2"


def test_failed_wait_is_reraised_with_who_and_what() -> None:
    watchdog.start_watchdog(ME, 0)
    with pytest.raises(CommWaitError) as info:
        with watchdog.waiting(lambda me: f"the thing from {me.peer(0) if me else '?'}"):
            raise RuntimeError("Timed out waiting 3000ms for recv operation to complete\nmore")
    msg = str(info.value)
    assert msg.startswith("pp rank 1 (pp=1 dp=1 tp=0, global rank 6) waited ")
    assert msg.endswith(
        "for the thing from pp rank 0 (global rank 0), then failed: "
        "Timed out waiting 3000ms for recv operation to complete"
    )
    assert isinstance(info.value.__cause__, RuntimeError)
    assert watchdog._SLOT.current is None  # the slot is cleared on the way out


def test_watchdog_warns_once_per_long_wait_and_not_for_short_ones(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="parallel.watchdog")
    watchdog.start_watchdog(ME, warn_after_s=0.2, timeout_s=9, interval_s=0.02)
    with watchdog.waiting("a short wait"):
        time.sleep(0.05)
    released = threading.Event()
    with watchdog.waiting("the slow peer"):
        released.wait(0.6)  # stands in for a blocked work.wait()
    time.sleep(0.1)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith("pp rank 1 (pp=1 dp=1 tp=0, global rank 6) has waited ")
    assert "for the slow peer (warning after 0.2 s; the collective timeout is 9 s)" in msgs[0]


def test_default_warning_threshold() -> None:
    assert watchdog.default_warn_after(30) == 15
    assert watchdog.default_warn_after(600) == 60


def test_fault_spec(monkeypatch) -> None:
    monkeypatch.delenv("TRAINER_FAULT_INJECT", raising=False)
    assert FaultInjection.from_env() is None
    monkeypatch.setenv("TRAINER_FAULT_INJECT", "kill:rank=1:step=4")
    assert FaultInjection.from_env() == FaultInjection("kill", 1, 4, 0)
    monkeypatch.setenv("TRAINER_FAULT_INJECT", "stop:rank=0:step=2:attempt=1")
    assert FaultInjection.from_env() == FaultInjection("stop", 0, 2, 1)
    for bad in ("explode:rank=1:step=4", "kill:rank=1", "kill:rank=x:step=4", "kill:rank=1:step=4:when=3"):
        monkeypatch.setenv("TRAINER_FAULT_INJECT", bad)
        with pytest.raises(
            ValueError, match="TRAINER_FAULT_INJECT=.* is not valid; use ACTION:rank=R:step=S"
        ):
            FaultInjection.from_env()
    # Not this rank, step or attempt: nothing happens (the process is still here).
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    FaultInjection("kill", 1, 4, 0).maybe_fire(4, 1)
    FaultInjection("kill", 1, 4, 1).maybe_fire(3, 1)
    FaultInjection("kill", 1, 4, 1).maybe_fire(4, 0)
