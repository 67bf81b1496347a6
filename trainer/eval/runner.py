"""Evaluation during training: loss through the parallel model, BLEU/chrF by generation.

`eval_loss` runs the pipeline's forward-only schedule over the validation batches
on every rank (tensor-parallel, vocab-parallel loss), so it is exactly the
model the optimizer trains. Translation for BLEU/chrF also runs on the 3D model
as it is (`parallel.generate.pipeline_generate`: per-stage KV caches, tp layers),
so no rank ever holds more than its own shard of the weights:

    dp replica r decodes batches r, r + dp, ... of each direction (with experts spread over
    ep, the ep replicas of an expert group decode the same batches together: edp replica r
    takes batches r, r + edp, ...; `parallel.generate`) (length-sorted
    batches from `build_batches`, so the replicas get similar work) on its pp x tp
    slice; the last stage's tp-0 rank of each replica holds the token ids of its
    batches; they are gathered (ids, not weights) to the logging rank, which
    detokenizes and scores them. The batches are those single-device evaluation
    decodes, so the hypotheses, and BLEU, are the same.

`translate_on_mesh` is that decoding on its own, for any destination rank
(`python -m trainer.translate` under torchrun gathers to rank 0).

(Before, the logging rank gathered a single-device copy of the weights and decoded
alone, which fails for models that do not fit one device.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch.distributed as dist

from models.generate import SearchSettings
from parallel.generate import pipeline_generate
from parallel.mesh import ParallelMesh
from parallel.parallelize import ParallelModel
from trainer.config.training_args import TrainingArguments
from trainer.data.batching import EvalBatch
from trainer.eval.decode import (
    SAMPLES_KEY,
    DirectionTexts,
    TextTokenizer,
    build_batches,
    hypotheses_in_order,
    score_directions,
    with_blanks,
    without_blanks,
)
from trainer.progress import Progress
from trainer.tokenizer.vocab import Tokenizer


class Evaluator:
    """Runs evaluation at a step; the returned metrics are meaningful on the logging rank."""

    def __init__(
        self,
        pm: ParallelModel,
        mesh: ParallelMesh,
        tokenizer: Tokenizer,
        batches: dict[str, list[EvalBatch]],
        args: TrainingArguments,
        log_rank: int,
    ) -> None:
        self.pm, self.mesh, self.tok, self.batches = pm, mesh, tokenizer, batches
        self.args, self.log_rank = args, log_rank
        self.device = next(pm.model.parameters()).device
        self.texts = [
            DirectionTexts(
                (d.split("-", 1)[0], d.split("-", 1)[1]),
                [s for b in bs for s in b.sources],  # type: ignore[arg-type]
                [r for b in bs for r in b.references],
            )
            for d, bs in batches.items()
            if bs
        ]

    def progress(self, total: int, what: str, step: int, unit: str) -> Progress:
        """The logging rank's bar (lines with disable_tqdm) over one part of the evaluation at `step`."""
        return Progress(
            total, f"eval {what} step {step}", unit, enabled=dist.get_rank() == self.log_rank,
            bar=not self.args.disable_tqdm, leave=False,
        )  # fmt: skip

    def translated_here(self) -> int:
        """Sentences this rank's replica decodes over every direction."""
        size = self.args.per_device_eval_batch_size
        return sum(replica_share(len(t.sources), size, self.mesh) for t in self.texts)

    def losses(self, step: int = 0) -> dict[str, float]:
        out: dict[str, float] = {}
        total, count = 0.0, 0
        with self.progress(sum(1 for bs in self.batches.values() if bs), "loss", step, "dir") as bar:
            for direction, batches in self.batches.items():
                if not batches:
                    continue
                s, n = self.pm.eval_loss([b.batch.to(self.device) for b in batches])
                if n:
                    out[f"eval_loss_{direction}"] = s / n
                total, count = total + s, count + n
                bar.update(1, direction=direction)
        if count:
            out["eval_loss"] = total / count
        return out

    def run(self, step: int, tracker: Any = None) -> dict[str, Any]:
        """Loss and BLEU/chrF/chrF++ (spBLEU) in the run's precision (`ParallelModel.evaluating`: one
        gather under fsdp, one cast with bf16_full_eval, for the whole evaluation). Collective.

        The logging rank shows a bar for each part (the loss per direction, then the sentences
        its replica translates), or with `disable_tqdm` a line every 30 s of a long evaluation.
        """
        self.pm.model.eval()
        with self.pm.evaluating():
            metrics: dict[str, Any] = self.losses(step)
            if self.texts:
                with self.progress(self.translated_here(), "translate", step, "sent") as bar:
                    result = score_directions(
                        partial(self.translate_3d, bar=bar), self.texts, spbleu=self.args.eval_spbleu
                    )
                samples = result.pop(SAMPLES_KEY, [])
                if dist.get_rank() == self.log_rank:
                    metrics.update(result)
                    if tracker is not None:
                        tracker.log_samples(step, [tuple(s) for s in samples])
        dist.barrier()
        self.pm.model.train()
        return metrics

    def translate_3d(
        self, sources: Sequence[str], src_lang: str, tgt_lang: str, bar: Progress | None = None
    ) -> list[str] | None:
        """Collective: `translate_on_mesh` with the run's generation settings; the hypotheses on
        the logging rank, None elsewhere. `bar` counts the sentences decoded."""
        a = self.args
        settings = SearchSettings(num_beams=a.generation_num_beams, max_length=a.generation_max_length)
        direction = f"{src_lang}-{tgt_lang}"
        return translate_on_mesh(
            self.pm,
            self.tok,
            sources,
            src_lang,
            tgt_lang,
            settings,
            a.per_device_eval_batch_size,
            self.log_rank,
            on_batch=None if bar is None else lambda n: bar.update(n, direction=direction),
        )


def replica_share(n: int, batch_size: int, mesh: ParallelMesh) -> int:
    """Of `n` sentences, those this rank's replica decodes in `translate_on_mesh`: batches edp_rank,
    edp_rank + edp, ... of `build_batches`' (all full but the last)."""
    batches = range(mesh.edp_rank, math.ceil(n / batch_size), mesh.size("edp"))
    return sum(min(batch_size, n - i * batch_size) for i in batches)


def translate_on_mesh(
    pm: ParallelModel,
    tokenizer: TextTokenizer,
    sources: Sequence[str],
    src_lang: str,
    tgt_lang: str,
    settings: SearchSettings,
    batch_size: int,
    dst: int,
    max_source_length: int | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> list[str] | None:
    """Translate on the 3D model, dp replicas sharing the batches (see the module docstring).

    Collective over the whole world: every rank calls it with the same arguments. The
    batches are `build_batches`' (those single-device `trainer.eval.decode.translate` decodes),
    so the hypotheses are the single-device ones.

    Args:
        pm: this rank's parallel model, in eval mode.
        tokenizer: see `TextTokenizer`.
        sources: source sentences; src_lang, tgt_lang: their language codes.
        settings: num_beams, max_length, ...
        batch_size, max_source_length: batching (see `build_batches`).
        dst: the global rank that gets the hypotheses.
        on_batch: called with the sentences this rank's replica has decoded, after each of its
            batches (a progress bar; the other replicas decode as many, give or take a batch).

    Returns:
        One hypothesis per source, in order, on rank `dst`; None on the other ranks.
    """
    mesh = pm.mesh
    texts, positions = without_blanks(sources)  # a blank source: "" (decoded, a made-up sentence)
    batches = build_batches(tokenizer, texts, src_lang, tgt_lang, batch_size, max_source_length)
    outputs = []
    # FSDP: one gather (a dp collective) for all of this replica's batches, whose count may
    # differ between replicas, and one cast (bf16_full_eval); pipeline_generate's nest in it.
    # Expert parallelism: the ep peers decode the same batches (one replica per edp rank).
    with pm.evaluating():
        for batch in batches[mesh.edp_rank :: mesh.size("edp")]:
            ids = pipeline_generate(
                pm, batch.input_ids, batch.attention_mask, batch.forced_bos_token_id, settings
            )
            if ids is not None and mesh.tp_rank == 0 and mesh.ep_rank == 0:
                outputs.append((batch.index, ids.tolist()))
            if on_batch is not None:
                on_batch(len(batch.index))
    if dist.get_world_size() == 1:
        return with_blanks(hypotheses_in_order(outputs, tokenizer), positions, len(sources))
    got: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(outputs, got, dst=dst)
    if got is None:
        return None
    hyps = hypotheses_in_order((o for part in got for o in part), tokenizer)
    return with_blanks(hyps, positions, len(sources))
