"""The value checks every config section runs, and the choices they accept.

Each check raises `ConfigError` naming the field, its value and what is valid
(`learning_rate=-1.0 must be >= 0`).
"""

from __future__ import annotations

import math
from typing import Any

from trainer.errors import ConfigError

SCHEDULE_CHOICES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
REMAT_CHOICES = ("none", "full", "stage", "selective")
PARTITION_CHOICES = ("uniform", "parameters", "time", "memory")
SHARDING_CHOICES = ("none", "zero1", "fsdp")
REPORT_CHOICES = ("wandb", "tensorboard")  # report_to: any of these, "all" or "none"
NAN_POLICIES = ("stop", "skip")
SCHEDULER_CHOICES = ("linear", "cosine", "constant", "constant_with_warmup", "inverse_sqrt", "polynomial")
STRATEGY_CHOICES = ("no", "steps", "epoch")  # eval_strategy / save_strategy, as IntervalStrategy


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of {list(choices)}")


def check_range(
    section: Any,
    names: tuple[str, ...],
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
) -> None:
    """Raise ConfigError unless each named field of `section` lies in the range (None passes if `optional`).

    The message names the field, its value and the valid range, e.g.
    `learning_rate=-1.0 must be >= 0`, `adam_beta2=1.0 must be in [0, 1)`.
    """
    for name in names:
        value = getattr(section, name)
        if value is None and optional:
            continue
        ok = (
            value is not None
            and math.isfinite(value)
            and (value > low if low_open else value >= low)
            and (value < high if high_open else value <= high)
        )
        if not ok:
            if math.isinf(high):
                valid = f"{'>' if low_open else '>='} {low:g}"
            else:
                valid = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
            raise ConfigError(f"{name}={value!r} must be {valid}{' or null' if optional else ''}")


def resolve_report_to(value: Any) -> list[str]:
    """`report_to` as the HF Trainer takes it (a name, a list, "all", "none") -> backend names."""
    names = [value] if isinstance(value, str) else list(value or [])
    names = [n for v in names for n in str(v).replace(",", " ").split()]
    if names in ([], ["none"]):
        return []
    if names == ["all"]:
        return [n for n in REPORT_CHOICES if installed(n)]
    for name in names:
        if name not in REPORT_CHOICES:
            raise ConfigError(
                f"report_to={value!r}: {name!r} is not valid; choose from {list(REPORT_CHOICES)}, "
                f"'all' or 'none'"
            )
    return list(dict.fromkeys(names))


def installed(package: str) -> bool:
    """Whether `package` can be imported here (found on the path; a `sys.modules` entry of None, how
    Python marks a package blocked from import, counts as absent). Cheap: nothing is imported."""
    import importlib.util

    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken parent package; a module whose __spec__ is None
        return False


def check_trackers(report_to: list[str]) -> None:
    """Every `report_to` backend's package is installed: checked before anything is written (the
    tracker is built after config.yaml, the tokenizer and the data cache), on every rank alike.

    Raises:
        ConfigError: `report_to=['wandb']: the wandb package is not installed: pip install wandb (or
            pip install -e '.[wandb]'), or set report_to: none`.
    """
    for name in report_to:
        if not installed(name):
            raise ConfigError(
                f"report_to={report_to}: the {name} package is not installed: pip install {name} (or pip "
                f"install -e '.[{name}]'), or set report_to: none"
            )
