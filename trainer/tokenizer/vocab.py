"""The shared SentencePiece vocabulary with M2M100 language tags, and its Hugging Face export.

Id layout of a trained model (the M2M100 / fairseq convention):

    0 <s> (bos)   1 <pad>   2 </s> (eos, also decoder start)   3 <unk>
    4 .. 4+L-1    __xx__ language tags of the run, sorted: CONTROL symbols
    4+L ..        pieces learnt from the data

A language's tag is `__en__` for M2M100-style codes (`en`) and the code itself for
NLLB-style codes (`eng_Latn`), as the M2M100 and NLLB tokenizers define them (`lang_tag`).
Tags are SentencePiece *control* symbols: `encode("__en__ hi")` never yields the tag
id (the text is cut into ordinary pieces), so data cannot inject a language switch.
Sequences are built by the data pipeline: source `__src__ tokens </s>`, labels
`__tgt__ tokens </s>`, decoder input `</s> __tgt__ tokens`.

Hugging Face export: `save_pretrained(dir)` writes files that stock
`AutoTokenizer.from_pretrained(dir)` loads in transformers 4.x and 5.x, with the same ids
(an `NllbTokenizer` honouring `src_lang` / `tgt_lang` / `text_target` for BPE models; see
`trainer.tokenizer.hf_format` for the choice of class). `python -m trainer.export` writes a stock
`M2M100Tokenizer` instead when every tag is a stock M2M100 code, permuting the model's
vocabulary to its ids (`trainer.tokenizer.stock_m2m100`). A directory holding a stock
`NllbTokenizer` or `M2M100Tokenizer` is used as is (`HFTokenizer`).
"""

from __future__ import annotations

import io
import json
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from trainer.errors import TokenizerError

logger = logging.getLogger(__name__)

BOS, PAD, EOS, UNK = "<s>", "<pad>", "</s>", "<unk>"
SPM_FILE = "sentencepiece.model"
META_FILE = "polyglot_tokenizer.json"


# NLLB-200 / FLORES-200 codes: ISO 639-3 + ISO 15924 script, e.g. eng_Latn, zho_Hant.
NLLB_CODE = re.compile(r"[a-z]{3}_[A-Z][a-z]{3}")
M2M100_TAG = re.compile(r"__[A-Za-z_-]+__")


def lang_tag(lang: str) -> str:
    """The tag of `lang`: NLLB codes are their own tag (`eng_Latn`), others M2M100's (`en` -> `__en__`)."""
    return lang if NLLB_CODE.fullmatch(lang) else f"__{lang}__"


def is_tag(token: str) -> bool:
    """Whether a vocabulary token has the form of a language tag (`__en__` or `eng_Latn`)."""
    return bool(M2M100_TAG.fullmatch(token) or NLLB_CODE.fullmatch(token))


class Tokenizer(ABC):
    """Text <-> ids for one run: ordinary pieces, specials and one tag per language.

    Subclasses provide `_encode_batch`, `_decode` and `_piece_to_id`; this class owns
    the run's language tags and the special ids the model config needs.
    """

    def __init__(
        self, languages: Sequence[str], vocab_size: int, pad: int, bos: int, eos: int, unk: int
    ) -> None:
        self.languages = sorted(set(languages))
        self.vocab_size = vocab_size
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = pad, bos, eos, unk

    # -- to implement
    @abstractmethod
    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text, without specials or tags."""

    @abstractmethod
    def _decode(self, ids: list[int]) -> str:
        """Text of ordinary piece ids."""

    @abstractmethod
    def _piece_to_id(self, piece: str) -> int | None:
        """Id of a piece, or None if it is not in the vocabulary."""

    @abstractmethod
    def save(self, directory: str | Path) -> None:
        """Write the tokenizer so that `Tokenizer.load(directory)` restores it."""

    @abstractmethod
    def save_pretrained(self, directory: str | Path, model_max_length: int | None = None) -> None:
        """Write files that stock `transformers.AutoTokenizer.from_pretrained(directory)` loads,
        truncating at `model_max_length` (None: no limit)."""

    # -- shared
    def encode(self, text: str) -> list[int]:
        """Ids of `text`, without specials or tags."""
        return self._encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` for many texts at once (much faster)."""
        return self._encode_batch(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, skipping specials (bos, pad, eos, unk), language tags and ids
        outside the vocabulary (e.g. the -100 of padded labels)."""
        skip = self.special_id_set()
        return self._decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size and int(i) not in skip])

    def lang_id(self, lang: str) -> int:
        """The id of `lang`'s tag.

        Raises:
            TokenizerError: if the tokenizer has no tag for `lang`.
        """
        tag_id = self._piece_to_id(lang_tag(lang)) if lang in self.languages else None
        if tag_id is None:
            raise TokenizerError(
                f"tokenizer has no language tag {lang_tag(lang)}; it has {[lang_tag(x) for x in self.languages]}"
            )
        return tag_id

    def special_ids(self) -> dict[str, int]:
        """Special ids as `M2M100Config` names them; the decoder starts from eos."""
        return {
            "pad_token_id": self.pad_id,
            "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_id,
            "unk_token_id": self.unk_id,
            "decoder_start_token_id": self.eos_id,
        }

    def special_id_set(self) -> set[int]:
        """Ids that `decode` drops: specials and the run's tags."""
        return {self.pad_id, self.bos_id, self.eos_id, self.unk_id} | {
            self.lang_id(x) for x in self.languages
        }

    @staticmethod
    def load(directory: str | Path, languages: Sequence[str] | None = None) -> Tokenizer:
        """Load a tokenizer saved by `save`, or any Hugging Face tokenizer directory.

        Args:
            directory: our saved directory or a `transformers` tokenizer directory.
            languages: languages the run needs; each must have a `__xx__` tag.
                Default: the languages saved with our tokenizer (none for HF dirs).

        Raises:
            TokenizerError: if the directory is missing or unreadable, or a tag is missing.
        """
        path = Path(directory)
        if not path.is_dir():
            raise TokenizerError(f"tokenizer_name {str(directory)!r} is not a directory")
        if (path / SPM_FILE).is_file() and (path / META_FILE).is_file():
            tok: Tokenizer = SentencePieceTokenizer.load_dir(path)
        else:
            tok = HFTokenizer.load_dir(path, languages)
        if languages is not None:
            _check_tags(tok, languages, str(directory))
        return tok

    @abstractmethod
    def available_tags(self) -> list[str]:
        """Every `__xx__` language tag in the vocabulary."""

    @abstractmethod
    def pieces(self) -> list[str]:
        """The token of every id, 0 .. vocab_size - 1 (what two tokenizers must share to share ids)."""


def _check_tags(tok: Tokenizer, languages: Sequence[str], where: str) -> None:
    missing = [lang for lang in sorted(set(languages)) if tok._piece_to_id(lang_tag(lang)) is None]
    if missing:
        raise TokenizerError(
            f"tokenizer at {where} has no tag {lang_tag(missing[0])}; it has {tok.available_tags()}"
        )


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model trained for the run (see the module docstring for ids)."""

    def __init__(self, model_proto: bytes, languages: Sequence[str]) -> None:
        import sentencepiece as spm

        self.model_proto = model_proto
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        sp = self.sp
        super().__init__(languages, sp.get_piece_size(), sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.unk_id())
        _check_tags(self, self.languages, "(sentencepiece model)")

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts)

    def _decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)

    def _piece_to_id(self, piece: str) -> int | None:
        i = self.sp.piece_to_id(piece)
        return None if i == self.unk_id and piece != UNK else int(i)

    def available_tags(self) -> list[str]:
        """The run's tags (control symbols at ids 4..), in id order."""
        return [lang_tag(x) for x in self.languages]

    def pieces(self) -> list[str]:
        return [self.sp.id_to_piece(i) for i in range(self.vocab_size)]

    def save(self, directory: str | Path) -> None:
        """Write `sentencepiece.model`, our metadata and the Hugging Face files (`save_pretrained`)."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / SPM_FILE).write_bytes(self.model_proto)
        (path / META_FILE).write_text(json.dumps({"languages": self.languages, "format": 1}))
        self.save_pretrained(path)

    @classmethod
    def load_dir(cls, path: Path) -> SentencePieceTokenizer:
        """Load what `save` wrote."""
        try:
            meta = json.loads((path / META_FILE).read_text())
            return cls((path / SPM_FILE).read_bytes(), meta["languages"])
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise TokenizerError(f"tokenizer at {path} is unreadable: {e}") from None

    def save_pretrained(self, directory: str | Path, model_max_length: int | None = None) -> None:
        """Write the files `AutoTokenizer.from_pretrained` loads (see `trainer.tokenizer.hf_format`).

        Args:
            directory: destination.
            model_max_length: where `truncation=True` cuts (the model's max positions); None: no limit.
        """
        from trainer.tokenizer.hf_format import save_hf_tokenizer

        save_hf_tokenizer(self.model_proto, self.available_tags(), directory, model_max_length)


class HFTokenizer(Tokenizer):
    """Any `transformers` tokenizer directory whose language tags are tokens of its vocabulary:
    `__en__` (M2M100Tokenizer; the run's language `en`) or `eng_Latn` (NllbTokenizer)."""

    def __init__(self, hf: Any, languages: Sequence[str] | None = None) -> None:
        self.hf = hf
        ids = [hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, hf.unk_token_id]
        if any(i is None for i in ids):
            raise TokenizerError(
                f"tokenizer {hf.name_or_path!r} lacks one of pad/bos/eos/unk tokens (ids {ids}); all four are needed"
            )
        tags = self.available_tags()
        if languages is None:  # every tag of the vocabulary, as a language code
            languages = [t if NLLB_CODE.fullmatch(t) else t[2:-2] for t in tags]
        # M2M100Tokenizer's language tokens lie past len(): its ids are len(vocab.json) + i.
        size = max([len(hf), *(int(hf.convert_tokens_to_ids(t)) + 1 for t in tags)])
        super().__init__(languages, size, *(int(i) for i in (ids[0], ids[1], ids[2], ids[3])))

    @classmethod
    def load_dir(cls, path: Path, languages: Sequence[str] | None) -> HFTokenizer:
        """Load with `AutoTokenizer.from_pretrained` (offline)."""
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TokenizerError(f"tokenizer at {path} cannot be loaded by AutoTokenizer: {first}") from None
        return cls(hf, languages)

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        # split_special_tokens: a text spelling `__de__` or `eng_Latn` is ordinary pieces, never the tag.
        return self.hf(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def _decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def _piece_to_id(self, piece: str) -> int | None:
        i = self.hf.convert_tokens_to_ids(piece)
        return None if i is None or (i == self.unk_id and piece != self.hf.unk_token) else int(i)

    def available_tags(self) -> list[str]:
        """Every language tag (`__xx__` or `eng_Latn`) of the vocabulary, sorted."""
        hf = self.hf  # M2M100Tokenizer lists its language tokens only in lang_token_to_id
        found = [*hf.get_vocab(), *hf.all_special_tokens, *getattr(hf, "lang_token_to_id", {})]
        return sorted({t for t in found if is_tag(t)})

    def pieces(self) -> list[str]:
        return [str(t) for t in self.hf.convert_ids_to_tokens(list(range(self.vocab_size)))]

    def save(self, directory: str | Path) -> None:
        """Write with `save_pretrained` (loadable by `Tokenizer.load` and `AutoTokenizer`, 4.x and 5.x)."""
        from trainer.tokenizer.hf_format import loadable_by_transformers4

        self.hf.save_pretrained(str(directory))
        loadable_by_transformers4(directory)

    def save_pretrained(self, directory: str | Path, model_max_length: int | None = None) -> None:
        """`save`, with `model_max_length` (where `truncation=True` cuts) set first when given."""
        if model_max_length is not None:
            self.hf.model_max_length = int(model_max_length)
        self.save(directory)


# ----------------------------------------------------------------------------- training


def _spm_kwargs(
    vocab_size: int, languages: Sequence[str], model_type: str, coverage: float, input_sentence_size: int
) -> dict[str, Any]:
    return dict(
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=coverage,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True,
        bos_id=0,
        pad_id=1,
        eos_id=2,
        unk_id=3,
        bos_piece=BOS,
        pad_piece=PAD,
        eos_piece=EOS,
        unk_piece=UNK,
        control_symbols=[lang_tag(x) for x in sorted(set(languages))],
        hard_vocab_limit=False,  # a tiny corpus yields fewer pieces instead of failing
        minloglevel=2,
    )


def _train_once(texts: Sequence[str], kwargs: dict[str, Any]) -> bytes:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=buf, **kwargs)
    return buf.getvalue()


def train_tokenizer(
    texts: Iterable[str],
    languages: Sequence[str],
    vocab_size: int,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    input_sentence_size: int = 200000,
    seed: int = 0,
) -> SentencePieceTokenizer:
    """Train one SentencePiece model on the text of every language of the run.

    Args:
        texts: training sentences (all languages mixed).
        languages: the run's languages; each gets a `__xx__` control symbol (sorted ids 4..).
        vocab_size: requested size including specials and tags. A corpus too small for it
            gets a smaller vocabulary (logged as a warning).
        model_type: "unigram" or "bpe".
        character_coverage: SentencePiece character coverage.
        input_sentence_size: sentences sampled for training.
        seed: SentencePiece's sampling seed.

    Returns:
        The trained tokenizer.

    Raises:
        TokenizerError: on an empty corpus or a vocabulary too small for specials, tags and characters.
    """
    import sentencepiece as spm

    sample = [t for t in texts if t and t.strip()]
    if not sample:
        raise TokenizerError("cannot train SentencePiece: the training text is empty")
    if len(sample) > input_sentence_size:  # drawn here, by the seed: SentencePiece's own draw is not
        import random  # repeatable across processes (two runs of one config got different pieces)

        sample = random.Random(seed).sample(sample, input_sentence_size)
    spm.set_random_generator_seed(seed)
    kwargs = _spm_kwargs(vocab_size, languages, model_type, character_coverage, input_sentence_size)
    proto = _train_with_shrink(sample, kwargs)
    tok = SentencePieceTokenizer(proto, languages)
    if tok.vocab_size != vocab_size:
        logger.warning(
            "SentencePiece: the corpus supports %d pieces, fewer than vocab_size=%d; using %d",
            tok.vocab_size,
            vocab_size,
            tok.vocab_size,
        )
    return tok


def _train_with_shrink(texts: Sequence[str], kwargs: dict[str, Any]) -> bytes:
    """Train; a vocab_size the corpus cannot reach is shrunk to the maximum SentencePiece names."""
    requested = kwargs["vocab_size"]
    try:
        return _train_once(texts, kwargs)
    except RuntimeError as e:
        msg = str(e)
        if "smaller than required_chars" in msg or "is smaller than" in msg:
            raise TokenizerError(
                f"vocab_size={requested} is too small for the specials, "
                f"{len(kwargs['control_symbols'])} language tags and the characters of the corpus ({msg.strip()})"
            ) from None
        found = re.search(r"<= (\d+)", msg)
        if not found or "too high" not in msg and "too big" not in msg.lower():
            raise TokenizerError(f"SentencePiece training failed: {msg.strip()}") from None
        shrunk = int(found.group(1))
        logger.warning(
            "SentencePiece: vocab_size=%d too big for this corpus; shrinking to %d", requested, shrunk
        )
        return _train_once(texts, {**kwargs, "vocab_size": shrunk})


def iter_texts(rows: Iterable[dict[str, str]]) -> Iterator[str]:
    """Each distinct text of `{lang: text}` rows once (a text shared by directions counts once)."""
    seen: set[int] = set()
    for row in rows:
        for text in row.values():
            h = hash(text)
            if text and h not in seen:
                seen.add(h)
                yield text


def load_or_train_tokenizer(
    tokenizer_name: str | None,
    languages: Sequence[str],
    texts: Iterable[str],
    vocab_size: int,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    input_sentence_size: int = 200000,
    seed: int = 0,
) -> Tokenizer:
    """The run's tokenizer: loaded from `tokenizer_name` if given, else trained on `texts`.

    Args:
        tokenizer_name: our saved directory or a Hugging Face tokenizer directory, or None.
        languages: the run's languages; a loaded tokenizer must have each tag.
        texts: training text (only read when training).
        vocab_size, model_type, character_coverage, input_sentence_size, seed: see `train_tokenizer`.

    Returns:
        The tokenizer.

    Raises:
        TokenizerError: see `Tokenizer.load` and `train_tokenizer`.
    """
    if tokenizer_name:
        return Tokenizer.load(tokenizer_name, languages)
    return train_tokenizer(
        texts, languages, vocab_size, model_type, character_coverage, input_sentence_size, seed
    )
