"""Ranks share one tokenization: rank 0 builds the on-disk cache, the others load it after one
collective; a failure on rank 0 (tokenizing, or measuring blocks for balancing) reaches every rank
as one error instead of a hang at a barrier."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.corpus_data import read_lines
from tests.dist.harness import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]



def share_tokenization(rank: int, world: int, text_dir: str, out: str) -> dict[str, Any]:
    import datasets

    import trainer.data.tokenization as data_module
    import trainer.run.data as train_module
    from trainer.config.parse import load_config_dict
    from trainer.data.sources import load_raw_datasets
    from trainer.tokenizer.vocab import Tokenizer

    datasets.disable_progress_bars()
    cfg = load_config_dict({"train_file": f"{text_dir}/train.{{lang}}.gz", "language_pairs": ["en-de", "de-en"],
                            "output_dir": out, "max_source_length": 24})  # fmt: skip
    calls = [0]
    real = data_module._tokenize_batch

    def counting(*a: Any, **kw: Any) -> Any:
        calls[0] += 1
        return real(*a, **kw)

    data_module._tokenize_batch = counting
    tok = Tokenizer.load(Path(text_dir) / "tokenizer", ["de", "en"])
    raw = load_raw_datasets(cfg.data, 0)
    data = train_module.tokenize_shared(cfg, raw, tok, Path(out), rank)
    res: dict[str, Any] = {"calls": calls[0], "rows": data.train[:]["input_ids"], "skipped": data.skipped}

    if rank == 0:  # rank 0 alone fails (e.g. its disk is full): the others must not wait for it

        def fail(*a: Any, **kw: Any) -> Any:
            raise OSError("No space left on device")

        train_module.tokenize_datasets = fail  # type: ignore[assignment]
    try:
        train_module.tokenize_shared(cfg, raw, tok, Path(out) / "other", rank)
        res["error"] = None
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
    res["balance_error"] = _balancing_fails_on_rank0(cfg)
    return res


class _OutOfMemorySampler:
    """A sampler whose first batch cannot be made: rank 0's block measurement fails."""

    def peek(self) -> Any:
        raise MemoryError("cannot allocate the sample micro-batch")


def _balancing_fails_on_rank0(cfg: Any) -> str:
    """`partition_method: time` measures on rank 0 alone; its failure must raise on every rank."""
    import dataclasses

    from models.config import ModelConfig
    from parallel.mesh import ParallelDims, build_mesh
    from trainer.run.balance import choose_partition

    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, partition_method="time"))
    mesh = build_mesh(ParallelDims(pp=2, dp=1, tp=1, world_size=2), "cpu")
    mc = ModelConfig(vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)  # fmt: skip
    try:
        choose_partition(cfg, mc, mesh, _OutOfMemorySampler(), torch.device("cpu"))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_rank0_tokenizes_the_others_load(tmp_path: Path, multi30k: Path) -> None:
    from trainer.tokenizer.vocab import train_tokenizer

    lines = {}
    for lang in ("de", "en"):
        lines[lang] = read_lines(multi30k, "train", lang, 800)
        with gzip.open(tmp_path / f"train.{lang}.gz", "wt", encoding="utf-8") as g:
            g.write("\n".join(lines[lang]) + "\n")
    texts = [t.strip() for v in lines.values() for t in v]
    train_tokenizer(texts, ["de", "en"], 600, seed=0).save(tmp_path / "tokenizer")
    r0, r1 = run_distributed(share_tokenization, 2, args=(str(tmp_path), str(tmp_path / "out")), timeout=240)
    assert r0["calls"] > 0 and r1["calls"] == 0  # rank 1 loaded rank 0's Arrow files
    assert r0["rows"] == r1["rows"] and r0["skipped"] == r1["skipped"]
    assert any((tmp_path / "out" / "data_cache").glob("tokenized-*.arrow"))
    assert r0["error"] == "OSError: No space left on device"
    # not bad input: the others raise it as an internal error (a traceback, exit 1), not as a DataError
    assert r1["error"] == "RuntimeError: rank 0 could not tokenize the data: OSError: No space left on device"
    # so does a failure measuring the blocks for `partition_method: time` (it left rank 1 waiting)
    assert r0["balance_error"] == "MemoryError: cannot allocate the sample micro-batch"
    assert r1["balance_error"] == (
        "RuntimeError: rank 0 could not measure the blocks for balancing: MemoryError: cannot allocate the sample micro-batch"
    )


def _slow_rank0(rank: int, world: int) -> str:
    """Rank 0's work outlasts the collective timeout (2 s): the waiting rank names what it waited for."""
    import time

    from trainer.run.rank0 import on_rank0

    try:
        on_rank0(rank, "tokenize the data", lambda: time.sleep(5) if rank == 0 else None, hint="; HINT")
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return "no error"


def test_a_rank_timed_out_waiting_for_rank0_says_what_for() -> None:
    """The story: a map-style corpus large enough that rank 0's tokenization outlasted dist_timeout_s
    killed the other ranks with gloo's bare "Timed out waiting 30000ms for recv operation to complete"."""
    r0, r1 = run_distributed(_slow_rank0, 2, timeout=120, collective_timeout=2, preload=())
    assert r1.startswith("rank 1 timed out waiting for rank 0 to tokenize the data; HINT (")
