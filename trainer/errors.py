"""The error types of bad input, and the one list of them the entry points map to exit status 2.

Bad input (a config value, a data file, a tokenizer, a checkpoint, parallel sizes that cannot
work) is reported in one line naming the bad value and what is valid, exit status 2; any other
exception, a `ValueError` from an internal check included, keeps its traceback (exit 1).
Validation code raises one of `BAD_INPUT`: the trainer's `BadInputError` subclasses below (or
their own, e.g. `OutputDirBusyError`), `models/`' and `parallel/`' own bad-input types (which
cannot import the trainer's), or `FileNotFoundError` for a path given that does not exist.

At the bottom of the trainer: imports only those two pure modules.
"""

from models.errors import CheckpointMismatchError, ModelConfigError
from parallel.errors import ParallelConfigError


class BadInputError(ValueError):
    """Input the run cannot use; the message names the bad value and what is valid (exit status 2)."""


class ConfigError(BadInputError):
    """A configuration value is invalid; the message names it and what is valid."""


class DataError(BadInputError):
    """Bad data or data configuration; the message names the bad value and what is valid."""


class TokenizerError(BadInputError):
    """A tokenizer cannot be built or loaded as asked; the message names the bad value."""


# What the entry points report as bad input: one line, exit status 2 (trainer/train.py, trainer/plan.py).
BAD_INPUT: tuple[type[Exception], ...] = (
    BadInputError,
    ModelConfigError,
    CheckpointMismatchError,
    ParallelConfigError,
    FileNotFoundError,
)
