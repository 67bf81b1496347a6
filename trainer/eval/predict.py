"""do_predict: translate the test data per direction on the 3D model, write predictions and scores.

The test data is `test_file` when set, else the `test` split of `dataset_name` (a `datasets`
name, a local directory of data files or one written by `save_to_disk`, or the builtin corpus).

    output_dir/predictions_<src>-<tgt>.txt   one hypothesis per kept test pair, in file order
    output_dir/generated_predictions.txt     the same, for a one-direction run (run_translation's name)
    output_dir/predict_results.json          predict_loss, predict_bleu, predict_chrf, predict_chrf++
                                             (predict_spbleu with eval_spbleu; macro over directions)
                                             and per direction, predict_samples, skipped

Every test line with a source text is translated, in file order, so the predictions file has
one line per test line: sources longer than max_source_length are truncated (never skipped,
whatever `skip_long_examples` says), an empty reference scores against the empty string, and
only max_predict_samples caps a direction (`skipped` in predict_results.json counts lines
without a source, and truncations). Decoding
and loss are the evaluation's (`trainer.eval.runner.Evaluator`: pipeline_generate
on the mesh, dp replicas sharing the batches); only the logging rank writes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from trainer.config.schema import JobConfig
from trainer.data.batching import eval_batches
from trainer.data.sources import RawDatasets, load_test_pairs
from trainer.data.tokenization import TranslationData, tokenize_pairs
from trainer.eval.decode import SAMPLES_KEY, DirectionTexts, score_directions
from trainer.eval.runner import Evaluator
from trainer.tokenizer.vocab import Tokenizer

if TYPE_CHECKING:
    from trainer.run.setup import RunContext


def load_test_data(cfg: JobConfig, tok: Tokenizer, raw: RawDatasets | None = None) -> TranslationData:
    """The test pairs per direction (`raw`, or read by `load_test_pairs`), tokenized with texts
    kept (as validation data is)."""
    raw = raw or load_test_pairs(cfg.data, cfg.training.seed)
    skipped = {k: dict(v) for k, v in raw.skipped.items()}
    test = {
        name: tokenize_pairs(ds, tok, cfg.data, f"test:{name}", skipped, keep_text=True, skip_long=False)
        for name, ds in raw.validation.items()
    }
    return TranslationData(None, test, skipped)


def predict_test_set(ctx: RunContext) -> dict[str, Any]:
    """Translate and score the test file on the mesh; write the files (collective).

    Args:
        ctx: the run's `trainer.run.setup.RunContext` (model, mesh, tokenizer, config, log rank, out).

    Returns:
        The predict_results.json content on the logging rank ({} elsewhere).
    """
    cfg, out = ctx.cfg, ctx.out
    data = load_test_data(cfg, ctx.tok, ctx.test_raw)
    batches = eval_batches(data, ctx.tok, cfg.training.per_device_eval_batch_size)
    runner = Evaluator(ctx.pm, ctx.mesh, ctx.tok, batches, cfg.training, ctx.log_rank)
    runner.pm.model.eval()
    hyps: dict[str, list[str]] = {}

    def translate(sources: Sequence[str], src_lang: str, tgt_lang: str) -> list[str] | None:
        got = runner.translate_3d(sources, src_lang, tgt_lang)
        if got is not None:
            hyps[f"{src_lang}-{tgt_lang}"] = got
        return got

    texts = [  # file order (the batches are length-sorted; translate_3d returns hypotheses in input order)
        DirectionTexts(tuple(name.split("-", 1)), ds["source"], ds["target"])  # type: ignore[arg-type]
        for name, ds in data.validation.items()
    ]
    with ctx.pm.evaluating():  # the run's precision; one fsdp gather for loss and decoding
        metrics: dict[str, Any] = runner.losses()
        metrics.update(score_directions(translate, texts, spbleu=cfg.training.eval_spbleu))
    samples = metrics.pop(SAMPLES_KEY, [])
    runner.pm.model.train()
    result: dict[str, Any] = {}
    if dist.get_rank() == ctx.log_rank:
        result = {k.replace("eval_", "predict_", 1): v for k, v in metrics.items()}
        result["predict_samples"] = {name: len(ds) for name, ds in data.validation.items()}
        result["skipped"] = data.skipped
        result["samples"] = [list(s) for s in samples]
        write_predictions(out, hyps, result)
    dist.barrier()
    return result


def write_predictions(out: Path, hyps: dict[str, list[str]], result: dict[str, Any]) -> None:
    """predictions_<direction>.txt per direction (and generated_predictions.txt for one), the results."""
    for name, lines in hyps.items():
        text = "".join(line.replace("\n", " ") + "\n" for line in lines)
        (out / f"predictions_{name}.txt").write_text(text)
        if len(hyps) == 1:
            (out / "generated_predictions.txt").write_text(text)
    (out / "predict_results.json").write_text(json.dumps(result, indent=1))
