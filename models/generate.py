"""Greedy and beam-search decoding for `M2M100Translation`, equal to `transformers`' `generate`.

The encoder runs once; the decoder runs one token per step over a KV cache:
cross-attention keys/values are projected from the encoder output once per layer,
self-attention keys/values are appended each step (`KVCache`).

Outputs follow Hugging Face: each row starts with the decoder start token `</s>`,
then the forced target-language tag, then the translation, `</s>`, and pad.
`max_length` counts all of these, as HF's `GenerationConfig.max_length` does.

Semantics are those of `M2M100ForConditionalGeneration.generate(do_sample=False)`
with `no_repeat_ngram_size=0`, `min_length=0`, `repetition_penalty=1.0` (the
`GenerationConfig` defaults) in transformers 5.x, whose vectorized beam search
(`GenerationMixin._beam_search`, PR #35802) this module ports step for step. Two more
`GenerationConfig` fields are honoured, as HF applies them: `bad_words_ids` of one token
(`SearchSettings.suppress_tokens`: -inf after the log-softmax, before the forced tag) and
`renormalize_logits` (log-softmax again after that); an export in the stock M2M100
vocabulary sets both so that rows the run never trained take no probability
(`trainer.tokenizer.stock_m2m100`).

    step: log-probs (B, K, V) + running scores -> top 2K of K*V candidates
          -> the best K that did not just hit EOS/max_length keep running
          -> those of the top K that did, scored by sum/len**length_penalty,
             compete with the finished hypotheses for the K finished slots.

The search (forced BOS, beam bookkeeping, finished hypotheses) knows nothing of
where the model runs: it drives a `DecoderStep` (ids -> logits, reorder(rows)).
`DecoderState` is the single-device one; `parallel.generate` implements it over
the pipeline stages and tensor-parallel layers of a 3D mesh, with the same
`IncrementalDecoder` per stage, so both produce the same tokens.

Legend: B batch rows, K beams, V vocabulary, N = B*K decoder rows, h heads,
S source length, t tokens decoded so far, d head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from models.config import ModelConfig
from models.m2m100 import BlockKind, BlockSpec, DecoderLayer, KVCache, M2M100Translation, Seq2SeqBatch

KV = tuple[Tensor, Tensor]
# HF's stand-in for "impossible" in beam scores; equal constants keep tie-breaks equal too.
NEG = -1.0e9


class DecoderStep(Protocol):
    """What the search drives: one token per row in, next-token logits out, rows reorderable.

    `DecoderState` runs the whole model on one device; `parallel.generate` runs the
    pipeline stages and tensor-parallel layers of a 3D mesh behind the same interface.
    """

    device: torch.device

    def step(self, ids: Tensor) -> Tensor:  # (N, 1) -> (N, V) float32 logits
        """Feed one token per row and return the next-token logits."""
        ...

    def reorder(self, rows: Tensor) -> None:
        """Keep row `rows[n]` as row n from now on (beam search follows the surviving beams)."""
        ...


DECODER_KINDS = (BlockKind.TGT_EMBED, BlockKind.DEC_LAYER, BlockKind.HEAD)


class IncrementalDecoder:
    """A run of decoder-side blocks (tgt_embed, decoder layers, head) fed one token per step.

    Holds the run's caches: cross-attention k/v projected once from the encoder
    output, and a growing self-attention `KVCache` per layer. The whole decoder on
    one device (`DecoderState`), or one pipeline stage's share of it (`parallel.generate`).

    Args:
        model: a model holding (at least) the given blocks.
        blocks: the blocks to run, in model order; encoder-side blocks are skipped.
        encoder_out: (N, S, H) the encoder output, one row per decoder row.
        src_mask: (N, S) bool, True on real source tokens.
    """

    def __init__(
        self, model: M2M100Translation, blocks: Sequence[BlockSpec], encoder_out: Tensor, src_mask: Tensor
    ) -> None:
        self.model = model
        self.blocks = [b for b in blocks if b.kind in DECODER_KINDS]
        self.layers = {
            b.index: cast(DecoderLayer, model.decoder.layers[str(b.index)])
            for b in self.blocks
            if b.kind is BlockKind.DEC_LAYER
        }
        self.encoder_out = encoder_out  # (N, S, H)
        self.src_mask = src_mask  # (N, S) bool
        self.cross_kv: dict[int, KV] = {
            i: layer.encoder_attn.project_kv(encoder_out) for i, layer in self.layers.items()
        }
        self.self_kv = {i: KVCache() for i in self.layers}
        self.length = 0  # t: tokens already in the self-attention caches

    def forward(self, x: Tensor) -> Tensor:
        """ids (N, 1) if the run starts with tgt_embed, else hidden (N, 1, H) ->
        hidden (N, 1, H), or the head's logits (N, 1, V) (a vocab shard under tp) if it ends with it."""
        model = self.model
        for spec in self.blocks:
            if spec.kind is BlockKind.TGT_EMBED:
                # HF offsets positions by the cache length (`past_key_values_length`): token t sits at pad+1+t.
                x = model.embed(x, offset=self.length)  # (N, 1, H)
            elif spec.kind is BlockKind.DEC_LAYER:
                x = self.layers[spec.index](
                    x,
                    self.encoder_out,
                    self.src_mask,
                    self_cache=self.self_kv[spec.index],
                    cross_kv=self.cross_kv[spec.index],
                )
            else:
                assert model.decoder.layer_norm is not None and model.lm_head is not None
                assert model.shared is not None
                x = model.lm_head(model.decoder.layer_norm(x), model.shared.weight)
        self.length += 1
        return x

    def reorder(self, rows: Tensor) -> None:
        """Keep cache row `rows[n]` as row n."""
        for cache in self.self_kv.values():
            cache.reorder(rows)


class DecoderState:
    """The single-device `DecoderStep`: the whole decoder and head of `model` over N rows."""

    def __init__(self, model: M2M100Translation, encoder_out: Tensor, src_mask: Tensor) -> None:
        self.decoder = IncrementalDecoder(model, model.blocks, encoder_out, src_mask)
        self.device = encoder_out.device

    def step(self, ids: Tensor) -> Tensor:  # (N, 1) -> (N, V) float32 logits
        """Feed one token per row and return the next-token logits."""
        return self.decoder.forward(ids)[:, -1].float()

    def reorder(self, rows: Tensor) -> None:
        """Keep cache row `rows[n]` as row n (beam search follows the surviving beams)."""
        self.decoder.reorder(rows)


@dataclass(frozen=True)
class SearchSettings:
    """How to search; the defaults are `GenerationConfig`'s (see `generate`)."""

    num_beams: int = 1
    max_length: int = 200
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # `bad_words_ids` of one token: never generated (the forced tag excepted, as in HF, where
    # `ForcedBOSTokenLogitsProcessor` runs after `NoBadWordsLogitsProcessor`)
    suppress_tokens: tuple[int, ...] = ()
    renormalize_logits: bool = False  # log-softmax again after suppression (HF's `LogitNormalization`)

    def validate(self) -> SearchSettings:
        """Raises ValueError on num_beams < 1 or max_length < 2; returns self."""
        if self.num_beams < 1:
            raise ValueError(f"num_beams={self.num_beams} must be >= 1")
        if self.max_length < 2:
            raise ValueError(f"max_length={self.max_length} must be >= 2 (start token + one generated token)")
        return self


@dataclass(frozen=True)
class Special:
    """Token ids the search needs; `forced` is per row (N,) or None for no forcing."""

    start: int
    eos: int
    pad: int
    forced: Tensor | None


def suppress(scores: Tensor, settings: SearchSettings, renormalize: bool) -> Tensor:
    """HF's `NoBadWordsLogitsProcessor` for one-token words (-inf), then, if `renormalize` and
    `settings.renormalize_logits`, its `LogitNormalization` (a log-softmax over what is left)."""
    if not settings.suppress_tokens:
        return scores
    scores = scores.index_fill(
        -1, torch.tensor(settings.suppress_tokens, device=scores.device), -float("inf")
    )
    return F.log_softmax(scores, dim=-1) if renormalize and settings.renormalize_logits else scores


def force_bos(scores: Tensor, forced: Tensor | None, cur_len: int) -> Tensor:
    """HF's `ForcedBOSTokenLogitsProcessor`, per row: at length 1 only the tag is possible (score 0)."""
    if forced is None or cur_len != 1:
        return scores
    out = torch.full_like(scores, -float("inf"))
    out.scatter_(1, forced.view(-1, 1), 0.0)
    return out


def greedy_search(state: DecoderStep, special: Special, batch_size: int, settings: SearchSettings) -> Tensor:
    """Argmax decoding; rows that emitted EOS are padded until all rows are done (as HF `_sample`).

    Returns:
        (B, T) token ids, T <= settings.max_length.
    """
    device = state.device
    seqs = torch.full((batch_size, 1), special.start, dtype=torch.long, device=device)
    unfinished = torch.ones(batch_size, dtype=torch.bool, device=device)
    for cur_len in range(1, settings.max_length):
        # A log-softmax would not move the argmax: suppression alone.
        scores = force_bos(suppress(state.step(seqs[:, -1:]), settings, False), special.forced, cur_len)
        tokens = scores.argmax(dim=-1)
        tokens = torch.where(unfinished, tokens, torch.full_like(tokens, special.pad))
        seqs = torch.cat([seqs, tokens[:, None]], dim=1)
        unfinished &= tokens != special.eos
        if not bool(unfinished.any()):
            break
    return seqs


@dataclass
class Beams:
    """Beam-search state; every tensor is (B, K, ...) as in HF's `_beam_search`."""

    running: Tensor  # (B, K, L) running hypotheses, padded to max_length L
    running_scores: Tensor  # (B, K) sum of log-probs
    finished: Tensor  # (B, K, L) best finished hypotheses, best first
    finished_scores: Tensor  # (B, K) length-penalized scores
    finished_lengths: Tensor  # (B, K) tokens in each finished hypothesis (start token included)
    is_finished: Tensor  # (B, K) bool: slot holds a real hypothesis
    improvable: Tensor  # (B, 1) bool: can a running beam still beat the worst finished one?


def init_beams(
    batch_size: int, num_beams: int, max_length: int, special: Special, device: torch.device
) -> Beams:
    # HF fills unwritten positions with `pad_token_id or eos_token_id`.
    fill = special.pad or special.eos
    running = torch.full((batch_size, num_beams, max_length), fill, dtype=torch.long, device=device)
    running[:, :, 0] = special.start
    scores = torch.zeros(batch_size, num_beams, device=device)
    # Only beam 0 is live at first, so the K beams do not all pick the same tokens.
    scores[:, 1:] = NEG
    return Beams(
        running=running,
        running_scores=scores,
        finished=running.clone(),
        finished_scores=torch.full((batch_size, num_beams), NEG, device=device),
        finished_lengths=torch.ones(batch_size, num_beams, dtype=torch.long, device=device),
        is_finished=torch.zeros(batch_size, num_beams, dtype=torch.bool, device=device),
        improvable=torch.ones(batch_size, 1, dtype=torch.bool, device=device),
    )


def gather_beams(x: Tensor, index: Tensor) -> Tensor:  # (B, K, ...) x (B, K') -> (B, K', ...)
    while index.dim() < x.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(x, index, dim=1)


def update_finished(
    beams: Beams,
    cand: Tensor,
    cand_scores: Tensor,
    just_done: Tensor,
    cur_len: int,
    length_penalty: float,
    early_stopping: bool | str,
) -> None:
    """Merge candidates that just finished into the K best finished hypotheses (HF `_update_finished_beams`)."""
    k = beams.running.shape[1]
    # Length counts generated tokens (tag and EOS included), not the start token: HF's
    # `cur_len + 1 - decoder_prompt_len` with a one-token prompt.
    scores = cand_scores / ((cur_len + 1 - 1) ** length_penalty)
    full = beams.is_finished.all(dim=-1, keepdim=True) & (early_stopping is True)
    scores += full.to(torch.float32) * NEG
    scores += (~beams.improvable).to(torch.float32) * NEG
    scores += (~just_done) * NEG
    lengths = torch.full_like(just_done, cur_len + 1, dtype=torch.long)
    merged_scores = torch.cat([beams.finished_scores, scores], dim=1)
    best = torch.topk(merged_scores, k=k)[1]
    beams.finished = gather_beams(torch.cat([beams.finished, cand], dim=1), best)
    beams.finished_scores = gather_beams(merged_scores, best)
    beams.finished_lengths = gather_beams(torch.cat([beams.finished_lengths, lengths], dim=1), best)
    beams.is_finished = gather_beams(torch.cat([beams.is_finished, just_done], dim=1), best)


def still_improvable(
    beams: Beams, cur_len: int, max_length: int, length_penalty: float, early_stopping: bool | str
) -> Tensor:
    """HF `_check_early_stop_heuristic`: can the best running beam still beat the worst finished one?"""
    if early_stopping == "never" and length_penalty > 0.0:
        best_length = max_length - 1
    else:
        best_length = cur_len - 1
    best_running = beams.running_scores[:, :1] / (best_length**length_penalty)
    worst = torch.where(beams.is_finished, beams.finished_scores.min(dim=1, keepdim=True)[0], NEG)
    return beams.improvable & (best_running > worst).any(dim=-1, keepdim=True)


def beam_step(
    beams: Beams, log_probs: Tensor, cur_len: int, max_length: int, special: Special
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Top 2K continuations of all K beams (HF `_get_top_k_continuations`).

    Returns:
        candidates (B, 2K, L), their summed log-probs (B, 2K), their source beam (B, 2K),
        and whether each hit EOS or max_length (B, 2K).
    """
    b, k, v = log_probs.shape
    total = (log_probs + beams.running_scores[:, :, None]).reshape(b, k * v)
    # 2K candidates so that K non-finished ones remain even if the top K all end in EOS.
    cand_scores, flat = torch.topk(total, k=2 * k)
    source = flat // v
    cand = gather_beams(beams.running, source)
    cand[:, :, cur_len] = flat % v
    hits = (cand[:, :, cur_len] == special.eos) | (cur_len + 1 >= max_length)
    return cand, cand_scores, source, hits


def beam_search(state: DecoderStep, special: Special, batch_size: int, settings: SearchSettings) -> Tensor:
    """Beam search over `state`'s B*K rows (row n = batch row n // K, beam n % K).

    Returns:
        (B, T) the best hypothesis of each row, padded to the longest, T <= settings.max_length.
    """
    device = state.device
    b, k, max_length = batch_size, settings.num_beams, settings.max_length
    length_penalty, early_stopping = settings.length_penalty, settings.early_stopping
    beams = init_beams(b, k, max_length, special, device)
    # Only the K best candidates may finish; the other K are spares that keep K beams running.
    top_k_mask = torch.arange(2 * k, device=device) < k
    row_offset = torch.arange(b, device=device)[:, None] * k  # (B, 1)
    for cur_len in range(1, max_length):
        logits = state.step(beams.running[:, :, cur_len - 1].reshape(b * k, 1))
        log_probs = suppress(F.log_softmax(logits, dim=-1), settings, True)
        log_probs = force_bos(log_probs, special.forced, cur_len).view(b, k, -1)
        cand, cand_scores, source, hits = beam_step(beams, log_probs, cur_len, max_length, special)

        # Next running beams: the best K candidates that did not just finish.
        live_scores = cand_scores + hits.to(torch.float32) * NEG
        keep = torch.topk(live_scores, k=k)[1]
        beams.running = gather_beams(cand, keep)
        beams.running_scores = gather_beams(live_scores, keep)
        update_finished(beams, cand, cand_scores, hits & top_k_mask, cur_len, length_penalty, early_stopping)
        state.reorder((gather_beams(source, keep) + row_offset).reshape(-1))

        beams.improvable = still_improvable(beams, cur_len + 1, max_length, length_penalty, early_stopping)
        all_full = bool(beams.is_finished.all()) and early_stopping is True
        if not bool(beams.improvable.any()) or all_full or bool(hits.all()):
            break
    length = int(beams.finished_lengths[:, 0].max())
    return beams.finished[:, 0, :length]


def as_row_tensor(forced_bos_token_id: int | Sequence[int] | Tensor | None, batch_size: int) -> Tensor | None:
    """The forced target tag of each row, (B,) long, or None.

    Raises:
        ValueError: a per-row list whose length is not the batch size.
    """
    if forced_bos_token_id is None:
        return None
    if isinstance(forced_bos_token_id, int):
        return torch.full((batch_size,), forced_bos_token_id, dtype=torch.long)
    forced = torch.as_tensor(forced_bos_token_id, dtype=torch.long).reshape(-1)
    if forced.numel() != batch_size:
        raise ValueError(
            f"forced_bos_token_id has {forced.numel()} entries; expected one per row ({batch_size})"
        )
    return forced


def special_tokens(
    config: ModelConfig,
    forced_bos_token_id: int | Sequence[int] | Tensor | None,
    batch_size: int,
    num_beams: int,
    device: torch.device,
) -> Special:
    """The search's token ids, the forced tag repeated for the K beams of each row.

    Raises:
        ValueError: a per-row tag list whose length is not the batch size.
    """
    forced = as_row_tensor(forced_bos_token_id, batch_size)
    if forced is not None:
        forced = forced.to(device).repeat_interleave(num_beams)
    return Special(
        start=config.decoder_start_token_id, eos=config.eos_token_id, pad=config.pad_token_id, forced=forced
    )


def search(state: DecoderStep, special: Special, batch_size: int, settings: SearchSettings) -> Tensor:
    """Greedy search if `settings.num_beams` is 1, else beam search, over `state`'s B*K rows.

    Returns:
        (B, T) long token ids, T <= settings.max_length.
    """
    if settings.num_beams == 1:
        return greedy_search(state, special, batch_size, settings)
    return beam_search(state, special, batch_size, settings)


@torch.no_grad()
def generate(
    model: M2M100Translation,
    input_ids: Tensor,
    attention_mask: Tensor,
    forced_bos_token_id: int | Sequence[int] | Tensor | None,
    num_beams: int = 1,
    max_length: int = 200,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    suppress_tokens: Sequence[int] = (),
    renormalize_logits: bool = False,
) -> Tensor:
    """Translate a padded batch, as `M2M100ForConditionalGeneration.generate(do_sample=False)`.

    Args:
        model: the full model (all blocks), normally in eval mode (dropout applies otherwise).
        input_ids: (B, S) `__src__ tokens </s>` right-padded with pad_token_id.
        attention_mask: (B, S) 1 on real tokens, 0 on padding.
        forced_bos_token_id: target-language tag forced at step 1: one id for all rows,
            or one per row so that a batch can mix target languages; None forces nothing.
        num_beams: 1 for greedy search, K > 1 for beam search.
        max_length: most tokens per output row, the start token and tag included.
        length_penalty: beam scores are sum(log p) / length**length_penalty.
        early_stopping: True stops a row once K hypotheses are finished; False (the
            `GenerationConfig` default) stops once no running beam can beat them by
            HF's heuristic; "never" uses max_length in that heuristic.
        suppress_tokens: ids never generated (but forced), as one-token `bad_words_ids`.
        renormalize_logits: beam scores are log-probabilities over the ids not suppressed
            (`GenerationConfig.renormalize_logits`).

    Returns:
        (B, T) long token ids: `</s> __tgt__ tokens </s>` then pad, T <= max_length.

    Raises:
        ValueError: num_beams < 1, max_length < 2, or a per-row tag list of the wrong length.
    """
    settings = SearchSettings(
        num_beams, max_length, length_penalty, early_stopping, tuple(suppress_tokens), renormalize_logits
    ).validate()
    b = int(input_ids.shape[0])
    special = special_tokens(model.config, forced_bos_token_id, b, num_beams, input_ids.device)
    empty = input_ids[:, :0]
    encoder_out = model.encode(Seq2SeqBatch(input_ids, attention_mask, empty, empty))  # (B, S, H)
    # Beams of a row sit next to each other: row n of the decoder is (n // K, n % K), as in HF.
    encoder_out = encoder_out.repeat_interleave(num_beams, dim=0)
    src_mask = attention_mask.bool().repeat_interleave(num_beams, dim=0)
    return search(DecoderState(model, encoder_out, src_mask), special, b, settings)
