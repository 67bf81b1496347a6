"""The bad-input errors of `models/`: a model configuration or a checkpoint that cannot be used.

Pure (imports nothing), so `trainer.errors` can name them among the bad-input types the entry
points report in one line (exit 2) without importing torch.
"""


class ModelConfigError(ValueError):
    """An architecture value is invalid (`ModelConfig.validate`); the message names it and what is valid."""


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model (missing/unexpected keys or shapes)."""
