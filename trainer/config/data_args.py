"""The data section of the job config: sources, directions, lengths, tokenizer training, sampling."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainer.config.checks import check_choice, check_range
from trainer.errors import ConfigError


@dataclass
class DataArguments:
    """Where the parallel text comes from and how it is cut into batches."""

    _argument_group_name = "data: corpora, directions, lengths, tokenizer training"  # a section of `--help`

    dataset_name: str | None = field(
        default=None, metadata={"help": "'builtin' for the embedded corpus, or any `datasets` name."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "`datasets` config name."})
    train_file: str | None = field(
        default=None,
        metadata={
            "help": "JSON lines / JSON / Parquet in HF translation format, or a text path with "
            "'{lang}' (e.g. data/train.{lang}.gz) for line-aligned files per language; a glob "
            "(data/train-*.jsonl.gz) or a list of them (a YAML list, or comma-separated) for shards."
        },
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "Read train_file (or dataset_name's data files) as a stream of shards: no rank "
            "holds the corpus, tokenization runs on the fly (dataloader_num_workers), start-up and "
            "memory do not grow with the corpus. Needs max_steps. false: the corpus is read and "
            "tokenized before step 1 (exact epochs; for small data)."
        },
    )
    dataloader_num_workers: int = field(
        default=0,
        metadata={
            "help": "streaming: processes per rank that read and tokenize shards ahead of the step "
            "(0: in the training process). The batches are the same for any number."
        },
    )
    dataloader_prefetch_factor: int = field(
        default=2,
        metadata={"help": "streaming: windows of examples each rank's workers prepare ahead."},
    )
    validation_file: str | None = field(default=None, metadata={"help": "Same formats as train_file."})
    source_lang: str | None = field(default=None, metadata={"help": "Source language code (one direction)."})
    target_lang: str | None = field(default=None, metadata={"help": "Target language code (one direction)."})
    language_pairs: list[str] = field(
        default_factory=list, metadata={"help": "Directions for multilingual runs, e.g. en-de de-en en-fr."}
    )
    builtin_size: int = field(default=4000, metadata={"help": "Builtin corpus: source items per language."})
    max_source_length: int = field(
        default=128,
        metadata={"help": "Longer sources (tag and </s> included) are truncated, as in run_translation.py."},
    )
    max_target_length: int = field(
        default=128,
        metadata={"help": "Longer targets (tag and </s> included) are truncated, as in run_translation.py."},
    )
    skip_long_examples: bool = field(
        default=False,
        metadata={
            "help": "Skip (and count) training and validation pairs over max_source_length / "
            "max_target_length instead of truncating them (fairseq's "
            "--skip-invalid-size-inputs-valid-test); test lines are never skipped."
        },
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training set."})
    max_eval_samples: int | None = field(
        default=256, metadata={"help": "Truncate each evaluation direction."}
    )
    max_predict_samples: int | None = field(
        default=None, metadata={"help": "do_predict: truncate each test direction (default: every line)."}
    )
    max_tokens_per_microbatch: int | None = field(
        default=None, metadata={"help": "Cap a micro-batch by padded tokens instead of sentence count."}
    )
    pad_to_multiple_of: int = field(
        default=1,
        metadata={
            "help": "Pad each micro-batch's source and target lengths up to a multiple of this "
            "(DataCollatorForSeq2Seq's name), so a stage meets a bounded set of shapes (8: about 4x "
            "fewer on short sentences); pads are masked, the loss does not change. 1 (the default, "
            "measured in docs/data.md): the longest only. Under max_tokens_per_microbatch the cap "
            "counts the padded lengths."
        },
    )
    spm_model_type: str = field(
        default="bpe",
        metadata={
            "help": "SentencePiece model type: bpe (as M2M100 and NLLB) or unigram. Runs on stock M2M100 "
            "codes export an M2M100Tokenizer either way; others an NllbTokenizer honouring "
            "src_lang/tgt_lang/text_target (bpe) or a plain fast tokenizer (unigram)."
        },
    )
    spm_character_coverage: float = field(default=1.0, metadata={"help": "SentencePiece character coverage."})
    spm_input_sentence_size: int = field(default=200000, metadata={"help": "Sentences sampled to train SPM."})
    test_file: str | None = field(
        default=None,
        metadata={
            "help": "do_predict: test data, same formats as train_file (default: dataset_name's test split)."
        },
    )
    forced_bos_token: str | None = field(
        default=None,
        metadata={
            "help": "run_translation's name for the decoder's forced first token: a language code (de or "
            "__de__); it must be the target of every direction (each direction's decoder is always forced "
            "to its own target tag), so it only confirms the target."
        },
    )
    source_prefix: str | None = field(
        default=None,
        metadata={"help": "T5's task prefix (run_translation); M2M100/NLLB use tags: empty only."},
    )
    preprocessing_num_workers: int | None = field(
        default=None,
        metadata={"help": "Processes that tokenize the corpus (datasets num_proc; same result as one)."},
    )
    sampling_temperature: float = field(
        default=1.0,
        metadata={
            "help": "Direction d is drawn with probability p_d ~ w_d^(1/T), w_d its pair count (or its "
            "sampling_weights entry): 1 = proportional to the data, 5 = M2M100 / NLLB, large = uniform."
        },
    )
    sampling_weights: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Weights replacing the pair counts w_d of every direction, e.g. 'en-de:2 de-en:1'; "
            "sampling_temperature still applies (T=1 keeps the weights' ratio as given)."
        },
    )
    cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where tokenized data is cached as memory-mapped Arrow files, keyed by a fingerprint "
            "of data, tokenizer and lengths (default: <output_dir>/data_cache)."
        },
    )
    max_bad_record_fraction: float = field(
        default=0.01,
        metadata={
            "help": "Unreadable lines (malformed JSON, not UTF-8) in a data file are skipped and counted; "
            "above this share of the file's lines the run fails naming the first ones."
        },
    )

    def __post_init__(self) -> None:
        check_choice("spm_model_type", self.spm_model_type, ("unigram", "bpe"))
        check_range(self, ("builtin_size", "max_source_length", "max_target_length"), 1)
        check_range(self, ("spm_input_sentence_size",), 1)
        check_range(self, ("max_train_samples", "max_eval_samples", "max_predict_samples",
                           "max_tokens_per_microbatch"), 1, optional=True)  # fmt: skip
        check_range(self, ("max_source_length", "max_target_length"), 3)
        check_range(self, ("dataloader_num_workers",), 0)
        check_range(self, ("dataloader_prefetch_factor", "pad_to_multiple_of"), 1)
        if isinstance(self.train_file, (list, tuple)):  # a YAML list of shards
            self.train_file = ",".join(str(x) for x in self.train_file)
        check_range(self, ("spm_character_coverage",), 0, 1, low_open=True)
        check_range(self, ("max_bad_record_fraction",), 0, 1)
        if self.language_pairs is None:  # `--language_pairs null`
            self.language_pairs = []
        if isinstance(self.language_pairs, str):
            self.language_pairs = [p for p in self.language_pairs.replace(",", " ").split() if p]
        for pair in self.language_pairs:
            if pair.count("-") != 1 or not all(pair.split("-")):
                raise ConfigError(f"language_pairs entry {pair!r} is not of the form src-tgt (e.g. en-de)")
        check_range(self, ("preprocessing_num_workers",), 1, optional=True)
        if self.source_prefix:
            raise ConfigError(
                f"source_prefix={self.source_prefix!r}: a T5 task prefix; M2M100/NLLB mark the direction "
                f"with language tags (source_lang/target_lang or language_pairs), so leave it empty"
            )
        self._check_sources()
        self._check_streaming()
        self._check_forced_bos()
        check_range(self, ("sampling_temperature",), 0, low_open=True)
        self.sampling_weights = self._check_weights()

    def _check_forced_bos(self) -> None:
        """`forced_bos_token` must name the target language of every direction (tag or code)."""
        if not self.forced_bos_token or not (self.language_pairs or (self.source_lang and self.target_lang)):
            return
        code = self.forced_bos_token.strip("_")
        targets = sorted({t for _, t in self.directions()})
        if targets != [code]:
            raise ConfigError(
                f"forced_bos_token={self.forced_bos_token!r} conflicts with the run's target language(s) "
                f"{targets}: each direction's decoder is forced to its own target tag; remove it or set "
                f"it to the one target"
            )

    def _check_weights(self) -> list[str]:
        """`sampling_weights` as `src-tgt:w` entries, one per direction of the run, each w > 0."""
        given = self.sampling_weights or []
        given = [given] if isinstance(given, str) else given
        entries = [e for item in given for e in str(item).replace(",", " ").split()]  # 'en-de:2 de-en:1' too
        if not entries:
            return []
        weights = self.direction_weights(entries)
        names = ["-".join(d) for d in self.directions()]
        if sorted(weights) != sorted(names):
            raise ConfigError(
                f"sampling_weights name {sorted(weights)} but the run's directions are {names}; "
                "give one weight per direction"
            )
        return list(entries)

    @staticmethod
    def direction_weights(entries: list[str]) -> dict[str, float]:
        """`['en-de:2', 'de-en:1'] -> {'en-de': 2.0, 'de-en': 1.0}`.

        Raises:
            ConfigError: an entry not of the form `src-tgt:w` with a finite w > 0, or a repeated direction.
        """
        out: dict[str, float] = {}
        for entry in entries:
            name, _, text = entry.rpartition(":")
            try:
                w = float(text)
            except ValueError:
                w = math.nan
            if name.count("-") != 1 or not all(name.split("-")) or not (math.isfinite(w) and w > 0):
                raise ConfigError(
                    f"sampling_weights entry {entry!r} is not of the form src-tgt:w with w > 0 (e.g. en-de:2)"
                )
            if name in out:
                raise ConfigError(f"sampling_weights names {name!r} twice")
            out[name] = w
        return out

    def _check_sources(self) -> None:
        """One data source and one way of naming the directions, or an error naming both."""
        if self.dataset_name and (self.train_file or self.validation_file):
            given = "train_file" if self.train_file else "validation_file"
            raise ConfigError(
                f"dataset_name={self.dataset_name!r} and {given}={getattr(self, given)!r} are both set; "
                f"use one (on the command line `--dataset_name null` unsets a config file's dataset)"
            )
        one = [f"{self.source_lang}-{self.target_lang}"]
        if self.language_pairs and (self.source_lang or self.target_lang) and self.language_pairs != one:
            raise ConfigError(
                f"source_lang={self.source_lang!r} / target_lang={self.target_lang!r} conflict with "
                f"language_pairs={self.language_pairs}; set one of them (`--language_pairs null` or "
                f"`--source_lang null --target_lang null` unsets a config file's value)"
            )

    def _check_streaming(self) -> None:
        """What a stream of shards cannot do, refused in one line."""
        if not self.streaming:
            return
        if self.dataset_name == "builtin":
            raise ConfigError(
                "streaming: true reads data files; dataset_name='builtin' is generated in memory "
                "(set streaming: false, or give train_file shards)"
            )
        if self.max_train_samples is not None:
            raise ConfigError(
                f"max_train_samples={self.max_train_samples} truncates an in-memory dataset; a stream "
                "has no fixed order to truncate (use max_steps, or streaming: false)"
            )

    def train_files(self) -> list[str]:
        """`train_file`'s entries: paths, globs or `{lang}` patterns (comma-separated or one)."""
        return [e.strip() for e in (self.train_file or "").split(",") if e.strip()]

    def directions(self) -> list[tuple[str, str]]:
        """The translation directions of the run."""
        if self.language_pairs:
            return [tuple(p.split("-")) for p in self.language_pairs]  # type: ignore[misc]
        if self.source_lang and self.target_lang:
            return [(self.source_lang, self.target_lang)]
        raise ConfigError("no direction given: set source_lang and target_lang, or language_pairs")
