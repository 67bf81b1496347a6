"""Fault injection for the failure tests: a rank kills or stops itself at a given step.

A test hook, off unless the environment variable is set:

    TRAINER_FAULT_INJECT=kill:rank=1:step=4            rank 1 SIGKILLs itself as it begins step 4
    TRAINER_FAULT_INJECT=stop:rank=1:step=4:attempt=0  ... SIGSTOPs itself (a hang), first attempt only
    TRAINER_FAULT_INJECT=term:rank=0:step=3            ... SIGTERMs itself (a preemption notice)

`rank` is the global rank; `attempt` is torchrun's TORCHELASTIC_RESTART_COUNT
(default 0: only the first attempt fails, so a group restarted by
`--max-restarts` runs through). Steps before `step` are complete, checkpoints
included, when the signal is sent. The spec is parsed before anything is
written; a malformed one is a one-line error.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from trainer.errors import ConfigError

ENV_VAR = "TRAINER_FAULT_INJECT"
_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}


@dataclass(frozen=True)
class FaultInjection:
    """Send `signal` to this process when global rank `rank` begins `step` on restart `attempt`."""

    action: str
    rank: int
    step: int
    attempt: int = 0

    @classmethod
    def from_env(cls) -> FaultInjection | None:
        """The fault named by TRAINER_FAULT_INJECT, or None when it is unset or empty.

        Raises:
            ConfigError: naming the malformed spec and the valid form.
        """
        spec = os.environ.get(ENV_VAR, "").strip()
        if not spec:
            return None
        action, *fields = spec.split(":")
        try:
            values = {k: int(v) for k, v in (f.split("=", 1) for f in fields)}
        except ValueError:
            values = {}
        if action not in _SIGNALS or not {"rank", "step"} <= values.keys() <= {"rank", "step", "attempt"}:
            raise ConfigError(
                f"{ENV_VAR}={spec!r} is not valid; use ACTION:rank=R:step=S[:attempt=A] with ACTION one "
                f"of {sorted(_SIGNALS)} and integers R, S, A (e.g. kill:rank=1:step=4)"
            )
        return cls(action, values["rank"], values["step"], values.get("attempt", 0))

    def maybe_fire(self, step: int, rank: int) -> None:
        """Signal this process if it is the chosen rank, step and attempt; otherwise nothing."""
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if (step, rank, attempt) == (self.step, self.rank, self.attempt):
            os.kill(os.getpid(), _SIGNALS[self.action])
