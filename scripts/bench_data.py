"""Benchmark: the data side at corpus sizes from 100k to 20M pairs (CPU, two ranks).

    python scripts/bench_data.py                          # 100k, 1M, 10M, 20M -> benchmarks/data_cpu.*
    python scripts/bench_data.py --sizes 100000 --quick   # a rehearsal

For each size a sharded JSON-lines corpus over 20 directions is generated once
(`scripts/make_sharded_corpus.py`, multi30k text from `--data_dir`, as that script takes it; 100k
pairs per shard) and trained on with `torchrun --nproc-per-node 2` (configs/tiny.yaml, dp=2, a new
SentencePiece at the default `spm_input_sentence_size`, no evaluation):

  streaming   `streaming: true`, one data-loader worker per rank (the new path)
  map-style   `streaming: false` (the path before it: rank 0 reads and tokenizes the corpus before
              step 1 while rank 1 waits in a broadcast), at the sizes given by --map_sizes

Measured per run: launch -> first optimizer step (the first metrics.jsonl row appears), peak RSS
of each rank, and each data worker's own pages (peak USS: a forked worker shares the rest with its
rank) (psutil, sampled every 0.2 s), the data wait per step
(`data_time_s` over the run, and its share of step time), the run's wall time. A `--dist_timeout_s
30` run at 2M pairs checks that no collective waits on the corpus.

Throughput of the input pipeline, per process, on the same shards: ours (read + parse + tokenize
in one `ChunkReader`, the work of one data-loader worker) against `datasets.load_dataset("json")`
+ `Dataset.map` tokenization (the `run_translation.py` path, num_proc=1), same tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

PAIRS = ["en-de", "de-en", "en-fr", "fr-en", "en-cs", "cs-en", "de-fr", "fr-de", "de-cs", "cs-de",
         "fr-cs", "cs-fr", "en-xx", "xx-en", "de-xx", "xx-de", "fr-xx", "xx-fr", "cs-xx", "xx-cs"]  # fmt: skip


def corpus(size: int, root: Path, data: Path | str) -> Path:
    from make_sharded_corpus import write_corpus

    out = root / f"corpus-{size}"
    if not (out / "DONE").exists():
        t = time.perf_counter()
        write_corpus(out, size, data, n_directions=20, shard_pairs=100_000)
        (out / "DONE").write_text(f"{time.perf_counter() - t:.0f} s\n")
    return out


class TreeMemory(threading.Thread):
    """Peak RSS of every process under `pid`, sampled: {pid: (cmdline tag, peak bytes)}."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peaks, self.stop = pid, {}, threading.Event()

    def run(self) -> None:
        import psutil

        root = psutil.Process(self.pid)
        while not self.stop.is_set():
            try:
                procs = root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for p in procs:
                try:
                    parent = p.ppid()
                    mem = p.memory_full_info() if parent != self.pid else p.memory_info()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                tag = "worker" if parent != self.pid else "rank"
                old = self.peaks.get(p.pid, (tag, 0, 0))
                uss = getattr(mem, "uss", 0)
                self.peaks[p.pid] = (tag, max(old[1], mem.rss), max(old[2], uss))
            time.sleep(0.2)


def train(corpus_dir: Path, out: Path, streaming: bool, steps: int, extra: list[str]) -> dict[str, Any]:
    """One torchrun job; returns its measurements."""
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "trainer.train",
            "--config", "configs/tiny.yaml", "--dataset_name", "null", "--train_file",
            f"{corpus_dir}/train-*.jsonl", "--streaming", str(streaming).lower(), "--language_pairs", *PAIRS,
            "--data_parallel_size", "2", "--do_eval", "false", "--max_steps", str(steps), "--logging_steps", "1",
            "--save_steps", "0", "--output_dir", str(out), "--overwrite_output_dir", "true", *extra]  # fmt: skip
    if streaming:
        args += ["--dataloader_num_workers", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "WANDB_MODE": "disabled"}  # fmt: skip
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    t0 = time.perf_counter()
    log = open(out.with_suffix(".log"), "w")
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    mem = TreeMemory(proc.pid)
    mem.start()
    first = None
    while proc.poll() is None:
        if first is None and metrics.exists() and metrics.stat().st_size > 0:
            first = time.perf_counter() - t0
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    mem.stop.set()
    log.close()
    if proc.returncode != 0:
        tail = out.with_suffix(".log").read_text()[-3000:]
        return {"ok": False, "returncode": proc.returncode, "log_tail": tail, "first_step_s": first}
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    summary = json.loads((out / "run_summary.json").read_text())
    ranks = sorted(b for t, b, _ in mem.peaks.values() if t == "rank")
    workers = sorted(u for t, _, u in mem.peaks.values() if t == "worker")  # their own pages (USS)
    steady = [r for r in rows if "loss" in r][2:]  # the first steps include start-up effects
    return {
        "ok": True,
        "first_step_s": first,
        "wall_s": wall,
        "rank_peak_rss_mib": [round(b / 2**20) for b in ranks],
        "worker_peak_uss_mib": [round(b / 2**20) for b in workers],
        "data_time_s_per_step": sum(r["data_time_s"] for r in steady) / max(1, len(steady)),
        "first_step_data_wait_s": rows[0].get("data_time_s") if rows else None,
        "step_time_s": sum(r["step_time_s"] for r in steady) / max(1, len(steady)),
        "data_time_share": summary.get("data_time_share"),
        "padding_fraction": sum(r.get("padding_fraction", 0) for r in steady) / max(1, len(steady)),
    }


def throughput(corpus_dir: Path, seconds: float = 20.0) -> dict[str, float]:
    """Pairs/s of one process: our ChunkReader vs datasets' json load + map, same shards and tokenizer."""
    import datasets

    from trainer.config.data_args import DataArguments
    from trainer.data.stream import ChunkReader, Snapshot
    from trainer.data.streaming import open_corpus, sample_texts, stream_spec
    from trainer.data.tokenization import encode_pairs
    from trainer.tokenizer.vocab import train_tokenizer

    datasets.disable_progress_bars()
    args = DataArguments(train_file=f"{corpus_dir}/train-*.jsonl", streaming=True, language_pairs=PAIRS)
    spec, expected = stream_spec(open_corpus(args), args, 42)
    langs = sorted({x for p in PAIRS for x in p.split("-")})
    tok = train_tokenizer(sample_texts(spec, expected, 50_000, 42), langs, 1000, "bpe", 1.0, 50_000, 42)
    reader = ChunkReader(spec, tok, Snapshot.start(spec))
    t, pairs = time.perf_counter(), 0
    while time.perf_counter() - t < seconds:
        chunk = reader.next_chunk()
        pairs += len(chunk) if chunk is not None else 0
    ours = pairs / (time.perf_counter() - t)
    files = sorted(str(p) for p in corpus_dir.glob("train-en-de-*.jsonl"))[:2]  # one direction: one schema
    cache = corpus_dir / "hf_cache"
    t = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=files, split="train", cache_dir=str(cache))
    load_s = time.perf_counter() - t

    def tokenize(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        rows = batch["translation"]
        s_lang, t_lang = [k for k in rows[0] if rows[0][k] is not None][:2]
        ids, labels, _, _ = encode_pairs(tok, [s_lang] * len(rows), [t_lang] * len(rows),
                                         [r[s_lang] for r in rows], [r[t_lang] for r in rows], 128, 128)  # fmt: skip
        return {"input_ids": ids, "labels": labels}

    t = time.perf_counter()
    ds.map(tokenize, batched=True, remove_columns=ds.column_names, load_from_cache_file=False)
    map_s = time.perf_counter() - t
    import shutil

    shutil.rmtree(cache, ignore_errors=True)
    return {"ours_pairs_per_s": ours, "datasets_pairs_per_s": len(ds) / (load_s + map_s),
            "datasets_map_only_pairs_per_s": len(ds) / map_s, "datasets_pairs": len(ds)}  # fmt: skip


def demo_data_wait(root: Path, steps: int) -> list[dict[str, Any]]:
    """configs/demo.yaml (pp2 x dp2 x tp2, 8 ranks) as shipped (the built-in corpus, map-style) and on
    the same corpus written as JSON-lines shards with `streaming: true` and one worker per rank."""
    from trainer.data.corpus import build_builtin_corpus

    shards = root / "demo-shards"
    shards.mkdir(parents=True, exist_ok=True)
    records = build_builtin_corpus(["de", "en", "fr"], 3000, 1)["train"]
    for k in range(4):
        lines = "".join(json.dumps({"translation": r}, ensure_ascii=False) + "\n" for r in records[k::4])
        (shards / f"train-{k}.jsonl").write_text(lines)
    out = []
    for name, extra in (
        ("demo.yaml as shipped (builtin, map-style)", []),
        ("demo.yaml on shards, streaming, 1 worker per rank",
         ["--dataset_name", "null", "--train_file", f"{shards}/train-*.jsonl", "--streaming", "true",
          "--dataloader_num_workers", "1"]),
    ):  # fmt: skip
        args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8", "-m", "trainer.train",
                "--config", "configs/demo.yaml", "--max_steps", str(steps), "--logging_steps", "10",
                "--do_eval", "false", "--save_steps", "0", "--output_dir", str(root / "demo-run"),
                "--overwrite_output_dir", "true", *extra]  # fmt: skip
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "WANDB_MODE": "disabled",
        }
        subprocess.run(args, cwd=ROOT, env=env, check=True, capture_output=True)
        summary = json.loads((root / "demo-run" / "run_summary.json").read_text())
        rows = [json.loads(x) for x in (root / "demo-run" / "metrics.jsonl").read_text().splitlines()]
        steady = [r for r in rows if "loss" in r][1:]
        out.append({
            "run": name,
            "data_time_share": summary["data_time_share"],
            "steady_share": sum(r["data_time_s"] for r in steady) / max(1e-9, sum(r["step_time_s"] for r in steady)),
            "step_time_s": sum(r["step_time_s"] for r in steady) / max(1, len(steady)),
        })  # fmt: skip
    return out


def table(results: dict[str, Any]) -> str:
    lines = [
        "# Data side at scale (CPU, 2 ranks)", "",
        f"Machine: {results['machine']}; {results['date']}. `python scripts/bench_data.py` "
        "(configs/tiny.yaml, dp=2, torchrun, 20 directions, 100k-pair JSON-lines shards of multi30k text, "
        "a new SentencePiece on `spm_input_sentence_size` = 200k sentences).", "",
        "| pairs | corpus | path | launch -> first step | peak RSS of the 2 ranks | data workers' own memory "
        "(peak USS) | data wait / step (steady) | data wait share (whole run) | step time |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for row in results["runs"]:
        r = row["result"]
        if not r.get("ok"):
            lines.append(f"| {row['pairs']:,} | {row['mib']:,} MiB | {row['path']} | failed: "
                         f"{(r.get('log_tail') or '').strip().splitlines()[-1][:80] if r.get('log_tail') else r} | | | | | |")  # fmt: skip
            continue
        rss = " / ".join(f"{x:,}" for x in r["rank_peak_rss_mib"])
        workers = " / ".join(f"{x:,}" for x in r["worker_peak_uss_mib"]) or "-"
        lines.append(
            f"| {row['pairs']:,} | {row['mib']:,} MiB | {row['path']} | {r['first_step_s']:.1f} s | {rss} MiB | "
            f"{workers} MiB | {1000 * r['data_time_s_per_step']:.1f} ms | {100 * (r['data_time_share'] or 0):.1f}% | "
            f"{1000 * r['step_time_s']:.0f} ms |"
        )
    demo = results.get("demo")
    if demo:
        lines += ["", "configs/demo.yaml (pp2 x dp2 x tp2, 8 ranks on the 2 cores), data wait over step time:", "",
                  "| run | data wait share, whole run | after step 10 | step time |", "|---|---:|---:|---:|"]  # fmt: skip
        for d in demo:
            lines.append(f"| {d['run']} | {100 * d['data_time_share']:.2f}% | {100 * d['steady_share']:.2f}% | "
                         f"{1000 * d['step_time_s']:.0f} ms |")  # fmt: skip
    tp = results.get("throughput")
    if tp:
        lines += ["", "Input pipeline, one process on the same shards (read, parse, tokenize):", "",
                  "| pipeline | pairs/s | ratio |", "|---|---:|---:|",
                  f"| ours: one data-loader worker (`ChunkReader`) | {tp['ours_pairs_per_s']:,.0f} | 1.00 |",
                  f"| `datasets.load_dataset('json')` + `Dataset.map` (run_translation) | "
                  f"{tp['datasets_pairs_per_s']:,.0f} | {tp['datasets_pairs_per_s'] / tp['ours_pairs_per_s']:.2f} |",
                  f"| `Dataset.map` alone (Arrow already built) | {tp['datasets_map_only_pairs_per_s']:,.0f} | "
                  f"{tp['datasets_map_only_pairs_per_s'] / tp['ours_pairs_per_s']:.2f} |"]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000, 20_000_000])
    parser.add_argument("--map_sizes", type=int, nargs="*", default=[100_000, 1_000_000])
    parser.add_argument(
        "--timeout_check", type=int, default=2_000_000, help="pairs of the dist_timeout_s 30 run"
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--root", default="/tmp/bench_data")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "data_cpu"))
    parser.add_argument("--quick", action="store_true", help="few steps, no throughput")
    parser.add_argument(
        "--data_dir", default=None, help="multi30k's folder (make_sharded_corpus.py --data_dir)"
    )
    args = parser.parse_args()
    from make_sharded_corpus import BUILTIN, LANGUAGES, multi30k_dir

    files = [f"train.{lang}.gz" for lang in LANGUAGES[:4]]
    text = BUILTIN if args.data_dir == BUILTIN else multi30k_dir(args.data_dir, files)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    steps = 8 if args.quick else args.steps
    results: dict[str, Any] = {"machine": f"{os.cpu_count()} CPU cores", "date": time.strftime("%Y-%m-%d"),
                               "runs": []}  # fmt: skip
    plan = [(n, "streaming", []) for n in args.sizes]
    plan += [(n, "map-style", []) for n in args.map_sizes]
    if args.timeout_check:
        plan.append((args.timeout_check, "streaming, dist_timeout_s 30", ["--dist_timeout_s", "30"]))
    for pairs, path, extra in plan:
        data = corpus(pairs, root, text)
        mib = round(sum(p.stat().st_size for p in data.glob("train-*.jsonl")) / 2**20)
        out = root / f"run-{pairs}-{path.split(',')[0]}"
        result = train(data, out, path.startswith("streaming"), steps, extra)
        print(json.dumps({"pairs": pairs, "path": path, **result})[:400], flush=True)
        results["runs"].append({"pairs": pairs, "mib": mib, "path": path, "result": result})
    if not args.quick:
        results["throughput"] = throughput(corpus(max(args.sizes), root, text))
        results["demo"] = demo_data_wait(root, 60)
    Path(args.out + ".json").write_text(json.dumps(results, indent=1))
    Path(args.out + ".md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
