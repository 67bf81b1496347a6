"""Sentence pairs -> token ids (`__src__ x </s>` / `__tgt__ y </s>`), cached on disk.

`datasets.map` (batched, `preprocessing_num_workers` processes) writes memory-mapped Arrow
files keyed by the data, the tokenizer and the lengths. A side over max_source_length /
max_target_length is truncated, keeping its tag and eos, as `run_translation.py` does
(`truncated_source` / `truncated_target` count them); with `skip_long_examples` the pair is
skipped instead (`SKIP_REASONS`). `encode_pairs` is the rule, for streams too.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer.config.data_args import DataArguments
from trainer.data.sources import RawDatasets, column_array, count_and_drop, source_name
from trainer.errors import DataError
from trainer.tokenizer.vocab import Tokenizer

logger = logging.getLogger(__name__)


def encode_pairs(
    tokenizer: Tokenizer,
    src_langs: Sequence[str],
    tgt_langs: Sequence[str],
    sources: Sequence[str],
    targets: Sequence[str],
    max_source_length: int,
    max_target_length: int,
    skip_long: bool = False,
) -> tuple[list[list[int]], list[list[int]], list[int], list[int]]:
    """Pairs -> `__src__ x </s>` and `__tgt__ y </s>` ids: the one home of this rule (map-style and
    streaming data both call it).

    A side longer than its max length (tag and eos included) is truncated to it, keeping tag and
    eos (`run_translation.py`'s `truncation=True`), or, with `skip_long`, marked to be skipped.

    Returns:
        (input_ids, labels, skip code per pair: 0 keep, 3 source too long, 4 target too long (only
        with `skip_long`), truncation flags per pair: 1 source cut, 2 target cut, 3 both).
    """
    eos = tokenizer.eos_id
    src = tokenizer.encode_batch(sources)
    tgt = tokenizer.encode_batch(targets)
    tags = {lang: tokenizer.lang_id(lang) for lang in {*src_langs, *tgt_langs}}
    input_ids, labels, skip, cut = [], [], [], []
    for s_lang, t_lang, s, t in zip(src_langs, tgt_langs, src, tgt):
        s_long, t_long = len(s) + 2 > max_source_length, len(t) + 2 > max_target_length
        if skip_long:
            skip.append(3 if s_long else 4 if t_long else 0)
            cut.append(0)
        else:
            skip.append(0)
            cut.append(int(s_long) | 2 * int(t_long))
            s = s[: max(0, max_source_length - 2)] if s_long else s
            t = t[: max(0, max_target_length - 2)] if t_long else t
        input_ids.append([tags[s_lang], *s, eos])
        labels.append([tags[t_lang], *t, eos])
    return input_ids, labels, skip, cut


def _tokenize_batch(
    batch: dict[str, list[Any]],
    tokenizer: Tokenizer,
    max_source_length: int,
    max_target_length: int,
    skip_long: bool = False,
) -> dict[str, list[Any]]:
    input_ids, labels, skip, cut = encode_pairs(
        tokenizer, batch["src_lang"], batch["tgt_lang"], batch["source"], batch["target"],
        max_source_length, max_target_length, skip_long,
    )  # fmt: skip
    return {
        "input_ids": input_ids,
        "labels": labels,
        "src_len": [len(s) for s in input_ids],
        "tgt_len": [len(t) for t in labels],
        "skip": skip,
        "truncated": cut,
    }


def _fingerprint(ds: Any, tokenizer: Tokenizer, max_src: int, max_tgt: int) -> str:
    """A cache key for the tokenized dataset: the pairs' `datasets` fingerprint (a hash of their
    content and the transforms that made them, stable across processes), the lengths, and the
    tokenizer's identity (its model bytes, or its vocabulary; the object itself does not hash)."""
    h = hashlib.sha256(f"{ds._fingerprint}|{max_src}|{max_tgt}|{tokenizer.languages}".encode())
    hf = getattr(tokenizer, "hf", None)
    h.update(getattr(tokenizer, "model_proto", b"") or str(hf).encode())
    if hf is not None:  # str(hf) names the tokenizer, not its pieces
        h.update(json.dumps(sorted(hf.get_vocab().items())).encode())
    return h.hexdigest()[:32]


def tokenize_pairs(pairs: Any, tokenizer: Tokenizer, data_args: DataArguments, split: str,
                   skipped: dict[str, dict[str, int]], keep_text: bool = False,
                   cache_dir: Path | None = None, skip_long: bool | None = None) -> Any:  # fmt: skip
    """Tokenize pairs into model examples; over-long sides are truncated (or, with
    `skip_long_examples`, the pairs skipped) and counted (`encode_pairs`).

    With `cache_dir` the examples are written there as Arrow files named by `_fingerprint` and
    memory-mapped (not held in memory); a later call with the same data, tokenizer and lengths
    loads them instead of tokenizing again. `data_args.preprocessing_num_workers` processes
    tokenize in parallel (the result is the same as with one).

    Args:
        pairs: `{src_lang, tgt_lang, source, target}` rows.
        tokenizer: the run's tokenizer.
        data_args: `max_source_length` / `max_target_length` (counting tag and eos) and
            `skip_long_examples`.
        split: name under which skips and truncations are counted in `skipped`.
        skipped: `{split: {reason: count}}`, updated in place.
        keep_text: keep `source` / `target` strings (for evaluation references).
        cache_dir: the directory of the on-disk cache (None: no cache of ours).
        skip_long: overrides `data_args.skip_long_examples` (do_predict never skips a test line).

    Returns:
        Rows with `input_ids` (`__src__ x </s>`), `labels` (`__tgt__ y </s>`), `src_len`,
        `tgt_len`, `src_lang`, `tgt_lang` (and the texts when `keep_text`).
    """
    max_src, max_tgt = data_args.max_source_length, data_args.max_target_length
    skip_long = data_args.skip_long_examples if skip_long is None else skip_long
    drop = [] if keep_text else ["source", "target"]
    fingerprint = _fingerprint(pairs, tokenizer, max_src, max_tgt) + ("t" if keep_text else "")
    fingerprint += "s" if skip_long else ""
    workers = data_args.preprocessing_num_workers
    cache: dict[str, Any] = {}
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        cache = {
            "cache_file_name": str(cache_dir / f"tokenized-{fingerprint}.arrow"),
            "load_from_cache_file": True,
        }
    out = pairs.map(
        _tokenize_batch,
        batched=True,
        remove_columns=drop,
        fn_kwargs={
            "tokenizer": tokenizer,
            "max_source_length": max_src,
            "max_target_length": max_tgt,
            "skip_long": skip_long,
        },  # fmt: skip
        new_fingerprint=fingerprint,
        num_proc=workers if workers and workers > 1 and len(pairs) >= workers else None,
        desc=f"tokenize ({split})",
        **cache,
    )
    count_truncated(column_array(out, "truncated"), split, skipped)
    return count_and_drop(out.remove_columns("truncated"), split, skipped)


def count_truncated(flags: np.ndarray, split: str, skipped: dict[str, dict[str, int]]) -> None:
    """Add the truncated sources / targets (`encode_pairs`' flags) to `skipped[split]` (kept pairs)."""
    bucket = skipped.setdefault(split, {})
    for bit, key in ((1, "truncated_source"), (2, "truncated_target")):
        n = int(np.count_nonzero(flags & bit))
        bucket[key] = bucket.get(key, 0) + n
    if flags.any():
        logger.info("%s: truncated %s (kept; max_source_length / max_target_length)", split,
                    {k: bucket[k] for k in ("truncated_source", "truncated_target") if bucket[k]})  # fmt: skip


@dataclass
class TranslationData:
    """Tokenized training examples, validation per direction, and skip counts."""

    train: Any
    validation: dict[str, Any]
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)


def tokenize_datasets(
    raw: RawDatasets, tokenizer: Tokenizer, data_args: DataArguments, cache_dir: Path | None = None
) -> TranslationData:
    """Tokenize the output of `load_raw_datasets` (see `tokenize_pairs`; `cache_dir`: where the
    tokenized splits are cached and memory-mapped, None for no cache of ours).

    Raises:
        DataError: if no training example is left after filtering.
    """
    skipped = {k: dict(v) for k, v in raw.skipped.items()}
    train = None
    if raw.train is not None:  # streaming: the training pairs are tokenized on the fly (trainer.data.stream)
        train = tokenize_pairs(raw.train, tokenizer, data_args, "train", skipped, cache_dir=cache_dir)
    if train is not None and len(train) == 0:
        raise DataError(
            f"the training corpus ({source_name(data_args)}) is empty after filtering (skipped: {skipped['train']}); "
            f"max_source_length={data_args.max_source_length}, max_target_length={data_args.max_target_length}"
        )
    validation = {
        name: tokenize_pairs(ds, tokenizer, data_args, f"validation:{name}", skipped, True, cache_dir)
        for name, ds in raw.validation.items()
    }
    return TranslationData(train, validation, skipped)
