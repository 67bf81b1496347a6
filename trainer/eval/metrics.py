"""Corpus metrics of one direction (sacreBLEU): BLEU, chrF, chrF++ and, where its model is here, spBLEU.

    bleu     corpus BLEU; tokenization by target language (`bleu_tokenizer`)
    chrf     chrF (character 6-grams, beta 2)
    chrf++   chrF with word 1- and 2-grams too (`word_order=2`), the score NLLB reports
    spbleu   BLEU on sacreBLEU's `flores200` SentencePiece pieces (NLLB's spBLEU), one
             tokenization for every language; only with `spbleu=True`

BLEU tokenization follows sacreBLEU's own per-language defaults: "13a" for space-delimited
scripts, "zh" for Chinese, and "ja-mecab" / "ko-mecab" for Japanese and Korean when
sacreBLEU's optional MeCab extras are installed, else "char" (character n-grams: still
meaningful for unsegmented scripts, but not comparable with published MeCab numbers). chrF
is character-based and needs no tokenizer.

spBLEU needs sacreBLEU's SentencePiece model file, which sacreBLEU downloads on first use into
its cache (`$SACREBLEU/models/`, default `~/.sacrebleu/models/`). A run never lets it download
(a training run or an evaluation on machines without network would stall or fail half-way):
`check_spbleu_model` refuses in one line naming the path and the URL, before any work, and
`compute_metrics` checks again before sacreBLEU could reach for the network.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import sacrebleu

from trainer.errors import BadInputError

SPBLEU_TOKENIZER = "flores200"  # sacreBLEU's name; NLLB's spBLEU (FLORES-200's SentencePiece model)
METRICS = ("bleu", "chrf", "chrf++")  # always computed
SPBLEU = "spbleu"  # computed where asked for and its model is present


class SpBleuModelMissingError(BadInputError):
    """spBLEU was asked for but sacreBLEU's SentencePiece model is not in its cache."""


def metric_names(spbleu: bool = False) -> tuple[str, ...]:
    """The metrics `compute_metrics` returns, in table order."""
    return (*METRICS, SPBLEU) if spbleu else METRICS


@cache
def _mecab_available(tokenize: str) -> bool:
    try:
        sacrebleu.BLEU(tokenize=tokenize)
    except (RuntimeError, ImportError):  # sacrebleu raises RuntimeError naming `pip install sacrebleu[ja]`
        return False
    return True


# M2M100 codes and NLLB's ISO 639-3 prefixes (`zho_Hans`, `jpn_Jpan`, `kor_Hang`).
_ZH, _JA, _KO = {"zh", "zho", "yue"}, {"ja", "jpn"}, {"ko", "kor"}


def bleu_tokenizer(target_lang: str | None) -> str:
    """sacreBLEU tokenizer for references in `target_lang` (see the module docstring)."""
    lang = (target_lang or "").split("_")[0].split("-")[0].lower()
    if lang in _ZH:
        return "zh"
    for codes, mecab in ((_JA, "ja-mecab"), (_KO, "ko-mecab")):
        if lang in codes:
            return mecab if _mecab_available(mecab) else "char"
    return "13a"


def spbleu_model_path() -> Path:
    """Where sacreBLEU loads the flores200 SentencePiece model from (and would download it to).

    Read from sacreBLEU's own module, whose cache directory was fixed from `$SACREBLEU` when it
    was imported: the path checked is the path it opens.
    """
    from sacrebleu.tokenizers import tokenizer_spm

    url = tokenizer_spm.SPM_MODELS[SPBLEU_TOKENIZER]["url"]
    return Path(tokenizer_spm.SACREBLEU_DIR) / "models" / os.path.basename(url)


def spbleu_model_url() -> str:
    """The URL sacreBLEU fetches the flores200 SentencePiece model from."""
    from sacrebleu.tokenizers import tokenizer_spm

    return str(tokenizer_spm.SPM_MODELS[SPBLEU_TOKENIZER]["url"])


def spbleu_available() -> bool:
    """Whether spBLEU can be computed without a download."""
    return spbleu_model_path().is_file()


@cache
def _spbleu_scorer(path: Path) -> sacrebleu.BLEU:
    """One scorer per model file: loading FLORES-200's SentencePiece model (256k pieces) takes a
    while, and an evaluation scores hundreds of directions."""
    return sacrebleu.BLEU(tokenize=SPBLEU_TOKENIZER)


def check_spbleu_model(flag: str = "eval_spbleu") -> None:
    """Refuse spBLEU, in one line, where its SentencePiece model is not in sacreBLEU's cache.

    Args:
        flag: the option that asked for spBLEU, named in the message.

    Raises:
        SpBleuModelMissingError: naming the path to place the file at and the URL it comes from.
    """
    path = spbleu_model_path()
    if not path.is_file():
        raise SpBleuModelMissingError(
            f"{flag} needs sacreBLEU's {SPBLEU_TOKENIZER} SentencePiece model at {path}, which is "
            f"not there (runs never download it); fetch {spbleu_model_url()} to that path (e.g. "
            f"`curl -L -o {path} {spbleu_model_url()}`; $SACREBLEU moves the cache), or turn {flag} off"
        )


def compute_metrics(
    hypotheses: Sequence[str],
    references: Sequence[str],
    target_lang: str | None = None,
    spbleu: bool = False,
) -> dict[str, float]:
    """Corpus BLEU, chrF, chrF++ (and spBLEU) of one direction (sacreBLEU, one reference each).

    Args:
        hypotheses: system outputs.
        references: one reference per hypothesis.
        target_lang: picks the BLEU tokenizer (`bleu_tokenizer`); None: "13a".
        spbleu: also spBLEU (sacreBLEU's flores200 tokenization).

    Returns:
        `{"bleu", "chrf", "chrf++"[, "spbleu"]}`, each 0..100.

    Raises:
        ValueError: the lists differ in length or are empty.
        SpBleuModelMissingError: spbleu without its model (nothing is downloaded).
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not hypotheses:
        raise ValueError("no sentences to score")
    hyps, refs = list(hypotheses), [list(references)]
    out = {
        "bleu": sacrebleu.corpus_bleu(hyps, refs, tokenize=bleu_tokenizer(target_lang)).score,
        "chrf": sacrebleu.corpus_chrf(hyps, refs).score,
        "chrf++": sacrebleu.corpus_chrf(hyps, refs, word_order=2).score,
    }
    if spbleu:
        check_spbleu_model()  # sacreBLEU would download a missing model here
        out[SPBLEU] = _spbleu_scorer(spbleu_model_path()).corpus_score(hyps, refs).score
    return {k: float(v) for k, v in out.items()}
