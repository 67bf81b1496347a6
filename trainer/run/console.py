"""What the logging rank prints while a run runs, built from metrics.jsonl rows.

    train_line   one line per logged step when the progress bar is off (`disable_tqdm`):
                 step/max_steps, then the row's known keys that are present (`TRAIN_KEYS`,
                 `data_time_s` included), then the ETA
    eval_line    one line per evaluation: loss, BLEU, chrF, chrF++ (where present), and
                 BLEU per direction in a short form (a list, or min/median/max for many)
    predict_line the same for do_predict's scores (predict_results.json), once at the end

    2025-01-01 12:00:00 INFO trainer.progress: step 40/200 | loss 6.1234 | lr 1.00e-03 | grad_norm 1.52 | tokens/s 10320 | step 0.214 s | data 0.002 s | eta 0:00:35
    2025-01-01 12:00:03 INFO trainer.progress: eval step 40 | loss 6.2010 | bleu 0.84 | chrF 12.31 | bleu en-de 0.5 de-en 1.2
    2025-01-01 12:09:41 INFO trainer.progress: predict (test) | loss 5.9001 | bleu 1.02 | chrF 13.05 | bleu en-de 0.7 de-en 1.3

Both are written from whatever keys a row has, so a key another part adds to the rows
(listed in `TRAIN_KEYS` or named `eval_*`) shows up without a change here, and a row
without it prints the rest.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from trainer.progress import format_duration


def _fixed(digits: int, suffix: str = "") -> Callable[[float], str]:
    return lambda v: f"{v:.{digits}f}{suffix}"


# (row key, label, format) in print order; a key absent from the row (or null) is left out.
TRAIN_KEYS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("loss", "loss", _fixed(4)),
    ("label_loss", "label_loss", _fixed(4)),  # distillation: its two terms
    ("kd_loss", "kd_loss", _fixed(4)),
    ("lr", "lr", lambda v: f"{v:.2e}"),
    ("grad_norm", "grad_norm", lambda v: f"{v:.3g}"),
    ("tokens_per_sec", "tokens/s", _fixed(0)),
    ("step_time_s", "step", _fixed(3, " s")),
    ("data_time_s", "data", _fixed(3, " s")),
    ("mfu", "mfu", lambda v: f"{100 * v:.1f}%"),
    ("bubble_fraction", "bubble", lambda v: f"{100 * v:.1f}%"),
    ("loss_scale", "loss_scale", lambda v: f"{v:g}"),
    ("skipped_steps", "skipped", lambda v: f"{v:g}"),
)
# Overall evaluation metrics, in print order (`eval_chrf++` is chrF with word n-grams).
EVAL_KEYS = (("eval_loss", "loss", 4), ("eval_bleu", "bleu", 2), ("eval_chrf", "chrF", 2),
             ("eval_chrf++", "chrF++", 2), ("eval_spbleu", "spBLEU", 2))  # fmt: skip
DIRECTIONS_LISTED = 8  # more directions than this: min / median / max


def _number(row: dict[str, Any], key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def is_train_row(row: dict[str, Any]) -> bool:
    """A training row (its `loss` is left out when every step of the window was skipped)."""
    return "loss" in row or "lr" in row


def is_eval_row(row: dict[str, Any]) -> bool:
    return any(k.startswith("eval_") for k in row)


def train_line(row: dict[str, Any], max_steps: int, eta_s: float | None) -> str:
    """`step s/max | loss ... | ... | eta h:mm:ss` from a training row (see the module docstring).

    `skipped_steps` is shown only when some step was skipped, `bubble_fraction` only for a
    pipeline (a row with `bubble_fraction_theory`).
    """
    parts = [f"step {row['step']}/{max_steps}"]
    for key, label, fmt in TRAIN_KEYS:
        v = _number(row, key)
        if v is None or (key == "skipped_steps" and v == 0):
            continue
        if key == "bubble_fraction" and "bubble_fraction_theory" not in row:
            continue
        parts.append(f"{label} {fmt(v)}")
    if eta_s is not None:
        parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)


def eval_line(row: dict[str, Any]) -> str:
    """`eval step s | loss ... | bleu ... | chrF ... | bleu <per direction>` from an evaluation row."""
    return score_line(f"eval step {row['step']}", row, "eval_")


def predict_line(result: dict[str, Any]) -> str:
    """`predict (test) | loss ... | bleu ... | bleu <per direction>` from do_predict's results
    (`predict_loss`, `predict_bleu`, `predict_bleu_en-de`, ... as predict_results.json holds them)."""
    return score_line("predict (test)", result, "predict_")


def score_line(head: str, row: dict[str, Any], prefix: str) -> str:
    """`head | loss ... | bleu ... | chrF ... | bleu <per direction>` from the `prefix` keys of `row`
    (`EVAL_KEYS` with `eval_` replaced by `prefix`)."""
    parts = [head]
    for key, label, digits in EVAL_KEYS:
        v = _number(row, prefix + key[len("eval_") :])
        if v is not None:
            parts.append(f"{label} {v:.{digits}f}")
    per_direction = {
        k[len(prefix) + len("bleu_") :]: v
        for k in row
        if k.startswith(f"{prefix}bleu_") and (v := _number(row, k)) is not None
    }
    if per_direction:
        parts.append(direction_summary("bleu", per_direction))
    return " | ".join(parts)


def direction_summary(label: str, scores: dict[str, float]) -> str:
    """`bleu en-de 1.2 de-en 3.4`, or for many directions `bleu min 0.1 (xx-yy) median 2.0 max 9.9
    (aa-bb) over 200 directions`."""
    if len(scores) <= DIRECTIONS_LISTED:
        return f"{label} " + " ".join(f"{d} {v:.1f}" for d, v in scores.items())
    lo, hi = min(scores, key=scores.__getitem__), max(scores, key=scores.__getitem__)
    med = statistics.median(scores.values())
    return (
        f"{label} min {scores[lo]:.1f} ({lo}) median {med:.1f} max {scores[hi]:.1f} ({hi}) "
        f"over {len(scores)} directions"
    )
