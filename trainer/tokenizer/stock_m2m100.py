"""The stock M2M100 form of an export: `M2M100Tokenizer` files and the model's vocabulary permuted to fit.

An M2M100-style run (tags `__xx__`) whose every code is one of stock M2M100's 100
(`FAIRSEQ_LANGUAGE_CODES["m2m100"]`) is exported as a true M2M100 checkpoint, so that
`AutoTokenizer` gives an `M2M100Tokenizer` on which `tok.src_lang = "en"`,
`tok.tgt_lang = "de"`, `text_target=` and `tok.get_lang_id("de")` work as with
`facebook/m2m100_418M`. Other runs keep the `NllbTokenizer` form (`trainer.tokenizer.hf_format`).

Stock M2M100Tokenizer maps SentencePiece pieces through `vocab.json` and puts language code
i of its fixed list at `len(vocab.json) + i`, then 8 "madeup words" (stock `vocab_size` is
128004 + 100 + 8). Our ids put the run's tags first (`trainer.tokenizer`), so the export
permutes the vocabulary (S: tokenizer size, V: model rows, V >= S; N = S - L):

    ours:  0..3 specials | 4..4+L-1 tags (L) | 4+L..S-1 pieces | S..V-1 rows past the tokenizer
    stock: 0..3 specials | 4..N-1 the same pieces, in order   | N+i code i (100) | N+100.. madeup

Rows past the tokenizer (a padded vocabulary) take the madeup slots, whose count grows past 8
if needed, so every trained row is kept and logits agree on every id. New rows: a code the
run did not train gets the mean of the trained tag rows (a fine-tune that adds the language
starts from a tag-like embedding); an unfilled madeup word gets a copy of the `<unk>` row.
A model without a logits bias cannot give a row minus infinity, so these rows take some of
the softmax: over the whole stock vocabulary the log-probabilities and the loss differ from
the trained model's (on a 2-step tiny model, logits near uniform, the eval loss rose from
6.968 to 7.085, tests/dist/test_export.py), and so did beam search's choice (with 2 beams,
~10% of a 600-step model's lines). So `generation_config.json` lists them as one-token
`bad_words_ids` with `renormalize_logits` (`generation_rules`): `generate` in transformers
4.46+ and 5.x, and our decoder on the export (`models.generate`), then never emit them and
score beams over the run's rows only, exactly the trained model's log-probabilities, so the
export decodes as its checkpoint, greedy and beam. (Not `suppress_tokens`: HF applies it after
the forced target tag, so forcing an untrained code would leave no token at all;
`bad_words_ids` runs before it.) The specials keep ids
0..3, so config.json and generation_config.json ids need no change; as stock, no
`forced_bos_token_id` is stored: pass `forced_bos_token_id=tok.get_lang_id("de")` to `generate`.

`split_special_tokens` is set, so text spelling `</s>` is cut into pieces (the M2M100Tokenizer
never reads `__xx__` from text: its codes are not in the added-token trie, in 4.x and 5.x).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from models.config import ModelConfig

if TYPE_CHECKING:
    from trainer.tokenizer.vocab import SentencePieceTokenizer

BOS, PAD, EOS, UNK = "<s>", "<pad>", "</s>", "<unk>"
M2M100_CLASS = "M2M100Tokenizer"
MADEUP_WORDS = 8  # stock M2M100's num_madeup_words: rows after the language codes
SPM_FILE = "sentencepiece.bpe.model"  # the names stock M2M100Tokenizer reads
VOCAB_FILE = "vocab.json"


def stock_codes() -> list[str]:
    """Stock M2M100Tokenizer's 100 language codes, in id order."""
    from transformers.models.m2m_100.tokenization_m2m_100 import FAIRSEQ_LANGUAGE_CODES

    return list(FAIRSEQ_LANGUAGE_CODES["m2m100"])


def run_codes(tags: Sequence[str]) -> list[str] | None:
    """The stock codes of the run's tags (`__en__` -> `en`), or None if any tag is not one."""
    stock = set(stock_codes())
    codes = [t[2:-2] for t in tags if t.startswith("__") and t.endswith("__") and len(t) > 4]
    if not tags or len(codes) != len(tags) or not set(codes) <= stock:
        return None
    return codes


@dataclass(frozen=True)
class StockLayout:
    """Where each of our ids lies in the stock M2M100 vocabulary (see the module docstring)."""

    new_id: tuple[int, ...]  # our id -> stock id, for every model row (V)
    size: int  # stock vocab_size: N + 100 + madeup words
    pieces: tuple[str, ...]  # vocab.json's keys in id order (N): specials and pieces
    codes: tuple[str, ...]  # the run's codes, sorted as its tags
    tag_ids: tuple[int, ...]  # our ids of the run's tags
    new_code_ids: tuple[int, ...]  # stock ids of the codes the run did not train
    madeup_fill_ids: tuple[int, ...]  # stock ids of madeup words no model row fills
    unk_id: int

    @property
    def num_madeup_words(self) -> int:
        return self.size - len(self.pieces) - len(stock_codes())

    @property
    def untrained_ids(self) -> tuple[int, ...]:
        """Stock ids no row of the run's model fills: the codes it did not train, unfilled madeup words."""
        return tuple(sorted((*self.new_code_ids, *self.madeup_fill_ids)))

    def permute_rows(self, weight: Tensor) -> Tensor:
        """Our (V, d) embedding -> the stock (size, d) one, new rows filled as documented."""
        if weight.shape[0] != len(self.new_id):
            raise ValueError(f"embedding has {weight.shape[0]} rows; the layout maps {len(self.new_id)}")
        out = weight.new_empty(self.size, *weight.shape[1:])  # (size, d)
        out[list(self.madeup_fill_ids)] = weight[self.unk_id]
        out[list(self.new_code_ids)] = weight[list(self.tag_ids)].mean(dim=0)
        out[list(self.new_id)] = weight
        return out

    def map_ids(self, ids: Tensor) -> Tensor:
        """Our ids -> stock ids, elementwise; negative entries (ignore_index -100) are kept."""
        table = torch.tensor(self.new_id, dtype=ids.dtype, device=ids.device)
        return torch.where(ids < 0, ids, table[ids.clamp(min=0)])


def stock_layout(pieces: Sequence[str], tags: Sequence[str], model_vocab: int) -> StockLayout | None:
    """The stock M2M100 layout of a run, or None when its tags are not all stock M2M100 codes.

    Args:
        pieces: the tokenizer's pieces in id order (specials 0..3, tags, pieces; S entries).
        tags: the run's tags, as they appear in `pieces`.
        model_vocab: the model's vocabulary rows (V >= S).

    Raises:
        ValueError: `model_vocab` is smaller than the tokenizer, or a tag is not in `pieces`.
    """
    codes = run_codes(tags)
    if codes is None:
        return None
    if model_vocab < len(pieces):
        raise ValueError(
            f"model vocab_size={model_vocab} is smaller than the tokenizer's {len(pieces)} pieces"
        )
    missing = [t for t in tags if t not in pieces]
    if missing:
        raise ValueError(f"tags {missing} are not pieces of the tokenizer")
    pieces = list(pieces)
    tag_set, stock = set(tags), stock_codes()
    kept = [p for p in pieces if p not in tag_set]
    index = {p: i for i, p in enumerate(kept)}
    n, extra = len(kept), model_vocab - len(pieces)
    code_of = dict(zip(tags, codes))
    new_id = [n + stock.index(code_of[p]) if p in tag_set else index[p] for p in pieces]
    new_id += [n + len(stock) + j for j in range(extra)]
    size = n + len(stock) + max(MADEUP_WORDS, extra)
    return StockLayout(
        new_id=tuple(new_id),
        size=size,
        pieces=tuple(kept),
        codes=tuple(codes),
        tag_ids=tuple(pieces.index(t) for t in tags),
        new_code_ids=tuple(n + i for i, c in enumerate(stock) if c not in code_of.values()),
        madeup_fill_ids=tuple(range(n + len(stock) + extra, size)),
        unk_id=pieces.index(UNK),
    )


def run_layout(tokenizer: SentencePieceTokenizer, model_vocab: int) -> StockLayout | None:
    """The stock layout of a run's own SentencePiece tokenizer, or None (see `stock_layout`)."""
    pieces = [tokenizer.sp.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    return stock_layout(pieces, tokenizer.available_tags(), model_vocab)


def stock_config(config: ModelConfig, layout: StockLayout) -> ModelConfig:
    """The model config in the stock M2M100 vocabulary (vocab_size grown to the layout's).

    Raises:
        ValueError: a special id (pad, bos, eos, unk) would move.
    """
    if layout.unk_id != config.unk_token_id or any(
        layout.new_id[i] != i for i in (config.pad_token_id, config.bos_token_id, config.eos_token_id)
    ):
        raise ValueError(f"special ids of {config} do not keep their ids in the stock layout")
    return replace(config, vocab_size=layout.size)


def generation_rules(layout: StockLayout) -> dict[str, Any]:
    """`generation_config.json` fields that keep `generate` on the run's rows (module docstring):
    the untrained ids as one-token `bad_words_ids`, and `renormalize_logits` so that beam scores
    are log-probabilities over the rest, the trained model's."""
    return {"bad_words_ids": [[i] for i in layout.untrained_ids], "renormalize_logits": True}


def permute_tensor(name: str, tensor: Tensor, layout: StockLayout) -> Tensor:
    """One of our tensors in the stock M2M100 vocabulary: the shared embedding (tied to the
    encoder, decoder and lm_head; the model has no logits bias) permuted, the others as they are."""
    return layout.permute_rows(tensor) if name == "shared.weight" else tensor


def permute_model(
    state: dict[str, Tensor], config: ModelConfig, layout: StockLayout
) -> tuple[dict[str, Tensor], ModelConfig]:
    """Our full state and config -> the stock M2M100 vocabulary's, tensor by tensor (`permute_tensor`)."""
    new_config = stock_config(config, layout)
    return {n: permute_tensor(n, t, layout) for n, t in state.items()}, new_config


def save_m2m100_tokenizer(
    model_proto: bytes,
    layout: StockLayout,
    directory: str | Path,
    model_max_length: int | None = None,
    src_lang: str | None = None,
    tgt_lang: str | None = None,
) -> None:
    """Write the files stock `M2M100Tokenizer` reads: the SentencePiece model, `vocab.json`
    (pieces -> stock ids) and `tokenizer_config.json` (loadable by transformers 4.x and 5.x).

    Args:
        model_proto: the run's SentencePiece model.
        layout: from `stock_layout`.
        directory: destination, created if needed.
        model_max_length: where `truncation=True` cuts; None: no limit.
        src_lang, tgt_lang: default codes (`en`); default: the run's first code and its second (or first).

    Raises:
        TokenizerError: `src_lang` / `tgt_lang` is not one of the run's codes.
    """
    from trainer.errors import TokenizerError

    codes = list(layout.codes)
    src, tgt = src_lang or codes[0], tgt_lang or codes[min(1, len(codes) - 1)]
    for name, code in (("src_lang", src), ("tgt_lang", tgt)):
        if code not in codes:
            raise TokenizerError(f"{name}={code!r} is not a language code of the run; valid: {codes}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / SPM_FILE).write_bytes(model_proto)
    vocab = {p: i for i, p in enumerate(layout.pieces)}
    (out / VOCAB_FILE).write_text(json.dumps(vocab, indent=2, ensure_ascii=False) + "\n")
    config: dict[str, Any] = {
        "tokenizer_class": M2M100_CLASS,
        "language_codes": "m2m100",
        "num_madeup_words": layout.num_madeup_words,
        "src_lang": src,
        "tgt_lang": tgt,
        "bos_token": BOS,
        "eos_token": EOS,
        "sep_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "split_special_tokens": True,  # text spelling </s> is cut into pieces, as SentencePiece does
        "clean_up_tokenization_spaces": False,
    }
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
