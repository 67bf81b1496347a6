"""Which directions a model was trained on: recorded by `trainer.export`, checked by translate and evaluate.

    run_directions        a checkpoint's: its run's `language_pairs` (or source_lang-target_lang)
                          from trainer_state.json's "config", with those of the model it
                          fine-tuned where that one records its own; None when that is unknown (a
                          fine-tune of a model without a record, e.g. stock M2M100 / NLLB, which
                          knows languages the run never saw; a checkpoint without its config)
    model_directions      the record of `--model`: an export's config.json "trained_language_pairs"
                          (what the export writes from `run_directions`) or a checkpoint's
    untrained_warning     one line naming the directions asked for that the model never trained

A model trained on en-de and de-en has tags (or, exported in the stock M2M100 vocabulary, all
100 codes) for more than it learned: asked for en-it it decodes something. The record lets
`trainer.translate` and `trainer.evaluate` say so in one line instead of scoring garbage in
silence; a directory without a record (a stock or published model) gets no warning.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RECORD_KEY = "trained_language_pairs"  # config.json: ["en-de", "de-en", ...]
SHOWN = 12  # directions named in a warning; the rest are counted

Direction = tuple[str, str]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _parse(pairs: Any) -> list[Direction] | None:
    """["en-de", ...] -> [("en", "de"), ...]; None if it is not such a list."""
    if not isinstance(pairs, list) or not all(isinstance(p, str) and p.count("-") == 1 for p in pairs):
        return None
    return [tuple(p.split("-")) for p in pairs]  # type: ignore[misc]


def config_directions(config: dict[str, Any]) -> list[Direction] | None:
    """The directions of a run's resolved config (flat: `language_pairs`, `source_lang`, `target_lang`)."""
    pairs = config.get("language_pairs")
    if pairs:
        return _parse(pairs)
    src, tgt = config.get("source_lang"), config.get("target_lang")
    return [(src, tgt)] if isinstance(src, str) and isinstance(tgt, str) and src and tgt else None


def recorded_directions(model_dir: str | Path) -> list[Direction] | None:
    """An HF directory's record (config.json `RECORD_KEY`); None without one."""
    config = _read_json(Path(model_dir) / "config.json")
    return None if config is None else _parse(config.get(RECORD_KEY))


def run_directions(checkpoint: str | Path) -> list[Direction] | None:
    """The directions the model of `checkpoint` was trained on (module docstring), in run order."""
    state = _read_json(Path(checkpoint) / "trainer_state.json")
    config = state.get("config") if state is not None else None
    if not isinstance(config, dict):
        return None
    own = config_directions(config)
    base = config.get("model_name_or_path")
    if own is None or not base:
        return own
    inherited = recorded_directions(base) if Path(base).is_dir() else None  # a hub name: unknown
    return None if inherited is None else list(dict.fromkeys([*inherited, *own]))


def model_directions(model: str | Path) -> list[Direction] | None:
    """The record of `--model`: a training checkpoint's (`run_directions`) or an HF directory's."""
    path = Path(model)
    return run_directions(path) if (path / "trainer_state.json").is_file() else recorded_directions(path)


def _named(directions: Sequence[Direction]) -> str:
    names = [f"{s}-{t}" for s, t in directions]
    more = f" ... ({len(names)} in all)" if len(names) > SHOWN else ""
    return " ".join(names[:SHOWN]) + more


def untrained_warning(asked: Sequence[Direction], trained: Sequence[Direction] | None) -> str | None:
    """One line naming the directions of `asked` not in `trained`, and the languages it never
    saw at all; None if every one was trained, or nothing is recorded (`trained` None)."""
    if trained is None:
        return None
    known = set(trained)
    missing = [d for d in asked if d not in known]
    if not missing:
        return None
    seen = {lang for d in trained for lang in d}
    unseen = sorted({lang for d in missing for lang in d} - seen)
    never = f"; it never saw {', '.join(unseen)} at all" if unseen else ""
    return (
        f"warning: the model was never trained on {_named(missing)}{never} (trained: {_named(trained)}); "
        "expect poor translations there"
    )
