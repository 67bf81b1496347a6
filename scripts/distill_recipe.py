"""Distillation recipe on multi30k (issue 35): a tiny NLLB-MoE teacher, a dense student of about a
quarter of its size distilled word-level, trained on sequence-level teacher output, and from scratch
on the same steps; all scored on the same held-out sentences.

    python scripts/distill_recipe.py [--data ../shared/data/multi30k] [--work outputs/distill_recipe]
        [--teacher_steps 600] [--student_steps 300] [--train_pairs 20000] [--heldout 500]
        [--out benchmarks/distill_multi30k]

    1 data       multi30k train en-de (the first `--train_pairs`) as 4 JSON-lines shards (the streaming layout of docs/data.md);
                 the last `--heldout` validation sentences as a FLORES-style directory (held out: no
                 run sees them), the first 200 as the runs' validation file
    2 teacher    NLLB-MoE (d_model 128, 3+3 layers, 4 experts in every 2nd layer), trained on the
                 shards, streaming; its SentencePiece (trained on them) is every student's
    3 seq-KD     `python -m trainer.distill_data`: the teacher's beam translations of the shards
    4 students   dense d_model 64, 3+3 layers, the same steps, seed and batches: from scratch on the
                 shards; distilled word-level (--teacher_model_name_or_path, one student per --alphas,
                 the table's pick the best on the validation sentences); on the seq-KD shards
                 (streaming, as they are)
    5 scores     `python -m trainer.evaluate` of every model on the held-out directory: BLEU, chrF,
                 chrF++ (beam 4), into `--out`.md / .json with the wall time of each stage

Every stage runs the project's own entry points as a user would (`python -m ...`), one process and
one thread each, two at a time (the teacher beside the scratch student, the seq-KD data beside the
word-level student, ...); a stage whose output is already there is not rerun (delete `--work` to
start over).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHARDS = 4
SRC, TGT = "en", "de"
COMMON = [
    "--language_pairs", f"{SRC}-{TGT}", "--streaming", "true", "--max_source_length", "64",
    "--max_target_length", "64", "--learning_rate", "3e-3", "--label_smoothing_factor", "0.1", "--do_eval", "false",
    "--logging_steps", "100", "--report_to", "none", "--disable_tqdm", "true", "--seed", "1",
    "--dataset_name", "null", "--max_eval_samples", "200", "--overwrite_output_dir", "false",
]  # fmt: skip
TEACHER = [
    "--d_model", "128", "--encoder_layers", "3", "--decoder_layers", "3", "--encoder_attention_heads", "4",
    "--decoder_attention_heads", "4", "--encoder_ffn_dim", "512", "--decoder_ffn_dim", "512",
    "--num_experts", "4", "--encoder_sparse_step", "2", "--decoder_sparse_step", "2",
    "--router_aux_loss_coef", "0.01", "--moe_token_dropout", "0.0", "--vocab_size", "4000",
]  # fmt: skip
STUDENT = [
    "--d_model", "64", "--encoder_layers", "3", "--decoder_layers", "3", "--encoder_attention_heads", "4",
    "--decoder_attention_heads", "4", "--encoder_ffn_dim", "256", "--decoder_ffn_dim", "256",
]  # fmt: skip


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "multi30k"),
                   help="multi30k's directory (train.{en,de}.gz, val.{en,de}.gz)")  # fmt: skip
    p.add_argument("--work", default=str(ROOT / "outputs" / "distill_recipe"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "distill_multi30k"))
    p.add_argument("--teacher_steps", type=int, default=600)
    p.add_argument("--student_steps", type=int, default=300)
    p.add_argument("--train_pairs", type=int, default=20000, help="use the first N training pairs (0: all)")
    p.add_argument("--heldout", type=int, default=500, help="held-out sentences scored")
    p.add_argument("--batch", type=int, default=64, help="sentence pairs per step")
    p.add_argument("--warmup", type=int, default=200, help="warmup steps of every run")
    p.add_argument("--alphas", type=float, nargs="+", default=[0.5, 0.9],
                   help="word-level students' distillation_alpha, one student each (the table's pick: the best on validation)")  # fmt: skip
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--num_beams", type=int, default=4, help="beam of the scoring")
    p.add_argument("--seqkd_beams", type=int, default=2, help="the teacher's beam for the seq-KD data")
    p.add_argument("--threads", type=int, default=1, help="threads per run (two runs at a time)")
    return p.parse_args()


def lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.strip() for line in f]


def write_data(args: argparse.Namespace, work: Path) -> dict[str, Path]:
    """Shards, the validation file and the held-out directory (written once)."""
    data = Path(args.data)
    shards, heldout = work / "shards", work / "heldout"
    if not (shards / f"train-{SRC}-{TGT}-{SHARDS - 1:05d}.jsonl").is_file():
        src, tgt = lines(data / f"train.{SRC}.gz"), lines(data / f"train.{TGT}.gz")
        n = args.train_pairs or len(src)
        shards.mkdir(parents=True, exist_ok=True)
        per = -(-n // SHARDS)
        for k in range(SHARDS):
            rows = [json.dumps({"translation": {SRC: s, TGT: t}}, ensure_ascii=False) + "\n"
                    for s, t in zip(src[k * per : min(n, (k + 1) * per)], tgt[k * per : min(n, (k + 1) * per)])]  # fmt: skip
            (shards / f"train-{SRC}-{TGT}-{k:05d}.jsonl").write_text("".join(rows), encoding="utf-8")
        vsrc, vtgt = lines(data / f"val.{SRC}.gz"), lines(data / f"val.{TGT}.gz")
        valid = [json.dumps({"translation": {SRC: s, TGT: t}}, ensure_ascii=False) + "\n"
                 for s, t in zip(vsrc[:200], vtgt[:200])]  # fmt: skip
        (work / "valid.jsonl").write_text("".join(valid), encoding="utf-8")
        heldout.mkdir(parents=True, exist_ok=True)
        (work / "valid_dir").mkdir(parents=True, exist_ok=True)
        for lang, text in ((SRC, vsrc), (TGT, vtgt)):
            (heldout / f"{lang}.txt").write_text("\n".join(text[-args.heldout :]) + "\n", encoding="utf-8")
            (work / "valid_dir" / f"{lang}.txt").write_text("\n".join(text[:200]) + "\n", encoding="utf-8")
    return {
        "shards": shards,
        "heldout": heldout,
        "valid": work / "valid.jsonl",
        "valid_dir": work / "valid_dir",
    }


def run(cmd: list[str], log: Path, threads: int) -> float:
    """Run a project command to `log`; its wall time. Raises on failure, with the log's tail.
    `python -m` in the clone (cwd) finds the project without a PYTHONPATH of its own (the caller's is
    kept: a preloaded test interpreter serves only commands whose import environment is its own)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "WANDB_MODE": "disabled"}  # fmt: skip
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, check=False)
    if done.returncode:
        tail = log.read_text().splitlines()[-20:]
        raise SystemExit(f"{' '.join(cmd[:4])} failed ({done.returncode}); {log}:\n" + "\n".join(tail))
    return time.perf_counter() - t0


def train(name: str, flags: list[str], steps: int, work: Path, threads: int) -> tuple[Path, float]:
    """A trainer.train run to `steps` (skipped when its last checkpoint is there)."""
    out = work / name
    ckpt = out / f"checkpoint-{steps}"
    if (ckpt / "COMMITTED").is_file():
        return ckpt, json.loads((out / "recipe_wall_s.json").read_text())["wall_s"]
    py = sys.executable
    wall = run([py, "-m", "trainer.train", "--config", "configs/tiny.yaml", *COMMON, *flags,
                "--max_steps", str(steps), "--save_steps", str(steps), "--output_dir", str(out)],
               work / f"{name}.log", threads)  # fmt: skip
    (out / "recipe_wall_s.json").write_text(json.dumps({"wall_s": wall}))
    return ckpt, wall


def score(
    name: str, model: Path, heldout: Path, work: Path, args: argparse.Namespace, where: str = "scores"
) -> dict[str, Any]:
    """BLEU, chrF, chrF++ of `model` on the directory `heldout` (scored once, kept in work/`where`/`name`)."""
    out = work / where / name
    if not (out / "scores.json").is_file():
        run([sys.executable, "-m", "trainer.evaluate", "--model", str(model), "--data_dir", str(heldout),
             "--file_pattern", "{lang}.txt", "--directions", f"{SRC}-{TGT}", "--num_beams", str(args.num_beams),
             "--max_length", "64", "--batch_size", "64", "--disable_tqdm", "true", "--output_dir", str(out)],
            work / f"{where}-{name}.log", args.threads)  # fmt: skip
    row = json.loads((out / "scores.json").read_text())["directions"][f"{SRC}-{TGT}"]
    return {k: row[k] for k in ("bleu", "chrf", "chrf++") if k in row}


def main() -> None:
    args = parse()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    d = write_data(args, work)
    batch = ["--per_device_train_batch_size", str(args.batch), "--warmup_steps", str(args.warmup)]
    data = ["--train_file", str(d["shards"] / "train-*.jsonl"), "--validation_file", str(d["valid"]), *batch]
    tok = ["--tokenizer_name", str(work / "teacher" / "tokenizer")]
    seqkd = work / "seqkd"
    seq_data = ["--train_file", str(seqkd / "train-*.jsonl"), "--validation_file", str(d["valid"]), *batch]
    kd = ["--teacher_model_name_or_path", str(work / "teacher" / f"checkpoint-{args.teacher_steps}"),
          "--distillation_temperature", str(args.temperature)]  # fmt: skip
    word = {f"word_kd_a{a:g}": [*kd, "--distillation_alpha", str(a)] for a in args.alphas}
    steps, threads = args.student_steps, args.threads
    walls: dict[str, float] = {}
    ckpts: dict[str, Path] = {}

    def job(name: str, flags: list[str], n: int, after: Path | None = None) -> None:
        if after is not None:  # the teacher's tokenizer (model_config.json: written after it)
            while not after.is_file():
                time.sleep(0.2)
        ckpts[name], walls[name] = train(
            name if name == "teacher" else f"student-{name}", flags, n, work, threads
        )

    def seq_data_job() -> None:
        record = work / "seqkd_wall_s.json"
        if all((seqkd / p.name).is_file() for p in d["shards"].glob("train-*.jsonl")) and record.is_file():
            walls["seqkd_data"] = json.loads(record.read_text())["wall_s"]
        else:
            walls["seqkd_data"] = run(
                [sys.executable, "-m", "trainer.distill_data", "--model", str(ckpts["teacher"]), "--train_file",
                 str(d["shards"] / "train-*.jsonl"), "--directions", f"{SRC}-{TGT}", "--output_dir", str(seqkd),
                 "--num_beams", str(args.seqkd_beams), "--max_length", "64", "--batch_size", "64",
                 "--disable_tqdm", "true"], work / "seqkd.log", threads)  # fmt: skip
            record.write_text(json.dumps({"wall_s": walls["seqkd_data"]}))

    # two jobs at a time (the machine's two cores), one thread each, in dependency order
    tokenizer = work / "teacher" / "model_config.json"
    together(lambda: job("teacher", [*data, *TEACHER], args.teacher_steps),
             lambda: job("scratch", [*data, *STUDENT, *tok], steps, after=tokenizer))  # fmt: skip
    together(
        seq_data_job,
        lambda: [job(name, [*data, *STUDENT, *tok, *flags], steps) for name, flags in word.items()],
    )
    scores: dict[str, Any] = {}
    valid: dict[str, Any] = {}

    def scored(name: str) -> None:
        scores[name] = score(name, ckpts[name], d["heldout"], work, args)
        valid[name] = score(name, ckpts[name], d["valid_dir"], work, args, "valscores")

    together(lambda: job("seq_kd", [*seq_data, *STUDENT, *tok], steps), lambda: scored("teacher"))
    together(lambda: scored("scratch"), lambda: [scored(name) for name in word])
    scored("seq_kd")
    order = ("teacher", "scratch", *word, "seq_kd")
    total = work / "recipe_total_s.json"  # the first complete run's (a rerun only rewrites the table)
    if not total.is_file():
        total.write_text(json.dumps({"wall_s": time.perf_counter() - t_start}))
    report(args, work, {k: scores[k] for k in order}, {k: valid[k] for k in order}, walls,
           json.loads(total.read_text())["wall_s"])  # fmt: skip


def together(*jobs: Any) -> None:
    """Run the jobs side by side (threads over their subprocesses); the first failure is raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(jobs)) as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()


def report(
    args: argparse.Namespace, work: Path, scores: dict[str, Any], valid: dict[str, Any], walls: dict[str, float],
    total: float,
) -> None:  # fmt: skip
    """The table (`--out`.md) and every number (`--out`.json)."""
    from models.config import ModelConfig

    def params(name: str) -> int:
        state = json.loads((work / name / "model_config.json").read_text())
        return ModelConfig.from_dict(state).num_parameters()

    sizes = {k: params("teacher" if k == "teacher" else f"student-{k}") for k in scores}
    words = [k for k in scores if k.startswith("word_kd")]
    pick = max(
        words, key=lambda k: valid[k]["chrf++"]
    )  # the alpha chosen on validation, not on the held-out set
    gain = {k: scores[k]["chrf++"] - scores["scratch"]["chrf++"] for k in (*words, "seq_kd")}
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), {args.threads} thread(s) per run",
        "teacher_steps": args.teacher_steps, "student_steps": args.student_steps, "train_pairs": args.train_pairs,
        "alphas": args.alphas, "alpha_chosen_on_validation": pick, "temperature": args.temperature,
        "num_beams": args.num_beams, "seqkd_beams": args.seqkd_beams, "heldout_sentences": args.heldout,
        "parameters": sizes, "scores": scores, "validation_scores": valid, "wall_s": walls,
        "total_wall_s": total, "chrf++_gain_over_scratch": gain,
    }  # fmt: skip
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    names = {"teacher": "teacher (NLLB-MoE)", "scratch": "student from scratch", "seq_kd": "student on seq-level KD data",
             **{k: f"student, word-level KD, alpha {k.removeprefix('word_kd_a')}, T {args.temperature:g}" for k in words}}  # fmt: skip
    rows = [f"| {names[k]} | {sizes[k] / 1e6:.2f}M | {args.teacher_steps if k == 'teacher' else args.student_steps} "
            f"| {v['bleu']:.2f} | {v['chrf']:.2f} | {v['chrf++']:.2f} | {valid[k]['chrf++']:.2f} | {walls.get(k, 0.0):.0f} |"
            for k, v in scores.items()]  # fmt: skip
    text = "\n".join([
        "# Distillation on multi30k en→de (CPU)", "",
        f"Generated by `python scripts/distill_recipe.py --teacher_steps {args.teacher_steps} --student_steps "
        f"{args.student_steps} --train_pairs {args.train_pairs}` on {result['machine']}; every run one process, fp32, "
        f"batches of {args.batch} pairs, lr 3e-3 ({args.warmup} warmup steps, then linear decay), label smoothing "
        f"0.1, seed 1, the first {args.train_pairs} training pairs. Scores: sacreBLEU (13a), chrF, chrF++ on the "
        f"last {args.heldout} multi30k validation sentences (held out: no run saw them, nothing was chosen on "
        f"them), beam {args.num_beams}; validation: the first 200 validation sentences (the word-level "
        f"student's alpha is the one best there).", "",
        "| model | parameters | steps | BLEU | chrF | chrF++ | chrF++ (validation) | train wall (s) |",
        "|---|---|---|---|---|---|---|---|", *rows, "",
        f"chrF++ over the student from scratch, held out: word-level KD {gain[pick]:+.2f} (alpha "
        f"{pick.removeprefix('word_kd_a')}, chosen on validation; "
        + ", ".join(f"alpha {k.removeprefix('word_kd_a')}: {gain[k]:+.2f}" for k in words)
        + f"), sequence-level KD {gain['seq_kd']:+.2f} (goal: >= +1.0).", "",
        f"Sequence-level data (`trainer.distill_data`, beam {args.seqkd_beams}, {args.train_pairs} pairs): "
        f"{walls.get('seqkd_data', float('nan')):.0f} s. Whole recipe, two runs at a time: {total:.0f} s.", "",
    ])  # fmt: skip
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
