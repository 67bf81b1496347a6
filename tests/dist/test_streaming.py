"""Streaming data through the real trainer: the contracts of the map-style path still hold.

On a sharded JSON-lines corpus of `multi30k`'s text (`scripts/make_sharded_corpus.py`) with
`streaming: true`: one process (in-process reading), dp=2 and pp=2 x dp=2 (one data-loader worker
per rank) train on the same global batches, so their losses match within 1e-5 relative (fp32,
dropout 0); a run saved on dp=2 resumes on dp=1 and continues the uninterrupted run's losses; and a
rank killed with SIGKILL under `torchrun --max-restarts 1` resumes from the last checkpoint and
logs exactly the uninterrupted run's steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.dist.harness import TRAINER_PRELOAD, free_port, run_distributed
from tests.dist.test_multinode import TwoNodes, _env, _torchrun
from tests.dist.test_restart import _rows_by_step
from tests.dist.train_workers import base_config, train_cases
from tests.dist.train_workers import mesh_overrides as mesh
from tests.served import Served

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
PAIRS = ["en-de", "de-en", "en-fr", "fr-en"]
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, multi30k: Path) -> str:
    from scripts.make_sharded_corpus import write_corpus

    out = tmp_path_factory.mktemp("corpus")
    write_corpus(out, 4000, multi30k, n_directions=20, shard_pairs=100, compress=False)  # 200 shards, 2 per direction
    return str(out / "train-*.jsonl")


def _stream(tmp: str, corpus: str, **extra: Any) -> dict[str, Any]:
    return base_config(
        tmp, dataset_name=None, train_file=corpus, streaming=True, language_pairs=PAIRS,
        spm_input_sentence_size=4000, max_steps=6, **extra,
    )  # fmt: skip


def _close(ref: list, got: list) -> list[str]:
    bad = []
    for (s, loss, gn), (s2, loss2, gn2) in zip(ref, got):
        if s != s2 or abs(loss - loss2) > TOL * abs(loss) or abs(gn - gn2) > 1e-4 * abs(gn):
            bad.append(f"step {s}: loss {loss} vs {loss2}, grad_norm {gn} vs {gn2}")
    return bad


def test_meshes_train_on_the_same_stream(tmp_path: Path, corpus: str) -> None:
    tmp = str(tmp_path)
    [ref] = run_distributed(train_cases, 1, args=(_stream(tmp + "/one", corpus), [mesh()]), timeout=300)
    tokenizer = f"{tmp}/one/run-0/tokenizer"
    cases = {"dp2": mesh(dp=2, dataloader_num_workers=1)}
    two = run_distributed(
        train_cases, 2, args=(_stream(tmp + "/two", corpus, tokenizer_name=tokenizer), list(cases.values())),
        timeout=400, collective_timeout=200, preload=TRAINER_PRELOAD,
    )  # fmt: skip
    four = run_distributed(
        train_cases, 4,
        args=(_stream(tmp + "/four", corpus, tokenizer_name=tokenizer),
              [mesh(pp=2, dp=2, m=2, dataloader_num_workers=1)]),
        timeout=500, collective_timeout=300, preload=TRAINER_PRELOAD,
    )  # fmt: skip
    got = {"dp2": next(r[0] for r in two if r[0]), "pp2-dp2": next(r[0] for r in four if r[0])}
    reference = ref[0]
    assert [s for s, _, _ in reference] == [1, 2, 3, 4, 5, 6]
    for name, hist in got.items():
        assert len(hist) == 6, name
        worst = max(abs(a[1] - b[1]) / abs(a[1]) for a, b in zip(reference, hist))
        print(f"streaming {name} vs one process: max relative loss difference {worst:.2e} over 6 steps")
        assert not _close(reference, hist), (name, _close(reference, hist))


def _save_then_resume(rank: int, world: int, base: dict[str, Any]) -> Any:
    from trainer.config.parse import load_config_dict
    from trainer.run.loop import run

    summary = run(load_config_dict(base))
    return [(r["step"], r["loss"], r["grad_norm"]) for r in summary.get("history", []) if "loss" in r]


def test_resume_on_another_dp_size(tmp_path: Path, corpus: str) -> None:
    """dp=2 (one worker per rank) saves at step 3; dp=1 (in-process reading) resumes there."""
    tmp = str(tmp_path)
    base = _stream(tmp, corpus, save_steps=3)
    straight = run_distributed(
        train_cases, 2, args=(base, [mesh(dp=2, dataloader_num_workers=1)]), timeout=400, collective_timeout=200,
        preload=TRAINER_PRELOAD,
    )  # fmt: skip
    reference = next(r[0] for r in straight if r[0])
    first = f"{tmp}/run-0"
    assert (
        json.loads((Path(first) / "checkpoint-3" / "trainer_state.json").read_text())["data"]["served"] >= 0
    )
    resumed = {
        **base,
        **mesh(),
        "resume_from_checkpoint": f"{first}/checkpoint-3",
        "output_dir": f"{tmp}/resumed",
    }
    [hist] = run_distributed(_save_then_resume, 1, args=(resumed,), timeout=300)
    assert [s for s, _, _ in hist] == [4, 5, 6]
    assert not _close(reference[3:], hist), _close(reference[3:], hist)


def test_killed_rank_resumes_the_stream_exactly(served: Served, tmp_path: Path, corpus: str) -> None:
    """SIGKILL of rank 1 as step 5 begins (its data worker dies with it): the restarted group
    resumes the stream from checkpoint-3 and logs the uninterrupted run's steps exactly."""
    args = ["--config", "configs/tiny.yaml", "--dataset_name", "null", "--train_file", corpus,
            "--streaming", "true", "--language_pairs", *PAIRS, "--spm_input_sentence_size", "4000",
            "--dataloader_num_workers", "1", "--do_eval", "false", "--plots", "false", "--data_parallel_size", "2",
            "--per_device_train_batch_size", "4", "--max_steps", "7", "--save_steps", "3",
            "--resume_from_checkpoint", "latest", "--dropout", "0", "--attention_dropout", "0",
            "--activation_dropout", "0"]  # fmt: skip
    outs = {name: tmp_path / name for name in ("reference", "killed")}

    def torchrun(out: Path, max_restarts: int) -> list[str]:
        return [_torchrun(served), "--nproc-per-node", "2", "--max-restarts", str(max_restarts), "--rdzv-backend",
                "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "trainer.train", *args,
                "--output_dir", str(out)]  # fmt: skip

    fault = {"TRAINER_FAULT_INJECT": "kill:rank=1:step=5"}
    jobs = TwoNodes(
        [torchrun(outs["reference"], 0), torchrun(outs["killed"], 1)], [_env(served), _env(served, **fault)], tmp_path
    ).run(400)
    assert jobs.ok, jobs.report()
    reference = _rows_by_step(outs["reference"])
    assert sorted(reference) == list(range(1, 8)), jobs.report()
    log = jobs.output(1)
    assert "exitcode: -9" in log, jobs.report()
    assert f"resuming from {outs['killed'] / 'checkpoint-3'}" in log, log[-6000:]
    assert _rows_by_step(outs["killed"]) == reference
