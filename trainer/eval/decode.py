"""Translation quality: decode source strings (`models.generate` or the 3D mesh), score with sacreBLEU.

    build_batches       source strings -> length-sorted, right-padded `SourceBatch`es
    translate_batches   batches -> hypotheses in the caller's original order (one device)
    translate           strings -> hypotheses (one device); a blank source gets an empty
                        hypothesis, not a decoded one (`without_blanks` / `with_blanks`, which
                        the 3D `trainer.eval.runner.translate_on_mesh` uses too)
    hypotheses_in_order generated rows of batches -> hypotheses (any decoder, e.g. the 3D one)
    score_directions    a `Translator` over every direction -> `eval_bleu`, `eval_chrf`,
                        `eval_chrf++` (`eval_spbleu`), per-direction keys, samples
                        (`evaluate_directions`: one device's)

Only what is needed of a tokenizer and an eval set is assumed (the Protocols below),
so `trainer.tokenizer.vocab.Tokenizer` and any object with the same members fit.

The metrics of one direction (BLEU, chrF, chrF++, spBLEU) are `trainer.eval.metrics`'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from models.generate import SearchSettings, generate
from models.m2m100 import M2M100Translation
from trainer.eval.metrics import compute_metrics, metric_names

logger = logging.getLogger(__name__)

SAMPLES_KEY = "eval_samples"  # the one non-numeric entry of `evaluate_directions`' result


class TextTokenizer(Protocol):
    """What decoding needs of a tokenizer (satisfied by `trainer.tokenizer.vocab.Tokenizer`)."""

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """Ids of `text` without specials or tags."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` (specials may or may not be skipped; we strip them first)."""
        ...

    def lang_id(self, lang: str) -> int:
        """Id of the language tag `__lang__`; raises if absent."""
        ...


class EvalSet(Protocol):
    """One direction's evaluation texts; `sources[i]` translates to `references[i]`."""

    @property
    def direction(self) -> tuple[str, str]: ...

    @property
    def sources(self) -> Sequence[str]: ...

    @property
    def references(self) -> Sequence[str]: ...


@dataclass(frozen=True)
class DirectionTexts:
    """A plain `EvalSet`."""

    direction: tuple[str, str]
    sources: Sequence[str]
    references: Sequence[str]


class Sample(NamedTuple):
    """One row of the samples table (W&B)."""

    direction: str
    source: str
    reference: str
    hypothesis: str


@dataclass
class SourceBatch:
    """Right-padded sources; row r is the caller's sentence `index[r]`."""

    input_ids: Tensor  # (B, S) `__src__ tokens </s>` then pad
    attention_mask: Tensor  # (B, S)
    forced_bos_token_id: Tensor  # (B,) target tag per row
    index: list[int]


# ----------------------------------------------------------------------------- batching


def encode_source(
    tokenizer: TextTokenizer, text: str, src_tag: int, max_source_length: int | None
) -> list[int]:
    """`__src__ tokens </s>`, the tokens cut so the whole fits `max_source_length`."""
    ids = tokenizer.encode(text)
    if max_source_length is not None:
        ids = ids[: max(max_source_length - 2, 0)]
    return [src_tag, *ids, tokenizer.eos_id]


def pad_batch(rows: Sequence[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad `rows` -> (ids, mask), both (B, S)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def build_batches(
    tokenizer: TextTokenizer,
    sources: Sequence[str],
    src_lang: str,
    tgt_lang: str,
    batch_size: int,
    max_source_length: int | None = None,
) -> list[SourceBatch]:
    """Tokenize `sources` and cut them into batches of similar length (longest first).

    Sorting by length wastes little compute on padding; each batch records the
    original positions so `translate_batches` can restore the order. Longest first
    makes an out-of-memory batch fail at once rather than at the end.

    Args:
        tokenizer: see `TextTokenizer`.
        sources: source sentences.
        src_lang, tgt_lang: language codes with tags in the tokenizer (`en` -> `__en__`).
        batch_size: most sentences per batch.
        max_source_length: most source tokens, tag and `</s>` included (None: no cut).

    Returns:
        Batches covering every sentence once.

    Raises:
        ValueError: batch_size < 1.
        Whatever `tokenizer.lang_id` raises for a missing language tag.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    src_tag, tgt_tag = tokenizer.lang_id(src_lang), tokenizer.lang_id(tgt_lang)
    encoded = [encode_source(tokenizer, s, src_tag, max_source_length) for s in sources]
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))  # stable: ties keep input order
    batches = []
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        ids, mask = pad_batch([encoded[i] for i in index], tokenizer.pad_id)
        forced = torch.full((len(index),), tgt_tag, dtype=torch.long)
        batches.append(SourceBatch(ids, mask, forced, index))
    return batches


# ----------------------------------------------------------------------------- decoding


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Dropout off while decoding; the caller's train/eval mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def strip_output(ids: list[int], eos_id: int, pad_id: int) -> list[int]:
    """Generated `</s> __tgt__ tokens </s> pad...` -> `tokens`."""
    body = ids[2:]  # drop the decoder start token and the forced tag
    if eos_id in body:
        body = body[: body.index(eos_id)]
    return [i for i in body if i != pad_id]


def hypotheses_in_order(
    outputs: Iterable[tuple[Sequence[int], Sequence[Sequence[int]]]], tokenizer: TextTokenizer
) -> list[str]:
    """Generated rows of every batch -> hypotheses in the caller's original order.

    Args:
        outputs: per batch, its `SourceBatch.index` and its generated rows (ids lists).
        tokenizer: see `TextTokenizer`.

    Returns:
        n hypotheses, hypothesis i translating the caller's sentence i.

    Raises:
        ValueError: the batches' indices do not cover 0..n-1 exactly once.
    """
    found: dict[int, str] = {}
    rows = 0
    for index, generated in outputs:
        rows += len(index)
        for row, i in zip(generated, index):
            found[i] = tokenizer.decode(strip_output(list(row), tokenizer.eos_id, tokenizer.pad_id))
    if len(found) != rows or sorted(found) != list(range(rows)):
        raise ValueError(
            f"batch indices must cover 0..n-1 once; got {rows} rows, {len(found)} distinct indices"
        )
    return [found[i] for i in range(len(found))]


def translate_batches(
    model: M2M100Translation,
    batches: Iterable[SourceBatch],
    tokenizer: TextTokenizer,
    settings: SearchSettings,
    on_batch: Callable[[int], None] | None = None,
) -> list[str]:
    """Decode every batch on one device (greedy if settings.num_beams == 1, else beam search).

    Args:
        model: the full model; put in eval mode for the call.
        batches: from `build_batches` (their `index` fields cover 0..n-1 once).
        tokenizer: see `TextTokenizer`.
        settings: beam width, max_length (start token and tag included: HF's), suppressed ids.
        on_batch: called with a batch's sentence count once it is decoded (a progress bar).

    Returns:
        n hypotheses, hypothesis i translating the caller's sentence i.

    Raises:
        ValueError: the batches' indices do not cover 0..n-1 exactly once.
    """
    device = next(model.parameters()).device
    outputs = []
    with eval_mode(model):
        for batch in batches:
            out = generate(
                model,
                batch.input_ids.to(device),
                batch.attention_mask.to(device),
                forced_bos_token_id=batch.forced_bos_token_id.to(device),
                num_beams=settings.num_beams,
                max_length=settings.max_length,
                length_penalty=settings.length_penalty,
                early_stopping=settings.early_stopping,
                suppress_tokens=settings.suppress_tokens,
                renormalize_logits=settings.renormalize_logits,
            )
            outputs.append((batch.index, out.tolist()))
            if on_batch is not None:
                on_batch(len(batch.index))
    return hypotheses_in_order(outputs, tokenizer)


def without_blanks(sources: Sequence[str]) -> tuple[list[str], list[int]]:
    """The sources that hold text, and their positions. A blank line (empty or whitespace) has
    nothing to translate: decoded, `__src__ </s>` would give a made-up sentence."""
    keep = [i for i, s in enumerate(sources) if s.strip()]
    return [sources[i] for i in keep], keep


def with_blanks(hyps: Sequence[str], positions: Sequence[int], total: int) -> list[str]:
    """`total` hypotheses: `hyps[j]` at `positions[j]`, the empty string elsewhere (the blank sources)."""
    out = [""] * total
    for hyp, i in zip(hyps, positions, strict=True):
        out[i] = hyp
    return out


def translate(
    model: M2M100Translation,
    tokenizer: TextTokenizer,
    sources: Sequence[str],
    src_lang: str,
    tgt_lang: str,
    settings: SearchSettings,
    batch_size: int = 32,
    max_source_length: int | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> list[str]:
    """Translate `sources` from `src_lang` to `tgt_lang` (see `build_batches`, `translate_batches`;
    `on_batch` gets each decoded batch's sentence count); a blank source gets "".

    Returns:
        One hypothesis per source, in order.
    """
    texts, positions = without_blanks(sources)
    if not texts:
        return [""] * len(sources)
    batches = build_batches(tokenizer, texts, src_lang, tgt_lang, batch_size, max_source_length)
    return with_blanks(
        translate_batches(model, batches, tokenizer, settings, on_batch), positions, len(sources)
    )


class Translator(Protocol):
    """Translates one direction's sources; None on ranks that do not hold the hypotheses.

    Every rank that takes part in a distributed translator must call it with the same
    arguments in the same order (`score_directions` does).
    """

    def __call__(self, sources: Sequence[str], src_lang: str, tgt_lang: str) -> list[str] | None: ...


def evaluate_directions(
    model: M2M100Translation,
    eval_sets: Iterable[EvalSet],
    tokenizer: TextTokenizer,
    num_beams: int = 4,
    max_length: int = 128,
    batch_size: int = 32,
    max_source_length: int | None = None,
    num_samples: int = 3,
    spbleu: bool = False,
) -> dict[str, Any]:
    """Translate every direction with the full model on one device and score it (`score_directions`).

    Args:
        model: the full model (its train/eval mode is restored afterwards).
        eval_sets: one per direction; directions with no sentences are skipped.
        tokenizer: see `TextTokenizer`.
        num_beams, max_length: decoding (see `translate_batches`).
        batch_size, max_source_length: batching (see `build_batches`).
        num_samples: first sentences of each direction to return as samples.
        spbleu: also spBLEU (see `score_directions`).

    Returns:
        See `score_directions`.
    """
    settings = SearchSettings(num_beams=num_beams, max_length=max_length)

    def translator(sources: Sequence[str], src_lang: str, tgt_lang: str) -> list[str]:
        return translate(
            model, tokenizer, sources, src_lang, tgt_lang, settings, batch_size, max_source_length
        )

    return score_directions(translator, eval_sets, num_samples, spbleu)


def score_directions(
    translator: Translator, eval_sets: Iterable[EvalSet], num_samples: int = 3, spbleu: bool = False
) -> dict[str, Any]:
    """Translate and score every direction.

    The overall `eval_bleu`, `eval_chrf`, ... are the mean over directions (macro average):
    a corpus score over all directions pooled would mix BLEU tokenizers (zh vs 13a) and
    let the largest direction dominate.

    Args:
        translator: one device's (`evaluate_directions`) or the 3D mesh's
            (`trainer.eval.runner`); directions it returns None for are not scored.
        eval_sets: one per direction; directions with no sentences are skipped.
        num_samples: first sentences of each direction to return as samples.
        spbleu: also spBLEU (`trainer.eval.metrics`; the caller has checked its model is here).

    Returns:
        `eval_<metric>` and `eval_<metric>_<src>-<tgt>` (floats) for each metric of
        `trainer.eval.metrics.metric_names(spbleu)` (`eval_bleu`, `eval_chrf`, `eval_chrf++`,
        `eval_spbleu`), and under `SAMPLES_KEY` a list of `Sample`s; with no sentences (or no
        hypotheses on this rank), only `[]` samples.

    Raises:
        trainer.eval.metrics.SpBleuModelMissingError: spbleu without its model.
    """
    result: dict[str, Any] = {}
    samples: list[Sample] = []
    per_direction: list[dict[str, float]] = []
    for es in eval_sets:
        src, tgt = es.direction
        name = f"{src}-{tgt}"
        if not es.sources:
            logger.warning("evaluation: direction %s has no sentences; skipped", name)
            continue
        hyps = translator(es.sources, src, tgt)
        if hyps is None:
            continue
        scores = compute_metrics(hyps, es.references, tgt, spbleu)
        per_direction.append(scores)
        result.update((f"eval_{metric}_{name}", value) for metric, value in scores.items())
        rows = zip(es.sources[:num_samples], es.references[:num_samples], hyps[:num_samples])
        samples.extend(Sample(name, s, r, h) for s, r, h in rows)
    if per_direction:
        for metric in metric_names(spbleu):
            result[f"eval_{metric}"] = sum(d[metric] for d in per_direction) / len(per_direction)
    result[SAMPLES_KEY] = samples
    return result
