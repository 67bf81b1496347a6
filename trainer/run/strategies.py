"""When to evaluate and save, which checkpoint is best, when to stop early: the HF Trainer's rules.

Pure decisions (no torch.distributed); `trainer.train` calls them with the same inputs on every
rank, so every rank takes the same branch:

    training length   max_steps > 0 wins; max_steps = -1 trains ceil(num_train_epochs x
                      global batches per epoch) steps (HF precedence)
    eval / save       eval_strategy / save_strategy: "no", "steps" (every eval_steps /
                      save_steps; 0: only at the end) or "epoch" (every `steps_per_epoch` steps)
    best checkpoint   metric_for_best_model (default eval_loss), greater_is_better (default:
                      not a *loss metric); the best is updated at every evaluation, its
                      checkpoint recorded when a checkpoint is saved at that step
    early stopping    HF EarlyStoppingCallback: an evaluation that does not beat the best so
                      far by more than early_stopping_threshold counts against
                      early_stopping_patience; reaching it stops training

The state (`BestModel`) is saved in trainer_state.json and restored on resume.
"""

from __future__ import annotations

import math
import operator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from trainer.errors import ConfigError

if TYPE_CHECKING:
    from trainer.config.training_args import TrainingArguments


EVAL_METRICS = ("loss", "bleu", "chrf", "chrf++")  # every evaluation's, overall and per direction


def check_metric_name(metric: str | None, directions: list[str], spbleu: bool = False) -> None:
    """`metric_for_best_model` must be a key evaluation produces for this run's directions
    (`eval_spbleu` only where the run asks for spBLEU: `TrainingArguments.eval_spbleu`).

    Raises:
        ConfigError: naming the metric and the valid keys.
    """
    if metric is None:
        return
    valid = [
        f"eval_{m}{suffix}"
        for suffix in ["", *(f"_{d}" for d in directions)]
        for m in (*EVAL_METRICS, *(("spbleu",) if spbleu else ()))
    ]
    if metric not in valid:
        raise ConfigError(
            f"metric_for_best_model={metric!r} is not an evaluation metric of this run; choose from {valid}"
        )


def tracks_best(args: TrainingArguments) -> bool:
    """Whether evaluations feed the best-model record (and are broadcast from the logging rank)."""
    return bool(args.load_best_model_at_end or args.early_stopping_patience or args.metric_for_best_model)


def resolve_max_steps(args: TrainingArguments, steps_per_epoch: int) -> int:
    """The run's optimizer steps: max_steps when > 0, else ceil(num_train_epochs x steps_per_epoch).

    Args:
        args: max_steps and num_train_epochs.
        steps_per_epoch: global batches in one epoch of the sampler.

    Returns:
        At least 1.
    """
    if args.max_steps > 0:
        return args.max_steps
    return max(1, math.ceil(args.num_train_epochs * steps_per_epoch - 1e-9))


def interval_due(strategy: str, every: int, step: int, steps_per_epoch: int) -> bool:
    """Whether an evaluation / save falls on `step` under `strategy` ("no", "steps", "epoch")."""
    if strategy == "steps":
        return every > 0 and step % every == 0
    if strategy == "epoch":
        return step % steps_per_epoch == 0
    return False


@dataclass
class BestModel:
    """The best evaluation so far, its checkpoint, and the early-stopping count (trainer_state.json)."""

    metric: str = "eval_loss"
    greater_is_better: bool = False
    best_metric: float | None = None
    best_step: int | None = None
    best_model_checkpoint: str | None = None
    best_metrics: dict[str, Any] | None = None  # the best evaluation's row (the summary's "after")
    patience_counter: int = 0

    @classmethod
    def from_args(cls, args: TrainingArguments) -> BestModel:
        return cls(args.metric_for_best_model or "eval_loss", bool(args.greater_is_better))

    def _better(self, value: float, than: float) -> bool:
        return (operator.gt if self.greater_is_better else operator.lt)(value, than)

    def update(self, step: int, metrics: dict[str, Any], threshold: float = 0.0) -> bool:
        """Record an evaluation at `step`; returns whether it is the new best.

        The early-stopping count compares with the best *before* this evaluation, with the
        threshold; the best itself moves on any strict improvement (HF's order).

        Raises:
            ConfigError: the metric is not among the evaluation's keys.
        """
        if self.metric not in metrics:
            keys = sorted(k for k in metrics if k.startswith("eval_"))
            raise ConfigError(
                f"metric_for_best_model={self.metric!r} is not an evaluation metric; choose from {keys}"
            )
        value = float(metrics[self.metric])
        best = self.best_metric
        if best is None or (self._better(value, best) and abs(value - best) > threshold):
            self.patience_counter = 0
        else:
            self.patience_counter += 1
        if best is not None and not self._better(value, best):
            return False
        self.best_metric, self.best_step, self.best_metrics = value, step, dict(metrics)
        return True

    def saved(self, step: int, path: str) -> None:
        """A checkpoint of `step` was written at `path`: it becomes the best one if `step` is best."""
        if step == self.best_step:
            self.best_model_checkpoint = path

    def should_stop(self, patience: int | None) -> bool:
        """Early stopping: `patience` evaluations in a row without enough improvement."""
        return bool(patience) and self.patience_counter >= patience  # type: ignore[operator]

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's record (older checkpoints have none: nothing changes).

        The metric's name and direction are the session's config: a changed metric restarts the record.
        """
        saved = state.get("best_model") or {}
        if saved.get("metric") != self.metric or saved.get("greater_is_better") != self.greater_is_better:
            return
        for key in ("best_metric", "best_step", "best_model_checkpoint", "best_metrics", "patience_counter"):
            setattr(self, key, saved.get(key, getattr(self, key)))
