"""The Hugging Face form of the run's SentencePiece tokenizer: what `AutoTokenizer` loads from an export.

Which stock class: our ids are fixed (specials 0..3, the run's tags 4..4+L-1, pieces after;
see `trainer.tokenizer`). `M2M100Tokenizer` cannot express them: its language tokens are a
fixed list of 100 (or 8) codes whose ids are `len(vocab.json) + i`, after the vocabulary.
So this module writes the form with our ids: `NllbTokenizer` (`NllbTokenizerFast` in
transformers 4) takes any list of language codes as its extra special tokens, looks them up
in the vocabulary (so they keep ids 4..), builds `[code] tokens </s>` for `src_lang` and,
with `text_target=`, for `tgt_lang`, exactly our source and label format. It exists in
transformers 4.x and 5.x, so the files name `"tokenizer_class": "NllbTokenizer"` and the
codes are the tags themselves: `eng_Latn` for NLLB-style runs, `__xx__` for M2M100-style
ones (NllbTokenizer has no `xx -> __xx__` mapping).

This form is what the run's `tokenizer/` holds and what `python -m trainer.export` writes
for NLLB-style runs and for M2M100-style runs with a code outside stock M2M100's list. An
M2M100-style run whose codes are all stock is exported as a true M2M100 checkpoint instead,
`tok.src_lang = "en"` as with `facebook/m2m100_418M`: `M2M100Tokenizer` files and the model's
vocabulary permuted to its ids (`trainer.tokenizer.stock_m2m100`).

transformers 5 rebuilds an `NllbTokenizer` as SentencePiece-BPE from the vocabulary and
merges of `tokenizer.json` (4.x loads `tokenizer.json` as it is). A run trained with
`spm_model_type: bpe` therefore exports the NllbTokenizer; a Unigram run of this form cannot
be carried by any stock fast class with language-code semantics in transformers 5 (the slow
M2M100Tokenizer reads any SentencePiece model, but only its fixed codes), so it gets a plain
fast tokenizer (`PreTrainedTokenizerFast`, loadable by 4.x and 5.x) on which the user
writes the tag into the text: `tok("eng_Latn " + text)`. transformers 5 also rebuilds the
NllbTokenizer's normalizer without SentencePiece's strip of trailing whitespace: a text
ending in spaces gets one more `▁` piece than `encode` gives (strip such text first).

Both forms truncate at `model_max_length` (the model's `max_position_embeddings` when the
export knows it). The NllbTokenizer form sets `split_special_tokens`, so text that spells a
tag or `</s>` is cut into ordinary pieces, as SentencePiece does with control symbols (a
tag enters a sequence only through `src_lang` / `tgt_lang`).
"""

from __future__ import annotations

import json
import logging
import tempfile
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

BOS, PAD, EOS, UNK = "<s>", "<pad>", "</s>", "<unk>"
NLLB_CLASS = "NllbTokenizer"
PLAIN_CLASS = "PreTrainedTokenizerFast"


def convert_spm(model_proto: bytes) -> Any:
    """A `tokenizers.Tokenizer` from a SentencePiece model, via `transformers`' `SpmConverter`.

    transformers 5.x's converter breaks on BPE models (`SentencePieceExtractor.extract`
    is called with the score list as `model_type`), so the BPE model is built here:
    SentencePiece BPE scores are minus the merge rank, so merges ordered by the vocab
    rank of the merged piece reproduce it exactly (checked in the tests). Control and
    user-defined pieces (tags, specials) are never merged into: SentencePiece never
    produces them from text, and neither may the converted model.
    """
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFBackend
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import SpmConverter
    from transformers.tokenization_utils_base import generate_merges

    class _Converter(SpmConverter):
        def tokenizer(self, proto: Any) -> Any:
            if proto.trainer_spec.model_type != 2:
                return super().tokenizer(proto)
            vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
            controls = {p.piece for p in proto.pieces if p.type in (3, 4)}
            model = BPE(
                vocab, generate_merges(vocab, skip_tokens=controls), unk_token=proto.trainer_spec.unk_piece,
                fuse_unk=True,
            )  # fmt: skip
            backend = HFBackend(model)
            backend.add_tokens(
                [
                    AddedToken(p.piece, normalized=False, special=p.type == 3)
                    for p in proto.pieces
                    if p.type in (3, 4)
                ]
            )
            return backend

    with tempfile.NamedTemporaryFile(suffix=".model") as f:
        f.write(model_proto)
        f.flush()
        return _Converter(types.SimpleNamespace(vocab_file=f.name)).converted()


def is_bpe(model_proto: bytes) -> bool:
    """Whether a SentencePiece model is BPE (else Unigram)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()  # type: ignore[attr-defined]  # generated protobuf module
    proto.ParseFromString(model_proto)
    return bool(proto.trainer_spec.model_type == 2)


def save_hf_tokenizer(
    model_proto: bytes,
    tags: Sequence[str],
    directory: str | Path,
    model_max_length: int | None = None,
    src_lang: str | None = None,
    tgt_lang: str | None = None,
) -> str:
    """Write `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json`.

    Args:
        model_proto: the run's SentencePiece model (ids as in `trainer.tokenizer`).
        tags: the run's language tags (ids 4..), sorted.
        directory: destination, created if needed.
        model_max_length: where `truncation=True` cuts; None: no limit.
        src_lang, tgt_lang: default codes (tags) of the NllbTokenizer form; default: the
            first tag and the second (or first) tag.

    Returns:
        The tokenizer class written: "NllbTokenizer" (BPE models) or "PreTrainedTokenizerFast".

    Raises:
        TokenizerError: `src_lang` / `tgt_lang` is not one of `tags`, or `tags` is empty.
    """
    from trainer.errors import TokenizerError

    if not tags:
        raise TokenizerError(
            "the tokenizer has no language tags; an HF translation tokenizer needs at least one"
        )
    src = src_lang or tags[0]
    tgt = tgt_lang or tags[min(1, len(tags) - 1)]
    for name, code in (("src_lang", src), ("tgt_lang", tgt)):
        if code not in tags:
            raise TokenizerError(
                f"{name}={code!r} is not a language tag of the tokenizer; valid: {list(tags)}"
            )
    from tokenizers import processors

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    backend = convert_spm(model_proto)
    eos_id = backend.token_to_id(EOS)
    nllb = is_bpe(model_proto)
    if nllb:  # what NllbTokenizer's src_lang setter builds; 4.x keeps the file's until it is set
        src_id = backend.token_to_id(src)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{src} $A {EOS}", pair=f"{src} $A $B {EOS}", special_tokens=[(src, src_id), (EOS, eos_id)]
        )
    else:
        backend.post_processor = processors.TemplateProcessing(
            single=f"$A {EOS}", pair=f"$A $B {EOS}", special_tokens=[(EOS, eos_id)]
        )
        logger.info(
            "the run's SentencePiece model is unigram: its HF files are a plain fast tokenizer "
            "(write the tag into the text: tok('%s ' + text)); trainer.export writes an M2M100Tokenizer "
            "if every code is a stock M2M100 code, else train with spm_model_type=bpe for an NllbTokenizer",
            tags[0],
        )
    backend.save(str(out / "tokenizer.json"))
    config = _tokenizer_config(backend, tags, model_max_length, src, tgt, nllb)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    specials = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    (out / "special_tokens_map.json").write_text(
        json.dumps({**specials, "additional_special_tokens": list(tags)}, indent=2, ensure_ascii=False) + "\n"
    )
    return NLLB_CLASS if nllb else PLAIN_CLASS


def _tokenizer_config(
    backend: Any, tags: Sequence[str], model_max_length: int | None, src: str, tgt: str, nllb: bool
) -> dict[str, Any]:
    """A tokenizer_config.json both majors read: `additional_special_tokens` (4.x; 5.x maps it to
    its extra special tokens), no 5.x-only keys (`backend`, list-valued `extra_special_tokens`)."""
    decoder = {
        str(backend.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        }
        for t in (BOS, PAD, EOS, UNK, *tags)
    }  # fmt: skip
    config: dict[str, Any] = {
        "tokenizer_class": NLLB_CLASS if nllb else PLAIN_CLASS,
        "added_tokens_decoder": decoder,
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "additional_special_tokens": list(tags),
        "clean_up_tokenization_spaces": False,
    }
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    if nllb:
        config.update(
            src_lang=src,
            tgt_lang=tgt,
            legacy_behaviour=False,  # [code] tokens </s>, the M2M100 / NLLB-200 format
            split_special_tokens=True,  # text cannot inject a tag or </s>
            sep_token=EOS,
            cls_token=BOS,
            mask_token=None,  # NLLB's <mask> would be a new id past the model's vocabulary
        )
    return config


def loadable_by_transformers4(directory: str | Path) -> None:
    """Rewrite a `tokenizer_config.json` saved by transformers 5 so that 4.x loads it too.

    5.x writes the extra special tokens (e.g. NLLB's language codes) as a list under
    `extra_special_tokens`, which 4.x reads as a dict of named tokens and fails on; both
    majors read them as `additional_special_tokens`. A config without that list is left as is.
    """
    path = Path(directory) / "tokenizer_config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    extra = config.get("extra_special_tokens")
    if not isinstance(extra, list):
        return
    del config["extra_special_tokens"]
    before = config.get("additional_special_tokens") or []
    config["additional_special_tokens"] = [*before, *(t for t in extra if t not in before)]
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
