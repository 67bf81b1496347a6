"""`curves.png`: a run's curves against step, drawn from the rows of `metrics.jsonl`.

    +--------------------------+--------------------------+
    | loss: train, eval        | BLEU: mean, per direction |
    +--------------------------+--------------------------+
    | chrF++ (else chrF):      | learning rate             |
    | mean, per direction      |                           |
    +--------------------------+--------------------------+

The logging rank redraws it at every evaluation and at the end of the run
(`trainer.run.tracking.Tracker.draw_curves`), from the file, so a resumed run's picture
holds the earlier sessions' steps too. A panel whose keys no row has yet (no evaluation
so far) says so instead of a curve; one row draws as points. Drawn with matplotlib's
object API on the Agg canvas (no pyplot state): a few hundred milliseconds.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DIRECTIONS_IN_LEGEND = 8  # more per-direction curves than this: thin lines without a legend


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of metrics.jsonl (a torn or foreign line is skipped)."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            rows.append(row)
    return rows


def series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows where `key` is a number."""
    xs, ys = [], []
    for row in rows:
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(float(row["step"]))
            ys.append(float(v))
    return xs, ys


def per_direction_keys(rows: Sequence[dict[str, Any]], prefix: str) -> list[str]:
    """`prefix<direction>` keys present in any row, sorted (`eval_bleu_` -> `eval_bleu_en-de`, ...)."""
    return sorted({k for row in rows for k in row if k.startswith(prefix)})


def chrf_key(rows: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """(key, label): chrF++ where the rows have it, else chrF."""
    if any("eval_chrf++" in row for row in rows):
        return "eval_chrf++", "chrF++"
    return "eval_chrf", "chrF"


def render_curves(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> list[str]:
    """Draw the four panels of the module docstring into `path` (PNG).

    Args:
        rows: metrics.jsonl rows (training and evaluation rows, any keys missing).
        path: the PNG to write.
        title: above the panels.

    Returns:
        The panels' titles, in order.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7), dpi=90)
    axes = fig.subplots(2, 2, sharex=True).ravel()
    chrf, chrf_label = chrf_key(rows)
    titles = ["loss", "BLEU", chrf_label, "learning rate"]
    _lines(axes[0], rows, [("loss", "train"), ("eval_loss", "eval")])
    _score_panel(axes[1], rows, "eval_bleu")
    _score_panel(axes[2], rows, chrf)
    _lines(axes[3], rows, [("lr", "lr")], legend=False)
    axes[3].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    for ax, name in zip(axes, titles):
        ax.set_title(name, fontsize=10, y=1.0)  # a set height: placing it measured every tick label
        ax.grid(alpha=0.3)
    for ax in axes[2:]:
        ax.set_xlabel("step")
    if title:
        fig.suptitle(title, fontsize=10)
    # Fixed margins: tight_layout measures every label first and doubled the drawing time.
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.08, top=0.9, wspace=0.2, hspace=0.25)
    fig.savefig(path)
    return titles


def _lines(ax: Any, rows: Sequence[dict[str, Any]], keys: list[tuple[str, str]], legend: bool = True) -> None:
    drawn = 0
    for key, label in keys:
        xs, ys = series(rows, key)
        if xs:
            ax.plot(xs, ys, marker="o" if len(xs) < 20 else None, markersize=3, label=label)
            drawn += 1
    if not drawn:
        _empty(ax, "no " + " / ".join(k for k, _ in keys) + " yet")
    elif legend and drawn > 1:
        ax.legend(fontsize=7)


def _score_panel(ax: Any, rows: Sequence[dict[str, Any]], key: str) -> None:
    """The mean over directions (thick) and each direction (thin; in the legend when few)."""
    directions = per_direction_keys(rows, key + "_")
    for k in directions:
        xs, ys = series(rows, k)
        ax.plot(xs, ys, linewidth=0.8, alpha=0.7, marker="o", markersize=2, label=k[len(key) + 1 :])
    xs, ys = series(rows, key)
    if xs:
        ax.plot(xs, ys, color="black", linewidth=2, marker="o", markersize=4, label="mean")
    if not xs and not directions:
        _empty(ax, "no evaluation yet")
    elif len(directions) <= DIRECTIONS_IN_LEGEND:
        ax.legend(fontsize=7)
    else:
        ax.text(0.01, 0.98, f"{len(directions)} directions (thin)", transform=ax.transAxes,
                fontsize=7, va="top")  # fmt: skip


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="grey")
