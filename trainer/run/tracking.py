"""Metrics from one rank: `metrics.jsonl`, Weights & Biases, TensorBoard, and the progress bar.

Only the logging rank (the last pipeline stage's dp=0/tp=0 rank, where the loss
lives) constructs a `Tracker` with `enabled=True`; every other rank gets a
disabled one whose methods do nothing, so call sites need no rank checks.

`metrics.jsonl` keeps the flat names of the contract (`loss`, `eval_bleu_en-de`);
W&B and TensorBoard get them grouped the way the Hugging Face Trainer reports them:
`train/loss`, `eval/bleu_en-de`, and an NLLB-MoE run's expert load `moe/enc3_tokens_max`
(see `dashboard_key`).

`metrics.jsonl` holds each step once: on opening, the logging rank cuts the rows of
steps after the one this session starts from (a resumed run repeats them), atomically.

The console gets each row too (`trainer.run.console`): a line per training row when the
progress bar is off (`disable_tqdm`: a SLURM log shows every logged step), a line per
evaluation row always. `draw_curves` redraws `curves.png` from metrics.jsonl
(`trainer.run.curves`) and sends it to W&B: at an evaluation once `CURVES_EVERY_S` have passed
since the last drawing (or the start), and always at the end or a stop.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from trainer.progress import PROGRESS_LOGGER
from trainer.run.console import eval_line, is_eval_row, is_train_row, train_line

logger = logging.getLogger(__name__)
console = logging.getLogger(PROGRESS_LOGGER)

BACKENDS = ("wandb", "tensorboard")
CURVES_EVERY_S = 60.0  # curves.png at an evaluation at most this often (always at the end)


def dashboard_key(key: str) -> str:
    """A metrics.jsonl name -> its grouped dashboard name: `eval_x` -> `eval/x`, NLLB-MoE's expert
    load `moe_x` -> `moe/x`, else `train/x`."""
    if key.startswith("eval_"):
        return "eval/" + key[len("eval_") :]
    if key.startswith("moe_"):
        return "moe/" + key[len("moe_") :]
    return "train/" + key


class Tracker:
    """Writes metric rows to `metrics.jsonl` and to the `report_to` backends (W&B, TensorBoard).

    Args:
        report_to: backend names from `BACKENDS` (a single name is accepted too); "none" or
            an empty list for metrics.jsonl only.
    """

    def __init__(
        self,
        output_dir: str,
        enabled: bool,
        report_to: str | Sequence[str] = "none",
        run_name: str | None = None,
        project: str = "polyglot3d",
        config: dict[str, Any] | None = None,
        max_steps: int = 0,
        disable_tqdm: bool = False,
        initial_step: int = 0,
        plots: bool = True,
    ) -> None:
        self.enabled, self.plots = enabled, plots
        self.history: list[dict[str, Any]] = []
        self.path = Path(output_dir) / "metrics.jsonl"
        self.wandb: Any = None
        self.tensorboard: Any = None
        self.bar: Any = None
        self.max_steps, self.step = max_steps, initial_step  # `step`: advanced by `advance`
        self._clock: tuple[float, int] | None = None  # (time, step) at the first advance: the ETA's origin
        self._drawn_rows = -1  # len(history) at the last draw_curves: no new row, no redraw
        self._drawn_at = time.monotonic()  # the last drawing (or the start): see CURVES_EVERY_S
        if not enabled:
            return
        cut_metrics(self.path, initial_step)
        backends = [report_to] if isinstance(report_to, str) else list(report_to)
        if "wandb" in backends:
            self.wandb = _init_wandb(output_dir, run_name, project, config or {})
        if "tensorboard" in backends:
            self.tensorboard = _init_tensorboard(output_dir, config or {}, initial_step)
        if not disable_tqdm:
            self.bar = tqdm(total=max_steps, initial=initial_step, desc="train", dynamic_ncols=True)
            if self.bar.disable:  # TQDM_DISABLE=1: lines instead
                self.bar = None

    def log(self, row: dict[str, Any]) -> None:
        """Append one row (must contain `step`)."""
        if not self.enabled:
            return
        self.history.append(dict(row))
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        step = int(row["step"])
        scalars = {dashboard_key(k): v for k, v in row.items() if k != "step" and _is_number(v)}
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.bar is not None and "loss" in row:
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row.get('lr', 0):.2e}")
        if self.bar is None and is_train_row(row):
            console.info("%s", train_line(row, self.max_steps, self.eta_s(row)))
        if is_eval_row(row):
            self.say(eval_line(row))

    def say(self, line: str) -> None:
        """A console line that leaves the progress bar intact (tqdm.write under the bar)."""
        if self.bar is None:
            console.info("%s", line)
            return
        with logging_redirect_tqdm():
            console.info("%s", line)

    def advance(self, n: int = 1) -> None:
        """`n` more steps done (the bar, and the clock of the per-step lines' ETA)."""
        self.step += n
        if self._clock is None:
            self._clock = (time.perf_counter(), self.step)
        if self.bar is not None:
            self.bar.update(n)

    def eta_s(self, row: dict[str, Any]) -> float | None:
        """Seconds to max_steps at the wall-clock rate since this session's first step (evaluations
        and checkpoints included, as tqdm's ETA); at the first step, from its `step_time_s`."""
        left = self.max_steps - int(row["step"])
        if self._clock is not None and self.step > self._clock[1]:
            t0, s0 = self._clock
            return (time.perf_counter() - t0) / (self.step - s0) * left
        step_time = row.get("step_time_s")
        return step_time * left if isinstance(step_time, (int, float)) else None

    def log_samples(self, step: int, samples: list[tuple[str, str, str, str]]) -> None:
        """A W&B table of (direction, source, reference, hypothesis)."""
        if self.wandb is None or not samples:
            return
        import wandb

        table = wandb.Table(
            columns=["direction", "source", "reference", "hypothesis"], data=[list(s) for s in samples]
        )
        self.wandb.log({"eval/samples": table}, step=step)

    def log_image(self, step: int, key: str, path: str) -> None:
        if self.wandb is None or not Path(path).is_file():
            return
        import wandb

        self.wandb.log({dashboard_key(key): wandb.Image(path)}, step=step)

    def draw_curves(self, step: int, final: bool = False) -> str | None:
        """Redraw `curves.png` beside metrics.jsonl from its rows (`trainer.run.curves`) and send it
        to W&B as `train/curves`; returns its path, or None when not drawn: `plots` off, no new row, or (unless
        `final`: the end of the run, a stop) less than `CURVES_EVERY_S` since the last drawing. A
        drawing failure is a warning, never the run's end."""
        if not (self.enabled and self.plots) or self._drawn_rows == len(self.history):
            return None
        if not final and time.monotonic() - self._drawn_at < CURVES_EVERY_S:
            return None  # a drawing costs ~0.4 s of CPU: not at each of a short run's evaluations
        self._drawn_rows, self._drawn_at = len(self.history), time.monotonic()
        from trainer.run.curves import read_rows, render_curves

        png = self.path.with_name("curves.png")
        try:
            render_curves(read_rows(self.path), png, f"{self.path.parent.name}: step {step}")
        except Exception as e:  # matplotlib or a font cache: the run goes on without its picture
            logger.warning("curves.png not drawn: %s: %s", type(e).__name__, e)
            return None
        self.log_image(step, "curves", str(png))
        return str(png)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _init_tensorboard(output_dir: str, config: dict[str, Any], initial_step: int = 0) -> Any:
    """A SummaryWriter on `output_dir/runs` (`tensorboard --logdir output_dir/runs`); resumed at
    `initial_step`, TensorBoard hides the earlier session's events after it (`purge_step`)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise RuntimeError(
            "report_to includes 'tensorboard', which needs the tensorboard package: "
            "pip install tensorboard (or drop it from report_to)"
        ) from e
    purge = initial_step + 1 if initial_step > 0 else None
    writer = SummaryWriter(log_dir=str(Path(output_dir) / "runs"), purge_step=purge)
    writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in sorted(config.items())))
    return writer


def cut_metrics(path: Path, step: int) -> int:
    """Keep only the rows of steps up to `step` in `path` (none when `step` is 0: a run that
    starts from scratch logs its step 0 again); a torn last line is dropped too.

    The file is rewritten through a temporary file and a rename, so a crash leaves the old
    or the new file, never a half-written one.

    Args:
        path: metrics.jsonl.
        step: the step the session resumes from (rows at this step, train and eval, were
            logged before its checkpoint was saved and are kept).

    Returns:
        The number of rows dropped.
    """
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    keep = [line for line in lines if step > 0 and 0 <= _row_step(line) <= step]
    if len(keep) == len(lines):
        return 0
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    logger.info("%s: dropped %d row(s) after step %d (resumed there)", path, len(lines) - len(keep), step)
    return len(lines) - len(keep)


def _row_step(line: str) -> int:
    """The row's step, or -1 for a line that is not a complete row."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1


def _init_wandb(output_dir: str, run_name: str | None, project: str, config: dict[str, Any]) -> Any:
    try:
        import wandb
    except ImportError as e:
        raise RuntimeError(
            "report_to='wandb' needs the wandb package: pip install wandb (or set report_to: none)"
        ) from e
    mode = os.environ.get("WANDB_MODE")
    if mode is None and not (os.environ.get("WANDB_API_KEY") or _has_netrc_key()):
        mode = "offline"
        print(
            f"[tracking] no WANDB_API_KEY: W&B runs offline; sync later with `wandb sync {output_dir}/wandb`"
        )
    return wandb.init(project=project, name=run_name, dir=output_dir, config=config, mode=mode)  # type: ignore[arg-type]


def _has_netrc_key() -> bool:
    netrc = Path.home() / ".netrc"
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")
