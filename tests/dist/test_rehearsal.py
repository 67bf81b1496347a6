"""Every shipped config, rehearsed end to end on CPU (issue 23, item 7).

Each `configs/*.yaml` (found here, so a new config is rehearsed without an entry) runs with its
own flags and only its sizes cut (`tests/dist/rehearsal.py` derives the cut from the file): on the
mesh it names (pp and virtual stages kept, tp / dp cut to fit 8 ranks), with its schedule, remat,
partition method, dp sharding, precision, sequence parallelism, LayerDrop, experts, evaluation and
save strategies. The rehearsal, as a user lives it on the first day:

1. train with evaluation (before training and at the end), saving every 2 steps (async where the
   config asks); rank 0 gets SIGTERM as it begins step 3 (`TRAINER_FAULT_INJECT=term:rank=0:step=3`):
   the run must end preempted (exit 75 under torchrun) with checkpoint-3 committed;
2. `--resume_from_checkpoint latest` to the last step: metrics.jsonl holds each step once, with
   `eval_bleu` before and after training;
3. `python -m trainer.export` of the last checkpoint (in the run's precision, several safetensors
   shards) and `python -m trainer.translate` of a few validation sources with it, one process.

Cost: the configs of one world size share one spawned gloo group (the imports are paid once per
rank), the export and translation run in the test process. Each config's wall and CPU seconds
(summed over its ranks) are printed (`-s`) and listed in the table of docs/development.md.
"""

from __future__ import annotations

import io
import json
import math
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.dist.harness import TRAINER_PRELOAD, run_distributed
from tests.dist.rehearsal import (
    BUILTIN_SIZE,
    TERM_AT,
    Rehearsal,
    builtin_language,
    make_pretrained,
    plan,
    shipped_configs,
    write_data,
)
from tests.dist.rehearsal_workers import rehearse

pytestmark = pytest.mark.dist


def _groups() -> dict[int, list[str]]:
    by_world: dict[int, list[str]] = defaultdict(list)
    for path in shipped_configs():
        by_world[plan(path, Path("/nonexistent")).world].append(path.stem)
    return dict(sorted(by_world.items(), reverse=True))


GROUPS = _groups()


def _prepare(name: str, tmp: Path) -> Rehearsal:
    r = plan(Path(__file__).resolve().parents[2] / "configs" / f"{name}.yaml", tmp / name)
    write_data(r)
    if r.fine_tune:
        make_pretrained(r)
    return r


def _check_run(r: Rehearsal, result: dict) -> int:
    """The run was preempted at TERM_AT, resumed to its end, evaluated; returns the last step."""
    out = Path(r.flags["output_dir"])
    assert result["preempted_at"] == TERM_AT, (r.name, result)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows if "loss" in row]
    last = result["final_step"]
    assert steps == list(range(1, last + 1)), (r.name, steps)
    if r.evaluates:
        evals = [row["step"] for row in rows if "eval_bleu" in row]
        assert evals[0] == 0 and evals[-1] == last, (r.name, evals)  # before training, at the end
    assert all(math.isfinite(row["loss"]) for row in rows if "loss" in row), r.name
    assert (out / f"checkpoint-{last}" / "COMMITTED").is_file(), r.name
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["mesh"] == r.mesh, (r.name, summary["mesh"], r.mesh)
    return last


def _export_and_translate(r: Rehearsal, last: int) -> list[str]:
    """`trainer.export` then one-process `trainer.translate` in the run's precision."""
    from trainer import export, translate

    out = Path(r.flags["output_dir"])
    hf = out.parent / "hf"
    dtype = {"bfloat16": "bf16", "float16": "fp16", None: "fp32"}[r.half]
    argv = ["--checkpoint", str(out / f"checkpoint-{last}"), "--output", str(hf), "--max_shard_size", "40KB"]
    assert export.main([*argv, "--dtype", dtype]) == 0, r.name
    assert (hf / "model.safetensors.index.json").is_file(), r.name
    src, tgt = r.directions[0]
    sources = _validation_sources(r, src)
    stdout = io.StringIO()
    argv = ["--model", str(hf), "--source_lang", src, "--target_lang", tgt, "--max_length", "12"]
    if r.half:
        argv += ["--dtype", r.half]
    assert translate.main(argv, stdin=io.StringIO("".join(s + "\n" for s in sources)), stdout=stdout) == 0
    lines = stdout.getvalue().splitlines()
    assert len(lines) == len(sources), (r.name, lines)
    return lines


def _validation_sources(r: Rehearsal, lang: str, n: int = 4) -> list[str]:
    """A few validation sentences in `lang`: the config's file, else the built-in corpus's split."""
    valid = r.flags.get("validation_file")
    if valid:
        rows = [json.loads(x)["translation"] for x in Path(valid).read_text().splitlines() if x]
        return [row[lang] for row in rows if lang in row][:n]
    from trainer.data.corpus import build_builtin_corpus

    langs = sorted({builtin_language(x) for d in r.directions for x in d})
    return [rec[builtin_language(lang)] for rec in build_builtin_corpus(langs, BUILTIN_SIZE, 1)["validation"][:n]]


@pytest.mark.parametrize("world", list(GROUPS), ids=[f"world{w}-{'+'.join(n)}" for w, n in GROUPS.items()])
def test_shipped_configs_rehearse_end_to_end(world: int, tmp_path: Path) -> None:
    rehearsals = [_prepare(name, tmp_path) for name in GROUPS[world]]
    cases = [
        {
            "name": r.name,
            "term_at": TERM_AT,
            "first": r.argv(),
            "resume": r.argv(resume_from_checkpoint="latest"),
        }
        for r in rehearsals
    ]
    env = {"WANDB_MODE": "disabled", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}
    results = run_distributed(
        rehearse, world, args=(cases,), timeout=600, env=env, collective_timeout=120
    )
    for r, case in zip(rehearsals, cases):
        per_rank = [rank_results[cases.index(case)] for rank_results in results]
        last = _check_run(r, per_rank[0])
        wall, cpu = time.perf_counter(), time.process_time()
        _export_and_translate(r, last)
        tail_wall, tail_cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(
            f"rehearsal {r.name}: world {world}, train+resume {max(x['wall_s'] for x in per_rank):.1f} s wall "
            f"{sum(x['cpu_s'] for x in per_rank):.1f} s cpu; export+translate {tail_wall:.1f} s wall "
            f"{tail_cpu:.1f} s cpu; cut: {', '.join(r.cut)}"
        )
