"""Following a run from its console (issue 30), on `python -m trainer.train` with configs/tiny.yaml.

Before: with `disable_tqdm` (set in configs/tiny.yaml) nothing per step reached stderr, an
evaluation's metrics appeared only in the final summary, evaluation ran without a bar, and no
curve was drawn. Now a SLURM-style log (bars off) shows a line per logged step and one per
evaluation, at the point it was computed, and the run leaves curves.png; with bars on, the
evaluation has its own bars (stderr).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.served import Served

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--builtin_size", "300", "--max_train_samples", "128", "--max_eval_samples", "8"]  # setup dominates


def _train(served: Served, out: Path, *extra: str, ranks: int = 1) -> subprocess.CompletedProcess[str]:
    env = served.environ()
    launch = served.cmd() if ranks == 1 else served.torchrun("--standalone", "--nproc-per-node", str(ranks))
    args = ["-m", "trainer.train", "--config", "configs/tiny.yaml", *SMALL, "--output_dir", str(out), *extra]
    proc = subprocess.run([*launch, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_log_without_bars_shows_steps_evaluations_and_curves(served: Served, tmp_path: Path) -> None:
    out = tmp_path / "run"
    err = _train(served, out, "--max_steps", "6", "--eval_strategy", "steps", "--eval_steps", "3").stderr
    lines = [ln.split("trainer.progress: ", 1)[1] for ln in err.splitlines() if "trainer.progress: " in ln]
    heads = [ln.split(" | ")[0] for ln in lines]
    # before training, each step, the evaluation at step 3 where it was computed, the final one
    assert heads == ["eval step 0", *(f"step {s}/6" for s in (1, 2, 3)), "eval step 3",
                     *(f"step {s}/6" for s in (4, 5, 6)), "eval step 6"], lines  # fmt: skip
    step3 = lines[3]
    assert re.fullmatch(
        r"step 3/6 \| loss \d+\.\d{4} \| lr \S+ \| grad_norm \S+ \| tokens/s \d+ \| step \d\.\d{3} s"
        r"( \| data \d\.\d{3} s)? \| eta \d:\d\d:\d\d", step3
    ), step3
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    eval3 = next(r for r in rows if r["step"] == 3 and "eval_loss" in r)
    assert lines[4].startswith(f"eval step 3 | loss {eval3['eval_loss']:.4f} | bleu {eval3['eval_bleu']:.2f}")
    assert "| bleu en-de " in lines[4] and "fr-en" in lines[4]
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "\r" not in err  # no bar anywhere in a log without bars


def test_evaluation_shows_bars_when_bars_are_on(served: Served, tmp_path: Path) -> None:
    """Was: the evaluation before training (and every other) ran without a bar or ETA."""
    err = _train(served, tmp_path / "run", "--max_steps", "2", "--disable_tqdm", "false").stderr
    for what in ("eval loss step 0", "eval translate step 0", "eval translate step 2", "train"):
        assert re.search(rf"{what}: +\d+%\|", err), (what, err[-3000:])
    # counted in sentences, 4 directions x 8 (the bar is drawn at 0 and at most every 0.1 s after)
    assert re.search(r"eval translate step 0: +0%\|\s+\| 0/32 \[", err), err[-3000:]
    assert "trainer.progress: step 1/2" not in err  # the bar shows the steps
    assert "trainer.progress: eval step 2 | loss" in err  # metrics are logged with bars on too


def test_the_logging_rank_speaks_where_it_is_not_rank_0(served: Served, tmp_path: Path) -> None:
    """pp=2: the loss and the metrics live on rank 1, whose root logger is at WARNING like every
    rank but 0's; its progress lines are still logged, once."""
    proc = _train(served, tmp_path / "run", "--max_steps", "2", "--do_eval", "false", "--pipeline_parallel_size", "2",
                  "--num_microbatches", "2", ranks=2)  # fmt: skip
    log = proc.stdout + proc.stderr
    steps = re.findall(r"trainer\.progress: (step \d/2) \| loss .* \| bubble \d+\.\d% \| eta", log)
    assert steps == ["step 1/2", "step 2/2"], log[-3000:]
    for png in ("curves.png", "timeline.png"):  # drawn on the logging rank (`plots`, the default)
        assert (tmp_path / "run" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
