"""Sentence pairs -> token ids (`__src__ x </s>` / `__tgt__ y </s>`), cached on disk.

`datasets.map` (batched, `preprocessing_num_workers` processes) writes memory-mapped Arrow
files keyed by the data, the tokenizer and the lengths; pairs over max_source_length /
max_target_length are skipped and counted (`SKIP_REASONS`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.config.data_args import DataArguments
from trainer.data.sources import RawDatasets, count_and_drop, source_name
from trainer.errors import DataError
from trainer.tokenizer.vocab import Tokenizer


def _tokenize_batch(
    batch: dict[str, list[Any]], tokenizer: Tokenizer, max_source_length: int, max_target_length: int
) -> dict[str, list[Any]]:
    eos = tokenizer.eos_id
    src = tokenizer.encode_batch(batch["source"])
    tgt = tokenizer.encode_batch(batch["target"])
    input_ids = [[tokenizer.lang_id(lang), *ids, eos] for lang, ids in zip(batch["src_lang"], src)]
    labels = [[tokenizer.lang_id(lang), *ids, eos] for lang, ids in zip(batch["tgt_lang"], tgt)]
    skip = [
        3 if len(s) > max_source_length else 4 if len(t) > max_target_length else 0
        for s, t in zip(input_ids, labels)
    ]
    return {
        "input_ids": input_ids,
        "labels": labels,
        "src_len": [len(s) for s in input_ids],
        "tgt_len": [len(t) for t in labels],
        "skip": skip,
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
                   cache_dir: Path | None = None) -> Any:  # fmt: skip
    """Tokenize pairs into model examples; over-long ones are skipped and counted.

    With `cache_dir` the examples are written there as Arrow files named by `_fingerprint` and
    memory-mapped (not held in memory); a later call with the same data, tokenizer and lengths
    loads them instead of tokenizing again. `data_args.preprocessing_num_workers` processes
    tokenize in parallel (the result is the same as with one).

    Args:
        pairs: `{src_lang, tgt_lang, source, target}` rows.
        tokenizer: the run's tokenizer.
        data_args: `max_source_length` / `max_target_length` (counting tag and eos).
        split: name under which skips are counted in `skipped`.
        skipped: `{split: {reason: count}}`, updated in place.
        keep_text: keep `source` / `target` strings (for evaluation references).
        cache_dir: the directory of the on-disk cache (None: no cache of ours).

    Returns:
        Rows with `input_ids` (`__src__ x </s>`), `labels` (`__tgt__ y </s>`), `src_len`,
        `tgt_len`, `src_lang`, `tgt_lang` (and the texts when `keep_text`).
    """
    max_src, max_tgt = data_args.max_source_length, data_args.max_target_length
    drop = [] if keep_text else ["source", "target"]
    fingerprint = _fingerprint(pairs, tokenizer, max_src, max_tgt) + ("t" if keep_text else "")
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
        fn_kwargs={"tokenizer": tokenizer, "max_source_length": max_src, "max_target_length": max_tgt},
        new_fingerprint=fingerprint,
        num_proc=workers if workers and workers > 1 and len(pairs) >= workers else None,
        desc=f"tokenize ({split})",
        **cache,
    )
    return count_and_drop(out, split, skipped)


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
    train = tokenize_pairs(raw.train, tokenizer, data_args, "train", skipped, cache_dir=cache_dir)
    if len(train) == 0:
        raise DataError(
            f"the training corpus ({source_name(data_args)}) is empty after filtering (skipped: {skipped['train']}); "
            f"max_source_length={data_args.max_source_length}, max_target_length={data_args.max_target_length}"
        )
    validation = {
        name: tokenize_pairs(ds, tokenizer, data_args, f"validation:{name}", skipped, True, cache_dir)
        for name, ds in raw.validation.items()
    }
    return TranslationData(train, validation, skipped)
