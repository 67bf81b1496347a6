"""A pretrained model keeps its vocabulary: where `model_name_or_path` and `tokenizer_name` point,
and whether the tokenizer's ids fit the model's embedding.

    pretrained_sources    each name -> a local directory: the directory itself, or a hub name
                          (`facebook/nllb-200-distilled-600M`) resolved by huggingface_hub's
                          `snapshot_download` through its cache (HF_HUB_CACHE / HF_HOME): offline
                          (HF_HUB_OFFLINE=1, or no network) the cached snapshot; online the hub's
                          revision, downloading what is missing (config, tokenizer files, and the
                          weights: safetensors where the repository has them, else pytorch_model*.bin)
                          -> which tokenizer the run uses: `tokenizer_name`, else the model
                          directory's own; a model directory without tokenizer files needs
                          `tokenizer_name` (a one-line ConfigError), since SentencePiece trained on
                          the data would give the pretrained embedding rows unrelated ids
    check_tokenizer_fits  the tokenizer against the checkpoint: its ids (size, every run language's
                          tag, pad / eos / decoder start) index the rows of `shared.weight` the model
                          was trained with, leaving at most VOCAB_PAD_ROWS - 1 padding rows unused

Both run before anything is written: the first in `validate_early` on every rank, the second
where rank 0 loads the tokenizer, its outcome shared with every rank (`trainer.run.setup`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.errors import ConfigError, TokenizerError
from trainer.tokenizer.vocab import META_FILE, SPM_FILE, lang_tag

if TYPE_CHECKING:
    from trainer.tokenizer.vocab import Tokenizer

# Files that make a directory a tokenizer: transformers' (tokenizer.json, tokenizer_config.json,
# M2M100's / NLLB's sentencepiece.bpe.model) or ours (`trainer.tokenizer.vocab.Tokenizer.save`).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "sentencepiece.bpe.model", SPM_FILE, META_FILE)
# snapshot_download's allow_patterns: config, generation config and tokenizer files; then the weights
HUB_FILES = ("*.json", "*.model")
HUB_WEIGHTS = (("*.safetensors",), ("pytorch_model*.bin",))  # the first the repository has
# Embedding rows a model may hold past its tokenizer: fairseq / M2M100 pad to a multiple of 8, NLLB-200
# has 256206 rows for 256204 ids, Megatron pads to 128 x tp. More unused rows: another model's tokenizer.
VOCAB_PAD_ROWS = 128


@dataclass(frozen=True)
class PretrainedSources:
    """The directories a run starts from (None: nothing pretrained)."""

    model: Path | None  # the model to fine-tune; None: a new model
    tokenizer: Path | None  # the tokenizer to load; None: SentencePiece trained on the data


def pretrained_sources(model_name_or_path: str | None, tokenizer_name: str | None) -> PretrainedSources:
    """Resolve both names to local directories and pick the run's tokenizer (module docstring).

    Raises:
        ConfigError: a name that is neither a directory nor a hub repository in the cache (or on the
            hub, online), or a model directory without tokenizer files and no `tokenizer_name`.
    """
    model = resolve_pretrained(model_name_or_path, "model_name_or_path", True) if model_name_or_path else None
    if tokenizer_name:
        return PretrainedSources(model, resolve_pretrained(tokenizer_name, "tokenizer_name", False))
    if model is None:
        return PretrainedSources(None, None)
    if not has_tokenizer_files(model):
        raise ConfigError(
            f"model_name_or_path={model_name_or_path!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}): "
            f"set tokenizer_name to the tokenizer the model was trained with (its directory or hub name); "
            f"a tokenizer trained on the data would give the pretrained embeddings unrelated ids"
        )
    return PretrainedSources(model, model)


def has_tokenizer_files(path: Path) -> bool:
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def resolve_pretrained(name: str, field: str, weights: bool) -> Path:
    """`name` as a local directory: itself, or the hub repository's snapshot in huggingface_hub's cache.

    Args:
        name: a directory, or a hub repository id (`org/name`).
        field: the config field that gave it (for the message).
        weights: fetch the model's weights too (else config and tokenizer files only).

    Raises:
        ConfigError: naming `field`, `name` and why it cannot be used.
    """
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ConfigError(f"{field}={name!r} is a file; expected a directory or a Hugging Face hub name")
    from huggingface_hub import constants

    return _snapshot(name, field, weights, constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE)


@functools.lru_cache(maxsize=16)  # once per process: the planner validates thousands of layouts
def _snapshot(name: str, field: str, weights: bool, cache_dir: str, offline: bool) -> Path:
    """The local snapshot of hub repository `name` (`resolve_pretrained`), downloaded where online."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        for patterns in HUB_WEIGHTS if weights else ((),):
            files = [*HUB_FILES, *patterns]
            snapshot = Path(
                snapshot_download(name, cache_dir=cache_dir, allow_patterns=files, local_files_only=offline)
            )
            if not patterns or any(snapshot.glob(patterns[0])):
                break
    except HFValidationError:
        raise ConfigError(
            f"{field}={name!r} is neither a directory nor a Hugging Face hub name (org/name)"
        ) from None
    except OSError as e:  # not in the cache and not reachable (offline, no network, unknown repository)
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"{field}={name!r} is not a directory, and huggingface_hub found no snapshot of it "
            f"(cache {cache_dir}, offline={offline}): {cause}; download it first (`hf download {name}`) "
            f"or give its directory"
        ) from None
    return snapshot


def check_tokenizer_fits(tok: Tokenizer, model_dir: Path, tokenizer: str, languages: Sequence[str]) -> None:
    """Refuse a tokenizer whose ids do not index the embedding the model at `model_dir` was trained with.

    Args:
        tok: the run's tokenizer.
        model_dir: the pretrained model's directory (`pretrained_sources(...).model`).
        tokenizer: where `tok` came from (for the message).
        languages: the run's languages; each tag's id must be a row of the embedding.

    Raises:
        CheckpointMismatchError: config.json's vocab_size differs from the stored embedding's rows.
        TokenizerError: naming both sizes (or the id and the size) that do not fit.
    """
    from models.errors import CheckpointMismatchError
    from models.hf import hf_tensor_shape, read_hf_config

    mc = read_hf_config(model_dir)
    rows = hf_tensor_shape(model_dir, "shared.weight")[0]
    if rows != mc.vocab_size:
        raise CheckpointMismatchError(
            f"{model_dir}: config.json has vocab_size={mc.vocab_size} but shared.weight has {rows} rows"
        )
    what = (
        f"the model's embedding (model_name_or_path {model_dir}) has {rows} rows (vocab_size={mc.vocab_size})"
    )
    if not tok.vocab_size <= rows < tok.vocab_size + VOCAB_PAD_ROWS:
        raise TokenizerError(
            f"the tokenizer ({tokenizer}) has {tok.vocab_size} ids but {what}: a pretrained model needs "
            f"the tokenizer it was trained with (at most {VOCAB_PAD_ROWS - 1} padding rows past its ids)"
        )
    tags = {lang_tag(lang): tok.lang_id(lang) for lang in languages}
    specials = {
        "pad": (tok.pad_id, mc.pad_token_id),
        "eos": (tok.eos_id, mc.eos_token_id),
        "decoder start": (tok.special_ids()["decoder_start_token_id"], mc.decoder_start_token_id),
    }
    outside = {tag: i for tag, i in tags.items() if i >= rows}
    if outside:
        raise TokenizerError(
            f"the tokenizer ({tokenizer}) puts language tags {outside} past the rows: {what}"
        )
    for name, (ours, theirs) in specials.items():
        if ours != theirs:
            raise TokenizerError(
                f"the tokenizer ({tokenizer}) has {name} id {ours} but the model at {model_dir} was trained "
                f"with {theirs} (config.json): a pretrained model needs the tokenizer it was trained with"
            )
