"""The evaluation table of `python -m trainer.evaluate`: per direction, averaged by group, as JSON and markdown.

    direction   sentences  bleu  chrf  chrf++  [spbleu]      one row per direction
    into English / out of English / non-English / all       macro averages over those directions

"into English" averages the directions whose target is English, "out of English" those whose
source is, "non-English" those with English on neither side (FLORES-200 reports the same
groups: eng_Latn-xx, xx-eng_Latn, xx-yy), "all" every direction. A group with no direction is
left out. The averages are means over directions of the corpus scores (as NLLB's tables).

Pure: the files are written by the caller's rank only (`write_report`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

GROUPS = ("into English", "out of English", "non-English", "all")
HEADERS = {"bleu": "BLEU", "chrf": "chrF", "chrf++": "chrF++", "spbleu": "spBLEU"}
_ENGLISH = {"en", "eng"}


def is_english(lang: str) -> bool:
    """`en`, `eng_Latn`, `en-US`, `eng`: English in M2M100's, NLLB's and the usual codes."""
    return lang.split("_")[0].split("-")[0].lower() in _ENGLISH


def groups_of(src: str, tgt: str) -> list[str]:
    """The average groups a direction counts in."""
    if is_english(tgt) and not is_english(src):
        group = "into English"
    elif is_english(src) and not is_english(tgt):
        group = "out of English"
    elif not is_english(src) and not is_english(tgt):
        group = "non-English"
    else:
        return ["all"]  # English to English (e.g. en to eng_Latn): in no group of its own
    return [group, "all"]


def averages(rows: Mapping[str, Mapping[str, float]], metrics: Sequence[str]) -> dict[str, dict[str, float]]:
    """Macro averages of `metrics` per group.

    Args:
        rows: direction `src-tgt` -> its scores (one value per metric).
        metrics: the metrics to average.

    Returns:
        group -> {"directions": count, metric: mean, ...}, groups in `GROUPS` order, empty ones left out.
    """
    members: dict[str, list[Mapping[str, float]]] = {g: [] for g in GROUPS}
    for direction, scores in rows.items():
        src, tgt = direction.split("-", 1)
        for group in groups_of(src, tgt):
            members[group].append(scores)
    return {
        group: {"directions": len(got), **{m: sum(s[m] for s in got) / len(got) for m in metrics}}
        for group, got in members.items()
        if got
    }


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---", *["---:"] * (len(header) - 1)]) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def to_markdown(result: Mapping[str, Any]) -> str:
    """The markdown of `result` (`build_result`'s): the per-direction table, then the averages."""
    metrics = list(result["metrics"])
    heads = [HEADERS.get(m, m) for m in metrics]
    rows = [
        [d, str(s["sentences"]), *(f"{s[m]:.2f}" for m in metrics)] for d, s in result["directions"].items()
    ]
    avgs = [
        [g, str(a["directions"]), *(f"{a[m]:.2f}" for m in metrics)] for g, a in result["averages"].items()
    ]
    lines = _table(["direction", "sentences", *heads], rows)
    lines += ["", *_table(["average", "directions", *heads], avgs)]
    return "\n".join(lines) + "\n"


def build_result(
    rows: Mapping[str, Mapping[str, float]], metrics: Sequence[str], settings: Mapping[str, Any]
) -> dict[str, Any]:
    """The JSON content: the settings, the metrics, the rows, the averages.

    Args:
        rows: direction -> {"sentences": n, metric: score, ...}.
        metrics: the metrics scored, in table order.
        settings: what was evaluated and how (model, data, decoding, mesh).
    """
    return {
        **settings,
        "metrics": list(metrics),
        "directions": {d: dict(s) for d, s in rows.items()},
        "averages": averages(rows, metrics),
    }


def write_report(
    output_dir: str | Path, result: Mapping[str, Any], hypotheses: Mapping[str, Sequence[str]]
) -> None:
    """output_dir/scores.json, scores.md and predictions_<src>-<tgt>.txt, each written whole
    (a temporary file renamed), so an interrupted run leaves no half-written file."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "scores.json": json.dumps(result, indent=1, ensure_ascii=False) + "\n",
        "scores.md": to_markdown(result),
    }
    for direction, lines in hypotheses.items():
        files[f"predictions_{direction}.txt"] = "".join(h.replace("\n", " ") + "\n" for h in lines)
    for name, text in files.items():
        tmp = out / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out / name)
