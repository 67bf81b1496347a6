"""Benchmark: our trainer vs `transformers.Seq2SeqTrainer` on multi30k en->de (CPU, fp32).

    python scripts/bench_multi30k.py --probe          # a few alternating same-batch steps: s/step
    python scripts/bench_multi30k.py --steps 600      # the full comparison -> benchmarks/multi30k_en_de.*

`--data_dir`: a folder of multi30k's task-1 raw files (`train.{en,de}.gz`, `val.{en,de}.gz`, from
https://github.com/multi30k/dataset, data/task1/raw); default: `../shared/data/multi30k` beside
the clone.

Both sides do the same thing:

* data: multi30k train en->de (line-aligned .gz files), read once by `trainer.data.sources.load_raw_datasets`;
  the HF side gets the same pairs, tokenized by the exported `AutoTokenizer` as
  `tok("__en__ " + src)` / `tok("__de__ " + tgt)` (= our `__en__ x </s>` / `__de__ y </s>`; checked
  id for id against `tokenize_datasets`), padded by the same `collate` (labels -100,
  decoder input `</s> __de__ y`, decoder_start = `</s>` = 2);
* tokenizer: one SentencePiece model trained by `load_or_train_tokenizer` (as `run` does), saved
  with `Tokenizer.save` (which writes the `AutoTokenizer` files too); our run loads it by
  `tokenizer_name`;
* weights: one `M2M100Translation` built with the seed, written with `save_hf_model`; our run loads
  it by `model_name_or_path`, HF by `from_pretrained` (same loss on a batch checked, dropout off);
* optimisation: AdamW (betas 0.9/0.98, eps 1e-8, wd 0), linear warmup + linear decay, clip 1.0,
  label smoothing 0.1, 32 sentences per step, no gradient accumulation, fp32, 2 threads, no eval;
  HF uses `train_sampling_strategy="group_by_length"` (its length bucketing; ours always buckets);
* evaluation: the first `--eval_sentences` validation pairs, greedy (num_beams 1, max_length 64),
  ours with `trainer.eval.decode.translate`, HF with `generate(forced_bos_token_id=...)`; our trained
  weights are also exported and decoded with HF `generate` as a cross-check; sacreBLEU via
  `trainer.eval.metrics.compute_metrics` (13a BLEU, chrF, chrF++).

Not the same (by design): the data order (different samplers) and the dropout masks. Loss: ours
is the token mean over the global batch; HF's `LabelSmoother` is the token mean over the batch
(here one batch per step, so the same quantity), and HF's logged loss is averaged over the
logging interval (here 1 step).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from make_sharded_corpus import multi30k_dir  # noqa: E402

from models.config import ModelConfig  # noqa: E402
from models.generate import SearchSettings  # noqa: E402
from models.hf import load_hf_weights, load_into  # noqa: E402
from models.hf_save import save_hf_model  # noqa: E402
from models.m2m100 import IGNORE_INDEX, M2M100Translation, Seq2SeqBatch  # noqa: E402
from trainer.config.parse import load_config_dict  # noqa: E402
from trainer.config.schema import JobConfig  # noqa: E402
from trainer.data.batching import BatchLayout, GlobalBatchSampler, collate  # noqa: E402
from trainer.data.sources import load_raw_datasets, run_languages, training_texts  # noqa: E402
from trainer.data.tokenization import tokenize_datasets  # noqa: E402
from trainer.eval.decode import translate  # noqa: E402
from trainer.eval.metrics import compute_metrics  # noqa: E402
from trainer.tokenizer.vocab import Tokenizer, load_or_train_tokenizer  # noqa: E402

SRC, TGT = "en", "de"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_dir", default=None, help="multi30k's folder (default: ../shared/data/multi30k)")
    p.add_argument("--work", default=str(ROOT / "outputs" / "bench_multi30k"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "multi30k_en_de"))
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--warmup", type=int, default=None, help="default: 10%% of steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--eval_sentences", type=int, default=500)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--probe", action="store_true", help="only the alternating same-batch step timing")
    p.add_argument("--micro_rounds", type=int, default=3)
    p.add_argument("--micro_steps", type=int, default=10)
    p.add_argument("--note", default="", help="a line added to the report (e.g. which commit ran)")
    args = p.parse_args(argv)
    files = [f"{split}.{lang}.gz" for split in ("train", "val") for lang in (SRC, TGT)]
    args.data_dir = str(multi30k_dir(args.data_dir, files))
    return args


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "n/a"


def job_values(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Our trainer's config (flat TrainingArguments-style names); HF's arguments mirror it."""
    return {
        "train_file": f"{args.data_dir}/train.{{lang}}.gz",
        "validation_file": f"{args.data_dir}/val.{{lang}}.gz",
        "source_lang": SRC,
        "target_lang": TGT,
        "max_eval_samples": args.eval_sentences,
        "vocab_size": 8000,
        "d_model": 256,
        "encoder_layers": 3,
        "decoder_layers": 3,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 1024,
        "decoder_ffn_dim": 1024,
        "dropout": 0.1,
        "attention_dropout": 0.1,
        "activation_dropout": 0.0,
        "output_dir": str(work / "ours"),
        "overwrite_output_dir": True,
        "max_steps": args.steps,
        "learning_rate": args.lr,
        "warmup_steps": args.warmup if args.warmup is not None else max(1, args.steps // 10),
        "lr_scheduler_type": "linear",
        "weight_decay": 0.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.98,
        "adam_epsilon": 1e-8,
        "max_grad_norm": 1.0,
        "label_smoothing_factor": 0.1,
        "per_device_train_batch_size": args.batch,
        "gradient_accumulation_steps": 1,
        "logging_steps": 1,
        "do_eval": False,
        "save_steps": 0,
        "seed": args.seed,
        "disable_tqdm": True,
        "report_to": "none",
    }


# ----------------------------------------------------------------------------- shared set-up


def prepare(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Tokenizer, initial weights and data, shared by both sides; checks that they agree."""
    from transformers import AutoTokenizer, M2M100ForConditionalGeneration

    cfg = load_config_dict(job_values(args, work))
    raw = load_raw_datasets(cfg.data, cfg.training.seed)
    tok_dir, init_dir = work / "tokenizer", work / "init"
    if (tok_dir / "tokenizer.json").is_file():
        tok = Tokenizer.load(tok_dir, run_languages(cfg.data))
    else:  # exactly what `trainer.run.setup.setup_tokenizer` does on rank 0
        tok = load_or_train_tokenizer(None, run_languages(cfg.data), training_texts(raw.train),
                                      cfg.model.vocab_size, cfg.data.spm_model_type,
                                      cfg.data.spm_character_coverage, cfg.data.spm_input_sentence_size,
                                      cfg.training.seed)  # fmt: skip
        tok.save(tok_dir)
    mc = cfg.model.model_config(tok.vocab_size, tok.special_ids())
    torch.manual_seed(cfg.training.seed)
    init_model = M2M100Translation(mc)
    save_hf_model(init_model.state_dict(), mc, init_dir)

    data = tokenize_datasets(raw, tok, cfg.data)
    hf_tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    train = raw.train
    hf_src = hf_encode(hf_tok, SRC, train["source"])
    hf_tgt = hf_encode(hf_tok, TGT, train["target"])
    ours_src, ours_tgt = data.train["input_ids"], data.train["labels"]
    if len(ours_src) != len(hf_src):
        raise SystemExit(f"our data kept {len(ours_src)} of {len(hf_src)} pairs; filter the HF side too")
    diff = sum(a != b for a, b in zip(ours_src, hf_src)) + sum(a != b for a, b in zip(ours_tgt, hf_tgt))
    if diff > 0.001 * 2 * len(hf_src):  # a handful of SentencePiece Viterbi ties may break differently
        raise SystemExit(f"HF tokenizer disagrees with ours on {diff} sequences")

    # Same weights: our model and HF's, both from init_dir, give the same loss (dropout off).
    ours = M2M100Translation(mc)
    load_into(ours, load_hf_weights(init_dir, ours.state_dict().keys()))
    hf = M2M100ForConditionalGeneration.from_pretrained(str(init_dir))
    batch = collate(ours_src[:16], ours_tgt[:16], tok.pad_id, tok.eos_id)
    ours.eval()
    hf.eval()
    with torch.no_grad():
        loss_sum, n = ours.loss(batch, 0.1)
        hf_loss = hf_label_smoothed_loss(hf, batch, 0.1)
    init_check = {"ours_loss": float(loss_sum) / n, "hf_loss": float(hf_loss)}
    if abs(init_check["ours_loss"] - init_check["hf_loss"]) > 1e-4:
        raise SystemExit(f"initial models differ: {init_check}")
    val = raw.validation[f"{SRC}-{TGT}"]
    return {
        "cfg": cfg,
        "tok": tok,
        "hf_tok": hf_tok,
        "mc": mc,
        "init_dir": init_dir,
        "tok_dir": tok_dir,
        "train_src": ours_src,
        "train_tgt": ours_tgt,
        "hf_train_src": hf_src,
        "hf_train_tgt": hf_tgt,
        "tokenizer_mismatches": diff,
        "val_sources": list(val["source"]),
        "val_refs": list(val["target"]),
        "init_check": init_check,
        "train_pairs": len(ours_src),
    }


def hf_label_smoothed_loss(model: Any, batch: Seq2SeqBatch, eps: float) -> torch.Tensor:
    from transformers.trainer_pt_utils import LabelSmoother

    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        decoder_input_ids=batch.decoder_input_ids,
    )
    return LabelSmoother(epsilon=eps)(out, batch.labels)


# ----------------------------------------------------------------------------- our trainer


def run_ours(args: argparse.Namespace, work: Path, shared: dict[str, Any]) -> dict[str, Any]:
    """`trainer.run.loop.run` in this process on a 1-rank gloo group; step entry/exit times recorded."""
    import torch.distributed as dist

    import trainer.run.loop as tt
    from parallel.mesh import init_distributed

    values = job_values(args, work)
    values.update(model_name_or_path=str(shared["init_dir"]), tokenizer_name=str(shared["tok_dir"]))
    cfg: JobConfig = load_config_dict(values)
    marks: list[tuple[float, float]] = []
    original = tt.train_step

    def timed_step(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        out = original(*a, **k)
        marks.append((t0, time.perf_counter()))
        return out

    init_distributed()
    tt.train_step = timed_step
    t0 = time.perf_counter()
    try:
        summary = tt.run(cfg)
    finally:
        tt.train_step = original
        dist.destroy_process_group()
    wall = time.perf_counter() - t0
    rows = [r for r in summary["history"] if "loss" in r]
    step_times = [r["step_time_s"] for r in rows]
    tokens = sum(r["tokens_per_sec"] * r["step_time_s"] for r in rows)  # src + tgt tokens per step
    return {
        "steps": summary["steps"],
        "wall_time_s": wall,
        "loop_wall_s": marks[-1][1] - marks[0][0],
        "step_time_sum_s": sum(step_times),
        "s_per_step": sum(step_times) / len(step_times),
        "median_s_per_step": statistics.median(step_times),
        "step_times": step_times,
        "tokens": tokens,
        "tokens_per_sec": tokens / sum(step_times),
        "losses": [r["loss"] for r in rows],
        "checkpoint": str(Path(cfg.training.output_dir) / f"checkpoint-{summary['steps']}"),
    }


# ----------------------------------------------------------------------------- transformers


def run_hf(args: argparse.Namespace, work: Path, shared: dict[str, Any]) -> dict[str, Any]:
    """`Seq2SeqTrainer` with the same arguments; per-step times from callbacks, tokens counted."""
    import datasets
    from transformers import (
        M2M100ForConditionalGeneration,
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        TrainerCallback,
    )

    v = job_values(args, work)
    tok: Tokenizer = shared["tok"]
    src, tgt = shared["hf_train_src"], shared["hf_train_tgt"]  # what HF's own tokenizer gives
    ds = datasets.Dataset.from_dict(
        {"input_ids": src, "labels": tgt, "length": [max(len(a), len(b)) for a, b in zip(src, tgt)]}
    )

    def data_collator(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        b = collate([r["input_ids"] for r in rows], [r["labels"] for r in rows], tok.pad_id, tok.eos_id)
        return {
            "input_ids": b.input_ids,
            "attention_mask": b.attention_mask,
            "decoder_input_ids": b.decoder_input_ids,
            "labels": b.labels,
        }

    targs = Seq2SeqTrainingArguments(
        output_dir=str(work / "hf"),
        max_steps=v["max_steps"],
        learning_rate=v["learning_rate"],
        warmup_steps=v["warmup_steps"],
        lr_scheduler_type=v["lr_scheduler_type"],
        weight_decay=v["weight_decay"],
        adam_beta1=v["adam_beta1"],
        adam_beta2=v["adam_beta2"],
        adam_epsilon=v["adam_epsilon"],
        optim="adamw_torch",
        max_grad_norm=v["max_grad_norm"],
        label_smoothing_factor=v["label_smoothing_factor"],
        per_device_train_batch_size=v["per_device_train_batch_size"],
        gradient_accumulation_steps=1,
        train_sampling_strategy="group_by_length",
        length_column_name="length",
        logging_strategy="steps",
        logging_steps=1,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=v["seed"],
        use_cpu=True,
        bf16=False,
        fp16=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        remove_unused_columns=False,
    )

    marks: list[tuple[float, float]] = []
    token_counts: list[int] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            marks.append((time.perf_counter(), 0.0))

        def on_step_end(self, *a: Any, **k: Any) -> None:
            marks[-1] = (marks[-1][0], time.perf_counter())

    class CountingTrainer(Seq2SeqTrainer):
        def training_step(self, model: Any, inputs: dict[str, Any], *a: Any, **k: Any) -> Any:
            labels = inputs["labels"]
            token_counts.append(int(inputs["attention_mask"].sum()) + int((labels != IGNORE_INDEX).sum()))
            return super().training_step(model, inputs, *a, **k)

    torch.manual_seed(v["seed"])
    model = M2M100ForConditionalGeneration.from_pretrained(str(shared["init_dir"]))
    trainer = CountingTrainer(
        model=model, args=targs, train_dataset=ds, data_collator=data_collator, callbacks=[Timer()]
    )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    step_times = [b - a for a, b in marks]
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    return {
        "steps": trainer.state.global_step,
        "wall_time_s": wall,
        "loop_wall_s": marks[-1][1] - marks[0][0],
        "step_time_sum_s": sum(step_times),
        "s_per_step": sum(step_times) / len(step_times),
        "median_s_per_step": statistics.median(step_times),
        "step_times": step_times,
        "tokens": sum(token_counts),
        "tokens_per_sec": sum(token_counts) / sum(step_times),
        "losses": losses,
        "model": trainer.model,
    }


# ----------------------------------------------------------------------------- evaluation


def hf_encode(hf_tok: Any, lang: str, texts: list[str]) -> list[list[int]]:
    """`__lang__ tokens </s>` by the exported tokenizer: its `src_lang` (NllbTokenizer, BPE runs),
    or the tag written into the text (the plain fast tokenizer of Unigram runs)."""
    if hasattr(hf_tok, "src_lang"):
        hf_tok.src_lang = f"__{lang}__"
        return hf_tok(list(texts))["input_ids"]
    return hf_tok([f"__{lang}__ {t}" for t in texts])["input_ids"]


def hf_translate(model: Any, hf_tok: Any, sources: list[str], batch_size: int = 64) -> list[str]:
    """Greedy HF `generate` (num_beams 1, max_length 64), forced `__de__`, length-sorted batches."""
    model.eval()
    forced = hf_tok.convert_tokens_to_ids(f"__{TGT}__")
    encoded = hf_encode(hf_tok, SRC, sources)
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))
    out: dict[int, str] = {}
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            batch = hf_tok.pad({"input_ids": [encoded[i] for i in idx]}, return_tensors="pt")
            gen = model.generate(
                **batch,
                forced_bos_token_id=forced,
                decoder_start_token_id=2,
                num_beams=1,
                do_sample=False,
                max_length=64,
            )
            for i, text in zip(idx, hf_tok.batch_decode(gen, skip_special_tokens=True)):
                out[i] = text.strip()
    return [out[i] for i in range(len(sources))]


def evaluate(args: argparse.Namespace, work: Path, shared: dict[str, Any], ours: dict[str, Any],
             hf: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    from transformers import M2M100ForConditionalGeneration

    from trainer.checkpoint.hf_export import load_full_state

    mc: ModelConfig = shared["mc"]
    sources, refs = shared["val_sources"], shared["val_refs"]
    state = load_full_state(ours["checkpoint"], mc)
    model = M2M100Translation(mc)
    load_into(model, state)
    t0 = time.perf_counter()
    ours_hyps = translate(
        model, shared["tok"], sources, SRC, TGT, SearchSettings(num_beams=1, max_length=64), 64
    )
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf_hyps = hf_translate(hf["model"], shared["hf_tok"], sources)
    t_hf = time.perf_counter() - t0
    save_hf_model(state, mc, work / "ours_hf", {"num_beams": 1, "max_length": 64})
    ours_via_hf = hf_translate(
        M2M100ForConditionalGeneration.from_pretrained(str(work / "ours_hf")), shared["hf_tok"], sources
    )
    same = sum(a == b for a, b in zip(ours_hyps, ours_via_hf))
    return {
        "ours": {**compute_metrics(ours_hyps, refs, TGT), "decode_s": t_ours},
        "hf": {**compute_metrics(hf_hyps, refs, TGT), "decode_s": t_hf},
        "ours_weights_hf_generate": {
            **compute_metrics(ours_via_hf, refs, TGT),
            "identical_to_our_generate": same,
        },
        "samples": [
            {"source": s, "reference": r, "ours": a, "hf": b}
            for s, r, a, b in list(zip(sources, refs, ours_hyps, hf_hyps))[:3]
        ],
    }


# ----------------------------------------------------------------------------- same-batch speed


def microbench(args: argparse.Namespace, shared: dict[str, Any]) -> dict[str, Any]:
    """Alternating segments on identical batches: our model vs HF's, forward+backward+clip+AdamW.

    The model implementations only (no trainer loop); alternation evens out load from
    other processes on the machine.
    """
    from transformers import M2M100ForConditionalGeneration

    tok: Tokenizer = shared["tok"]
    sampler = GlobalBatchSampler(
        _as_dataset(shared), BatchLayout(args.batch), args.seed, tok.pad_id, tok.eos_id
    )
    batches = [next(sampler).shard(0)[0][0] for _ in range(args.micro_steps)]
    ours = M2M100Translation(shared["mc"])
    load_into(ours, load_hf_weights(shared["init_dir"], ours.state_dict().keys()))
    hf = M2M100ForConditionalGeneration.from_pretrained(str(shared["init_dir"]))

    def make_step(model: torch.nn.Module, loss_fn: Any) -> Any:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), foreach=False)
        model.train()

        def step(b: Seq2SeqBatch) -> None:
            loss_fn(model, b).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    def ours_loss(m: Any, b: Seq2SeqBatch) -> torch.Tensor:
        loss_sum, n = m.loss(b, 0.1)
        return loss_sum / n

    steps = {
        "ours": make_step(ours, ours_loss),
        "hf": make_step(hf, lambda m, b: hf_label_smoothed_loss(m, b, 0.1)),
    }
    for fn in steps.values():  # warm-up
        fn(batches[0])
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    for r in range(args.micro_rounds):  # alternate every step, the order swapped every step
        for i, b in enumerate(batches):
            for name in ("ours", "hf") if (r + i) % 2 == 0 else ("hf", "ours"):
                t0 = time.perf_counter()
                steps[name](b)
                times[name].append(time.perf_counter() - t0)
    ratios = [a / b for a, b in zip(times["ours"], times["hf"])]
    return {
        "rounds": args.micro_rounds,
        "steps_per_round": len(batches),
        "ours_s_per_step": statistics.median(times["ours"]),
        "hf_s_per_step": statistics.median(times["hf"]),
        "median_pair_ratio": statistics.median(ratios),
        "ours_segments": times["ours"],
        "hf_segments": times["hf"],
    }


def _as_dataset(shared: dict[str, Any]) -> Any:
    import datasets

    src, tgt = shared["train_src"], shared["train_tgt"]
    return datasets.Dataset.from_dict(
        {"input_ids": src, "labels": tgt, "src_len": [len(x) for x in src], "tgt_len": [len(y) for y in tgt]}
    )


# ----------------------------------------------------------------------------- report


def final_loss(losses: list[float], last: int = 50) -> float:
    tail = losses[-last:]
    return sum(tail) / len(tail)


def write_report(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    o, h, ev, mb = result["ours"], result["hf"], result["eval"], result["microbench"]
    cfg = result["config"]
    lines = [
        "# multi30k en→de: our trainer vs transformers Seq2SeqTrainer (CPU, short run)",
        "",
        f"Generated by `scripts/bench_multi30k.py --steps {cfg['max_steps']}` on {result['machine']}; "
        f"torch {result['torch']}, transformers {result['transformers']}, {cfg['threads']} threads each, fp32.",
        "",
        f"Model: M2M100 d_model 256, 3+3 layers, 4 heads, FFN 1024, vocab {result['vocab_size']} "
        f"(one SentencePiece unigram model), dropout 0.1 / attention dropout 0.1, "
        f"{result['num_parameters'] / 1e6:.2f}M parameters, both initialised from the same weights. "
        f"Training: {result['train_pairs']} pairs, {cfg['per_device_train_batch_size']} sentences/step, "
        f"AdamW lr {cfg['learning_rate']} (betas 0.9/0.98, wd 0), {cfg['warmup_steps']} warmup steps then "
        f"linear decay, clip 1.0, label smoothing 0.1, no eval during training. "
        f"BLEU/chrF (sacreBLEU 13a) on the first {result['eval_sentences']} validation sentences, "
        f"greedy, max_length 64.",
        "",
        "| | ours (`trainer.run.loop.run`, 1 rank) | transformers `Seq2SeqTrainer` | ours / HF |",
        "|---|---|---|---|",
        f"| steps | {o['steps']} | {h['steps']} | |",
        f"| training loop wall time (s) | {o['loop_wall_s']:.1f} | {h['loop_wall_s']:.1f} | "
        f"{o['loop_wall_s'] / h['loop_wall_s']:.2f} |",
        f"| step time (s/step, mean) | {o['s_per_step']:.3f} | {h['s_per_step']:.3f} | "
        f"{o['s_per_step'] / h['s_per_step']:.2f} |",
        f"| step time (s/step, median) | {o['median_s_per_step']:.3f} | {h['median_s_per_step']:.3f} | "
        f"{o['median_s_per_step'] / h['median_s_per_step']:.2f} |",
        f"| tokens/s (src+tgt non-pad) | {o['tokens_per_sec']:.0f} | {h['tokens_per_sec']:.0f} | "
        f"{o['tokens_per_sec'] / h['tokens_per_sec']:.2f} |",
        f"| end-to-end wall incl. set-up / save (s) | {o['wall_time_s']:.1f} | {h['wall_time_s']:.1f} | |",
        f"| train loss, mean of last 50 steps | {final_loss(o['losses']):.3f} | "
        f"{final_loss(h['losses']):.3f} | |",
        f"| train loss, last step | {o['losses'][-1]:.3f} | {h['losses'][-1]:.3f} | |",
        f"| BLEU | {ev['ours']['bleu']:.2f} | {ev['hf']['bleu']:.2f} | |",
        f"| chrF | {ev['ours']['chrf']:.2f} | {ev['hf']['chrf']:.2f} | |",
        "",
        f"Same-batch timing, our model and HF's alternating step by step (fwd+bwd+clip+AdamW only, "
        f"{mb['rounds']} rounds x {mb['steps_per_round']} batches): median ours {mb['ours_s_per_step']:.3f} "
        f"s/step, HF {mb['hf_s_per_step']:.3f} s/step; median of per-pair ratios ours/HF "
        f"{mb['median_pair_ratio']:.2f}.",
        "",
        f"Cross-check: our trained weights exported (`save_hf_model`) and decoded with HF `generate`: "
        f"BLEU {ev['ours_weights_hf_generate']['bleu']:.2f}, chrF {ev['ours_weights_hf_generate']['chrf']:.2f}; "
        f"{ev['ours_weights_hf_generate']['identical_to_our_generate']}/{result['eval_sentences']} "
        f"hypotheses identical to our own greedy decoder's.",
        "",
        f"Initial loss on the same 16 pairs (dropout off): ours {result['init_check']['ours_loss']:.5f}, "
        f"HF {result['init_check']['hf_loss']:.5f}.",
        "",
        f"Load: start `{result['uptime_start']}`; end `{result['uptime_end']}` "
        "(shared 2-core machine with other jobs running: absolute times are noisy, ratios less so).",
        "",
        "Notes:",
        *([f"- {result['note']}"] if result.get("note") else []),
        "- Data order differs (our `GlobalBatchSampler` vs HF's `LengthGroupedSampler` via "
        "`train_sampling_strategy=group_by_length`), and so do dropout masks: equal quality is the "
        "point, not equal curves.",
        "- Loss: ours is the token mean over the global batch; HF's `LabelSmoother` is the token mean "
        "over its batch, and the logged value is averaged over the logging interval. With one 32-sentence "
        "batch per step and logging every step these are the same quantity here; with gradient "
        "accumulation or a logging interval > 1, HF averages per-batch means (slightly different).",
        "- Step time: ours is the logged `step_time_s` (fwd/bwd, clip, AdamW, scheduler); HF's is "
        "`on_step_begin`→`on_step_end` (the same work plus its per-step logging); both exclude fetching "
        "the batch. Loop wall time is first step start → last step end (includes batch fetching).",
        f"- Tokenizer: the exported `AutoTokenizer` gives our ids on all but {result['tokenizer_mismatches']} "
        f"of {2 * result['train_pairs']} training sequences (SentencePiece vs `tokenizers` breaking Viterbi "
        "score ties differently, e.g. `95,000` -> `00 0` vs `0 00`); HF trains on its own tokenizer's ids.",
        f"- Decoding: ours with `trainer.eval.decode.translate` ({ev['ours']['decode_s']:.1f} s), HF with "
        f"`generate(forced_bos_token_id=__de__)` ({ev['hf']['decode_s']:.1f} s).",
        "",
        "Samples (first validation sentences):",
        "",
    ]
    for s in ev["samples"]:
        lines += [f"- src: {s['source']}", f"  - ref: {s['reference']}", f"  - ours: {s['ours']}",
                  f"  - HF: {s['hf']}"]  # fmt: skip
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    start = uptime()
    print("start:", start, flush=True)
    t0 = time.perf_counter()
    shared = prepare(args, work)
    print(f"prepared in {time.perf_counter() - t0:.1f}s; init check {shared['init_check']}", flush=True)
    mb = microbench(args, shared)
    print("microbench:", {k: v for k, v in mb.items() if not k.endswith("segments")}, flush=True)
    if args.probe:
        print("end:", uptime())
        return
    ours = run_ours(args, work, shared)
    print("ours:", {k: v for k, v in ours.items() if k != "losses"}, flush=True)
    hf = run_hf(args, work, shared)
    print("hf:", {k: v for k, v in hf.items() if k not in ("losses", "model")}, flush=True)
    ev = evaluate(args, work, shared, ours, hf)
    end = uptime()
    import transformers

    mc: ModelConfig = shared["mc"]
    v = job_values(args, work)
    result = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "config": {**v, "threads": args.threads},
        "vocab_size": mc.vocab_size,
        "num_parameters": mc.num_parameters(),
        "train_pairs": shared["train_pairs"],
        "eval_sentences": len(shared["val_sources"]),
        "init_check": shared["init_check"],
        "tokenizer_mismatches": shared["tokenizer_mismatches"],
        "note": args.note,
        "uptime_start": start,
        "uptime_end": end,
        "ours": {k: v for k, v in ours.items()},
        "hf": {k: v for k, v in hf.items() if k != "model"},
        "eval": ev,
        "microbench": mb,
    }
    for side in ("ours", "hf"):
        result[side]["final_loss_last50"] = final_loss(result[side]["losses"])
    write_report(Path(args.out), result)
    print(Path(args.out).with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
