"""The step guard: divergence (`nan_policy`) and preemption (stop signals, Ctrl-C), agreed by every rank.

One optimizer step (trainer/run/step.py::train_step):

    grads + clip            pm.train_step(...); grad_norm = pm.grads.clip_(max_norm)
    guard.check             [loss non-finite, grad norm non-finite, signal number, fp16 overflow]
                            (4,) fp32, MAX-all-reduced over the world group, read once: the
                            step's one sync
    apply | skip | stop     optimizer.step() + scheduler.step()  |  nothing  |  DivergenceError

The loss sum lives only on the last pipeline stage and the global grad norm is the
same on every rank, so the loss flag needs the world reduce; the signal number rides
along, so a SIGTERM delivered to one rank only still stops every rank at the same
step (no rank can be left waiting in a collective).

nan_policy:
    stop   a non-finite loss or grad norm raises `DivergenceError` before the optimizer
           touches anything: exit code 3, one line naming the step and what was non-finite.
    skip   the step's update is dropped: no AdamW update (parameters and moments unchanged,
           AdamW's step count not advanced) and no scheduler step (the lr schedule counts
           applied updates, as Megatron-LM and the HF Trainer do for skipped fp16 steps);
           the step number and the data position do advance (the poisoned batch is not
           retried). Skips are counted (`skipped_steps` in metrics rows); more than
           `nan_max_consecutive_skips` in a row raise `DivergenceError`.

fp16 overflow (the loss scale's found-inf flag, parallel/loss_scale.py) is not divergence:
the scale was too large. An overflow on any rank skips the step on every rank with the
skip's semantics above, whatever nan_policy says, and is counted apart (`overflow_steps`);
it neither counts towards nor resets the consecutive non-finite skips (as Megatron-LM and
the HF Trainer treat fp16 overflows). A non-finite *loss* is divergence even under fp16
and follows nan_policy.

Preemption: the handler only records the signal number (SIGTERM, SIGUSR1, SIGINT, SIGHUP:
trainer/lifetime.py). At the next step's check every rank learns it; the step completes, a
committed checkpoint of it is written and `Preempted` is raised: exit code 75 (EX_TEMPFAIL of
sysexits.h, "temporary failure, retry later": distinct from 1 = crash, 2 = bad input,
3 = diverged, and from 128+N = killed by signal N, so a launcher can requeue on it). Ctrl-C
(SIGINT) takes the same path but ends with 130, as a shell reports an interrupted program: the
user stopped it, nothing should requeue it; a second Ctrl-C stops at once, unsaved. A rank whose
torchrun agent died (SIGKILLed: it cannot forward anything) sees LAUNCHER_GONE and takes the
path too. See docs/checkpoints.md for torchrun and SLURM.

`assert_finite_state` is the last line of defence: no checkpoint with a non-finite
parameter or optimizer moment is ever written.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from trainer.config.checks import NAN_POLICIES
from trainer.lifetime import LAUNCHER_GONE, STOP_SIGNALS, ParentWatch

logger = logging.getLogger("trainer")

EXIT_DIVERGED = 3
EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL
EXIT_INTERRUPTED = 130  # 128 + SIGINT: a shell's status for a process ended by Ctrl-C (trainer/train.py)


class DivergenceError(RuntimeError):
    """Training produced a non-finite loss, gradient or state; the message names the step."""


class Preempted(Exception):
    """A stop signal arrived; a committed checkpoint of `step` was written. `exit_code`: EXIT_INTERRUPTED
    for SIGINT (Ctrl-C), else EXIT_PREEMPTED."""

    def __init__(self, step: int, signum: int, checkpoint: str, cause: str | None = None) -> None:
        self.exit_code = EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED
        super().__init__(
            f"{cause or signal.Signals(signum).name} at step {step}: saved {checkpoint}; resume with "
            f"--resume_from_checkpoint latest (exit code {self.exit_code})"
        )
        self.step, self.signum, self.checkpoint = step, signum, checkpoint


class PreemptionSignals:
    """A context manager: STOP_SIGNALS set `received` (and do nothing else) while inside.

    Ctrl-C: the first SIGINT is announced in one line (`announce`); a second one, or a SIGTERM after
    it (torchrun's agent answers a second Ctrl-C with SIGTERM to its workers), ends the process at
    once, unsaved, with one line and EXIT_INTERRUPTED. A thread reading the signal wakeup fd does
    that, so it works while the main thread waits in a collective (where Python handlers cannot
    run). SIGINT and SIGHUP ignored when inside begins (`nohup`, a script's background job) stay
    ignored. `launcher`: the torchrun agent's watch (trainer/lifetime.py): once it is gone,
    `pending()` reports LAUNCHER_GONE. The previous handlers and wakeup fd come back on exit.
    Outside the main thread (where Python cannot install handlers) it does nothing and `received`
    stays 0.
    """

    def __init__(
        self,
        signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
        launcher: ParentWatch | None = None,
        announce: bool = True,
    ) -> None:
        self.signals, self.received, self.launcher, self.announce = signals, 0, launcher, announce
        self._previous: dict[signal.Signals, Any] = {}
        self._wakeup: tuple[socket.socket, socket.socket, int] | None = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum  # no work here: the loop acts at the next step boundary

    def pending(self) -> int:
        """The signal to act on at this step boundary (0: none); LAUNCHER_GONE once the launcher died."""
        if not self.received and self.launcher is not None and self.launcher.gone():
            self.received = LAUNCHER_GONE
        return self.received

    def cause(self, signum: int) -> str:
        """`signum` in words for the exit line: its name, or that the launcher died."""
        if signum == LAUNCHER_GONE and self.launcher is not None and self.launcher.gone():
            return f"the launcher (torchrun agent, pid {self.launcher.pid}) died"
        return signal.Signals(signum).name

    def __enter__(self) -> PreemptionSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for s in self.signals:
            if s in (signal.SIGINT, signal.SIGHUP) and signal.getsignal(s) == signal.SIG_IGN:
                continue
            self._previous[s] = signal.signal(s, self._handler)
        if signal.SIGINT in self._previous:
            ours, theirs = socket.socketpair()
            theirs.setblocking(False)
            self._wakeup = (ours, theirs, signal.set_wakeup_fd(theirs.fileno(), warn_on_full_buffer=False))
            _WAKEUP_FDS.add(theirs.fileno())
            threading.Thread(target=self._watch_interrupts, args=(ours,), name="ctrl-c", daemon=True).start()
        return self

    def _watch_interrupts(self, sock: socket.socket) -> None:
        """The wakeup fd's reader: one byte per signal delivered (0 from __exit__: stop)."""
        interrupted = False
        while data := sock.recv(64):
            for signum in data:
                if signum == 0:
                    sock.close()
                    return
                if interrupted and signum in (signal.SIGINT, signal.SIGTERM):
                    if self.announce:
                        os.write(2, _ABORTED.encode())
                    os._exit(EXIT_INTERRUPTED)
                if signum == signal.SIGINT and not interrupted:
                    interrupted = True
                    if self.announce:
                        os.write(2, _INTERRUPTED.encode())

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._wakeup is not None:
            ours, theirs, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            _WAKEUP_FDS.discard(theirs.fileno())
            theirs.setblocking(True)
            theirs.send(b"\0")  # the reader stops (and closes its end)
            theirs.close()
            self._wakeup = None
        for s, previous_handler in self._previous.items():
            signal.signal(s, previous_handler)
        self._previous.clear()


_WAKEUP_FDS: set[int] = set()  # the wakeup fds a PreemptionSignals of this process has set


def _forget_wakeup_fd_in_child() -> None:
    """A process forked while a PreemptionSignals is active must not write its own signals into the
    parent's wakeup fd (its Ctrl-C would count as the parent's second)."""
    if _WAKEUP_FDS:
        try:
            previous = signal.set_wakeup_fd(-1)
            if previous not in _WAKEUP_FDS:
                signal.set_wakeup_fd(previous)
        except ValueError:
            pass


os.register_at_fork(after_in_child=_forget_wakeup_fd_in_child)
_INTERRUPTED = (
    "SIGINT: a checkpoint is saved at the next step boundary, then the run exits; "
    "Ctrl-C again stops at once without saving\n"
)
_ABORTED = (
    f"interrupted again: stopped at once without saving (exit code {EXIT_INTERRUPTED}); resume from "
    "the last committed checkpoint with --resume_from_checkpoint latest\n"
)


@dataclass
class Verdict:
    """What every rank agreed on for one step."""

    apply: bool  # run the optimizer and scheduler step
    signum: int  # a preemption signal seen by any rank (0: none)
    overflow: bool = False  # an fp16 overflow on some rank: the step is skipped, the scale backs off
    agreed_overflow: Tensor | None = None  # the agreed flag as a device scalar (for the loss scale)


class StepGuard:
    """Per-step agreement on non-finite values and preemption; counts skipped steps.

    Args:
        policy: "stop" or "skip" (see the module docstring).
        max_consecutive_skips: with "skip", the most non-finite steps in a row before stopping.
        device: where the flags live (NCCL reduces device tensors only).
        signals: the preemption flag to fold into the check (None: no preemption).

    Raises:
        ValueError: an unknown policy or a limit below 1.
    """

    def __init__(
        self,
        policy: str,
        max_consecutive_skips: int,
        device: torch.device,
        signals: PreemptionSignals | None = None,
    ) -> None:
        if policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy={policy!r} is not valid; choose one of {list(NAN_POLICIES)}")
        if max_consecutive_skips < 1:
            raise ValueError(f"nan_max_consecutive_skips={max_consecutive_skips} must be >= 1")
        self.policy, self.max_consecutive, self.device = policy, max_consecutive_skips, device
        self.signals = signals
        self.skipped = 0  # non-finite steps skipped in this process's run (nan_policy=skip)
        self.overflows = 0  # fp16 overflow steps skipped in this process's run
        self.consecutive = 0

    def _signum(self) -> int:
        return self.signals.pending() if self.signals is not None else 0

    def _agree(self, flags: Tensor) -> list[float]:
        """MAX over the world group (in place), then the one read (collective when the world has > 1 rank)."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return [float(x) for x in flags.tolist()]

    def check(
        self, step: int, loss_sum: Tensor | None, grad_norm: Tensor, overflow: Tensor | None = None
    ) -> Verdict:
        """Agree on step `step`'s loss, grad norm, signals and fp16 overflow; collective over the
        world, one device read.

        Args:
            step: the step number (for messages).
            loss_sum: this rank's loss sum (last pipeline stage), None elsewhere.
            grad_norm: the global grad norm before clipping (same on every rank).
            overflow: fp16: this rank's found-inf flag from unscaling its gradients (device scalar).

        Returns:
            Whether to apply the update, any preemption signal, and the agreed overflow.

        Raises:
            DivergenceError: non-finite loss or grad norm with nan_policy=stop, or too many
                consecutive skips (fp16 overflows excepted).
        """
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        loss_bad = zero if loss_sum is None else (~torch.isfinite(loss_sum)).float()
        grad_bad = (~torch.isfinite(grad_norm)).float()
        sig = torch.full((), float(self._signum()), device=self.device)  # a fill, not a host copy
        found = zero if overflow is None else overflow.float()
        flags = torch.stack([loss_bad, grad_bad, sig, found])
        bad_loss, bad_grad, signum, over = self._agree(flags)
        agreed = flags[3]  # reduced in place: the same on every rank
        if over and not bad_loss:  # overflowed gradients make the grad norm non-finite too
            self.overflows += 1
            logger.info(
                "step %d: fp16 gradient overflow: update skipped, loss scale backs off (%d overflow steps)",
                step,
                self.overflows,
            )
            return Verdict(False, int(signum), overflow=True, agreed_overflow=agreed)
        if not (bad_loss or bad_grad):
            self.consecutive = 0
            return Verdict(True, int(signum), agreed_overflow=agreed)
        what = " and ".join(n for n, bad in (("loss", bad_loss), ("grad norm", bad_grad)) if bad)
        if self.policy == "stop":
            raise DivergenceError(
                f"step {step}: non-finite {what} (nan_policy=stop); the step was not applied; lower "
                f"learning_rate, or set nan_policy=skip, and resume from the last checkpoint"
            )
        self.skipped += 1
        self.consecutive += 1
        if self.consecutive > self.max_consecutive:
            raise DivergenceError(
                f"step {step}: non-finite {what} in {self.consecutive} consecutive steps, more than "
                f"nan_max_consecutive_skips={self.max_consecutive} (nan_policy=skip)"
            )
        logger.warning(
            "step %d: non-finite %s: update skipped (%d in a row, %d in total)",
            step,
            what,
            self.consecutive,
            self.skipped,
        )
        return Verdict(False, int(signum), agreed_overflow=agreed)

    def preemption_agreed(self) -> int:
        """Collective over the world: the preemption signal any rank has seen, or 0 (one read)."""
        return int(self._agree(torch.full((1,), float(self._signum()), device=self.device))[0])


def assert_finite_state(model: nn.Module, optimizer: torch.optim.Optimizer, what: str) -> None:
    """Refuse to save `what` if any rank holds a non-finite parameter or optimizer state tensor.

    Collective over the world group (every rank learns which ranks are bad, so all
    raise together and none waits in the save's barriers).

    Raises:
        DivergenceError: naming the checkpoint, the bad ranks and a few of this rank's bad tensors.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    tensors: list[tuple[str, Tensor]] = [(n, p.detach()) for n, p in model.named_parameters()]
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, Tensor) and value.is_floating_point() and value.dim() > 0:
                tensors.append((f"{names.get(id(p), '?')}.{key}", value))
    device = next(model.parameters()).device
    # Each rank checks what it holds: an FSDP / tp DTensor's local shard (the all-reduce below joins them).
    local = [t.to_local() if isinstance(t, DTensor) else t for _, t in tensors]
    flags = torch.stack([torch.isfinite(t).all() for t in local]).logical_not()
    bad = [n for (n, _), f in zip(tensors, flags.tolist()) if f]
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    per_rank = torch.zeros(world, dtype=torch.float32, device=device)
    per_rank[rank] = float(len(bad))
    if world > 1:
        dist.all_reduce(per_rank)
    bad_ranks = [r for r, n in enumerate(per_rank.tolist()) if n]
    if bad_ranks:
        example = f" (here: {bad[:3]})" if bad else ""
        raise DivergenceError(
            f"refusing to save {what}: non-finite values in the model or optimizer state on "
            f"rank(s) {bad_ranks}{example}; nothing was written"
        )
