"""The error types shared across the trainer's packages (at the bottom: imports nothing of the project).

Each is a `ValueError` whose message names the bad value and what is valid; the entry points
turn them into one line on stderr and exit status 2.
"""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names it and what is valid."""


class DataError(ValueError):
    """Bad data or data configuration; the message names the bad value and what is valid."""


class TokenizerError(ValueError):
    """A tokenizer cannot be built or loaded as asked; the message names the bad value."""
