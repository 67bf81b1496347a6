"""Metrics from one rank: `metrics.jsonl`, Weights & Biases, and the progress bar.

Only the logging rank (the last pipeline stage's dp=0/tp=0 rank, where the loss
lives) constructs a `Tracker` with `enabled=True`; every other rank gets a
disabled one whose methods do nothing, so call sites need no rank checks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm


class Tracker:
    """Writes metric rows to `metrics.jsonl` and, with `report_to: wandb`, to W&B."""

    def __init__(
        self,
        output_dir: str,
        enabled: bool,
        report_to: str = "none",
        run_name: str | None = None,
        project: str = "polyglot3d",
        config: dict[str, Any] | None = None,
        max_steps: int = 0,
        disable_tqdm: bool = False,
        initial_step: int = 0,
    ) -> None:
        self.enabled = enabled
        self.history: list[dict[str, Any]] = []
        self.path = Path(output_dir) / "metrics.jsonl"
        self.wandb: Any = None
        self.bar: Any = None
        if not enabled:
            return
        if report_to == "wandb":
            self.wandb = _init_wandb(output_dir, run_name, project, config or {})
        if not disable_tqdm:
            self.bar = tqdm(total=max_steps, initial=initial_step, desc="train", dynamic_ncols=True)

    def log(self, row: dict[str, Any]) -> None:
        """Append one row (must contain `step`)."""
        if not self.enabled:
            return
        self.history.append(dict(row))
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))
        if self.bar is not None and "loss" in row:
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row.get('lr', 0):.2e}")

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def log_samples(self, step: int, samples: list[tuple[str, str, str, str]]) -> None:
        """A W&B table of (direction, source, reference, hypothesis)."""
        if self.wandb is None or not samples:
            return
        import wandb

        table = wandb.Table(
            columns=["direction", "source", "reference", "hypothesis"], data=[list(s) for s in samples]
        )
        self.wandb.log({"samples": table}, step=step)

    def log_image(self, step: int, key: str, path: str) -> None:
        if self.wandb is None or not Path(path).is_file():
            return
        import wandb

        self.wandb.log({key: wandb.Image(path)}, step=step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


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
