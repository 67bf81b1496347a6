"""A run's data set-up: the tokenizer, the evaluation data and the sampler of training batches.

    setup_data      map-style (default): the corpus is read and tokenized before step 1, rank 0
                    writing the cache the others load (`tokenize_shared`);
                    streaming (`streaming: true`): every rank opens the shards itself (O(shards)),
                    the tokenizer is trained on a bounded sample (`trainer.data.streaming`), and the
                    training pairs are tokenized on the fly: no rank waits on work that grows with
                    the corpus
    build_sampler   -> `GlobalBatchSampler` (map-style) or `StreamSampler` (streaming), one interface

The only rank-0 phase of a streaming run is the tokenizer, whose sample is bounded by
`spm_input_sentence_size` whatever the corpus size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.checkpoint.resume import ResumePoint, adopt_tokenizer
from trainer.config.pretrained import check_tokenizer_fits, pretrained_sources
from trainer.config.schema import JobConfig
from trainer.data.batching import BatchLayout, GlobalBatchSampler
from trainer.data.sampling import DirectionSampling
from trainer.data.sources import (
    RawDatasets,
    load_raw_datasets,
    load_test_pairs,
    run_languages,
    training_texts,
)
from trainer.data.stream import StreamSpec
from trainer.data.tokenization import TranslationData, tokenize_datasets
from trainer.errors import DataError
from trainer.run.distill import student_tokenizer_dir
from trainer.run.preflight import evaluations_asked, no_eval_data
from trainer.run.rank0 import on_rank0
from trainer.tokenizer.vocab import Tokenizer, load_or_train_tokenizer

logger = logging.getLogger("trainer")


@dataclass
class RunData:
    """What `setup_data` builds: the tokenizer, the tokenized data (map-style: train and validation;
    streaming: validation only), do_predict's test pairs, and the stream's definition."""

    tok: Tokenizer
    data: TranslationData
    test_raw: RawDatasets | None
    stream: tuple[StreamSpec, dict[str, float]] | None = None  # (spec, expected shares) when streaming


def setup_data(cfg: JobConfig, out: Path, rank: int, resume: ResumePoint | None) -> RunData:
    """The tokenizer and data of a run (collective: the tokenizer's and tokenization's broadcasts)."""
    seed, d = cfg.training.seed, cfg.data
    test_raw = None
    if d.streaming:
        from trainer.data.streaming import open_corpus, sample_texts, stream_spec

        spec, expected = stream_spec(open_corpus(d), d, seed)
        raw = load_raw_datasets(d, seed, bool(evaluations_asked(cfg.training)))  # validation only
        require_eval_data(cfg, raw)
        test_raw = load_test_pairs(d, seed) if cfg.training.do_predict else None
        tok = setup_tokenizer(
            cfg, lambda: sample_texts(spec, expected, d.spm_input_sentence_size, seed), out, rank, resume
        )
        return RunData(tok, tokenize_datasets(raw, tok, d), test_raw, (spec, expected))
    raw = load_raw_datasets(d, seed, bool(evaluations_asked(cfg.training)))  # no eval: no validation pairs
    require_eval_data(cfg, raw)
    test_raw = load_test_pairs(d, seed) if cfg.training.do_predict else None
    tok = setup_tokenizer(cfg, lambda: training_texts(raw.train), out, rank, resume)
    return RunData(tok, tokenize_shared(cfg, raw, tok, out, rank), test_raw)


def require_eval_data(cfg: JobConfig, raw: RawDatasets) -> None:
    """A dataset_name without a validation (or dev, or test) split cannot serve the evaluations the
    config asks for (a train_file without validation_file is refused before: `check_eval_data`).
    Every rank reads the same splits, so every rank raises alike, before the tokenizer is written.

    Raises:
        DataError: evaluations asked and no validation pairs.
    """
    asked = evaluations_asked(cfg.training)
    if asked and not raw.validation:
        source = f"dataset_name={cfg.data.dataset_name!r} has no validation, dev or test split"
        raise DataError(no_eval_data(asked, source))


def setup_tokenizer(
    cfg: JobConfig, texts: Callable[[], Iterable[str]], out: Path, rank: int, resume: ResumePoint | None
) -> Tokenizer:
    """Rank 0 builds the tokenizer (`run_tokenizer` on `texts()`) and saves it; the others load it.

    On resume every rank reads the checkpoint's run's tokenizer back: never retrained or rewritten.
    """
    tok_dir = out / "tokenizer"
    languages = run_languages(cfg.data)
    if resume is not None:
        return Tokenizer.load(adopt_tokenizer(resume, out, rank), languages)

    def build() -> Tokenizer:
        # `texts()` runs only if a tokenizer is trained: a given one (tokenizer_name, a pretrained
        # model's, a distillation teacher's) needs no sample of the corpus (a stream's costs a read)
        tok = run_tokenizer(cfg, (text for make in [texts] for text in make()))
        tok.save(tok_dir)
        return tok

    tok = on_rank0(rank, "build the tokenizer", build)
    return tok if tok is not None else Tokenizer.load(tok_dir, languages)


def run_tokenizer(cfg: JobConfig, texts: Iterable[str]) -> Tokenizer:
    """A fresh run's tokenizer: the pretrained one (`tokenizer_name`, else the model directory's own,
    `trainer.config.pretrained`), checked against the pretrained model's embedding, else a
    distillation teacher's (`trainer.run.distill`), or SentencePiece trained on `texts` for a new model.

    Raises:
        ConfigError: a model directory without tokenizer files and no tokenizer_name.
        TokenizerError, CheckpointMismatchError: the tokenizer's ids do not fit the model's embedding.
    """
    m, d = cfg.model, cfg.data
    sources = pretrained_sources(m.model_name_or_path, m.tokenizer_name)
    tok_dir = student_tokenizer_dir(cfg)  # the pretrained one, else a distillation teacher's
    languages = run_languages(d)
    tok = load_or_train_tokenizer(
        None if tok_dir is None else str(tok_dir), languages, texts, m.vocab_size,
        d.spm_model_type, d.spm_character_coverage, d.spm_input_sentence_size, cfg.training.seed,
    )  # fmt: skip
    if sources.model is not None:
        check_tokenizer_fits(tok, sources.model, m.tokenizer_name or str(m.model_name_or_path), languages)
    return tok


def tokenize_shared(cfg: JobConfig, raw: Any, tok: Tokenizer, out: Path, rank: int) -> TranslationData:
    """Rank 0 tokenizes into the on-disk cache (`cache_dir`, default <output_dir>/data_cache); the
    others wait, then load it (a cache hit; on a node without the shared disk they build their own).

    Rank 0's failure reaches every rank (`on_rank0`).
    """
    cache = Path(cfg.data.cache_dir) if cfg.data.cache_dir else out / "data_cache"
    hint = (
        f"; its time grows with the corpus ({len(raw.train):,} pairs): raise dist_timeout_s="
        f"{cfg.parallel.dist_timeout_s}, or set streaming: true (no rank waits on the corpus)"
    )
    data = on_rank0(rank, "tokenize the data", lambda: tokenize_datasets(raw, tok, cfg.data, cache), hint)
    return data if data is not None else tokenize_datasets(raw, tok, cfg.data, cache)


def build_sampler(cfg: JobConfig, dp: int, run_data: RunData, log: bool = True) -> Any:
    """The seeded, resumable sampler of global batches, cut into m * g * dp slots: a
    `GlobalBatchSampler` over the tokenized corpus, or a `StreamSampler` over its shards."""
    d, tok = cfg.data, run_data.tok
    layout = BatchLayout(
        cfg.training.per_device_train_batch_size,
        cfg.parallel.num_microbatches,
        cfg.training.gradient_accumulation_steps,
        dp,
        d.max_tokens_per_microbatch,
        d.pad_to_multiple_of,
    )
    weights = d.direction_weights(d.sampling_weights)
    sampling = DirectionSampling(d.sampling_temperature, weights)
    if run_data.stream is not None:
        from trainer.data.streaming import build_stream_sampler

        spec, expected = run_data.stream
        sampler: Any = build_stream_sampler(spec, expected, d, layout, tok, log_notes=log)
    else:
        special = tok.special_ids()
        sampler = GlobalBatchSampler(
            run_data.data.train,
            layout,
            cfg.training.seed,
            tok.pad_id,
            special["decoder_start_token_id"],
            sampling,
        )
    expected_shares = {name: share["expected"] for name, share in sampler.shares().items()}
    logger.info(
        "direction sampling T=%g weights %s: expected shares %s",
        sampling.temperature,
        weights,
        expected_shares,
    )
    return sampler
