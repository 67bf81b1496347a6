"""Entry point: `torchrun --nproc-per-node N -m trainer.train --config configs/X.yaml [--field value ...]`.

Also `python -m trainer.train ...` for one process. Wiring only; each piece lives
in its own module:

    config -> process group + mesh -> data + tokenizer -> model (HF import) ->
    partition -> parallelize -> optimizer/scheduler -> resume -> loop (log, eval, save) -> summary
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from models.config import ModelConfig
from models.m2m100 import M2M100Translation
from parallel.mesh import ParallelDims, ParallelMesh, build_mesh, coords_to_rank, init_distributed
from parallel.parallelize import ParallelModel, build_parallel_model
from parallel.simulate import bubble_theory
from trainer import checkpoint as ckpt
from trainer.config import ConfigError, JobConfig, parse_config
from trainer.data import (
    BatchLayout,
    GlobalBatchSampler,
    eval_batches,
    load_raw_datasets,
    run_languages,
    tokenize_datasets,
    training_texts,
)
from trainer.evaluation_runner import Evaluator
from trainer.loop import LogWindow, bubble_stats, build_optimizer, build_scheduler, train_step
from trainer.partitioning import choose_balance
from trainer.timeline import write_timeline
from trainer.tokenizer import Tokenizer, load_or_train_tokenizer
from trainer.tracking import Tracker

logger = logging.getLogger("trainer")


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prepare_output_dir(cfg: JobConfig, rank: int) -> Path:
    """Create output_dir; refuse a non-empty one unless resuming or overwrite_output_dir."""
    out = Path(cfg.training.output_dir)
    args = cfg.training
    if (
        rank == 0
        and out.is_dir()
        and any(out.iterdir())
        and not (args.overwrite_output_dir or args.resume_from_checkpoint)
    ):
        raise ConfigError(
            f"output_dir={str(out)!r} is not empty; set overwrite_output_dir or "
            f"resume_from_checkpoint (e.g. 'latest')"
        )
    if rank == 0 and args.overwrite_output_dir and not args.resume_from_checkpoint:
        for name in ("metrics.jsonl", "run_summary.json"):
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    return out


def setup_tokenizer(cfg: JobConfig, raw: Any, out: Path, rank: int) -> Tokenizer:
    """Rank 0 trains (or loads) and saves the tokenizer; the others load what it saved."""
    tok_dir = out / "tokenizer"
    languages = run_languages(cfg.data)
    if rank == 0:
        source = cfg.model.tokenizer_name or cfg.model.model_name_or_path
        tok = load_or_train_tokenizer(
            source if source and _has_tokenizer(source) else cfg.model.tokenizer_name,
            languages,
            training_texts(raw.train),
            cfg.model.vocab_size,
            cfg.data.spm_model_type,
            cfg.data.spm_character_coverage,
            cfg.data.spm_input_sentence_size,
            cfg.training.seed,
        )
        tok.save(tok_dir)
    dist.barrier()
    return Tokenizer.load(tok_dir, languages) if rank != 0 else tok


def _has_tokenizer(path: str) -> bool:
    p = Path(path)
    return p.is_dir() and any(
        (p / f).exists() for f in ("tokenizer.json", "spm.model", "tokenizer_config.json")
    )


def model_config_for(cfg: JobConfig, tok: Tokenizer) -> ModelConfig:
    if cfg.model.model_name_or_path:
        from models.hf import read_hf_config

        mc = read_hf_config(cfg.model.model_name_or_path)
        for k in ("dropout", "attention_dropout", "activation_dropout"):
            setattr(mc, k, getattr(cfg.model, k))  # regularisation is the run's choice
        if tok.vocab_size > mc.vocab_size:
            raise ConfigError(
                f"tokenizer has {tok.vocab_size} entries but the model at "
                f"{cfg.model.model_name_or_path} only {mc.vocab_size}"
            )
        return mc
    return cfg.model.model_config(tok.vocab_size, tok.special_ids())


def build_model(
    cfg: JobConfig, mc: ModelConfig, mesh: ParallelMesh, balance: list[int], device: torch.device
) -> ParallelModel:
    """The full model, identically initialised on every rank, cut and sharded for this rank."""
    torch.manual_seed(cfg.training.seed)
    model = M2M100Translation(mc).to(device)
    path = cfg.model.model_name_or_path

    def load_pretrained(stage_model: M2M100Translation) -> None:
        from models.hf import load_hf_weights, load_into

        # Only this stage's tensors are read from the safetensors files.
        assert path is not None
        load_into(stage_model, load_hf_weights(path, stage_model.state_dict().keys()))

    p = cfg.parallel
    return build_parallel_model(
        model,
        mesh,
        balance,
        p.num_microbatches,
        p.pipeline_schedule,
        p.virtual_stages,
        p.activation_checkpointing,
        cfg.training.label_smoothing_factor,
        autocast_dtype=torch.bfloat16 if cfg.training.bf16 else None,
        sequence_parallel=p.sequence_parallel,
        before_tp=load_pretrained if path else None,
        dp_sharding=p.data_parallel_sharding,
    )


def validate_early(cfg: JobConfig, world: int) -> ParallelDims:
    """Every check that needs no data, before anything is written or any collective runs.

    Mesh vs world size and node size, tp vs heads/FFN/d_model, blocks vs stages,
    an explicit partition's length and sum, and the schedule's (p, m, v) constraints.
    Raises ValueError (ConfigError, PartitionError, ...) naming the bad value.
    """
    from parallel.partition import validate_balance
    from parallel.schedule import build_schedule

    dims = ParallelDims.from_args(cfg.parallel, world)
    if cfg.model.model_name_or_path:
        from models.hf import read_hf_config

        arch = read_hf_config(cfg.model.model_name_or_path)
    else:
        arch = cfg.model.model_config(cfg.model.vocab_size, {})
    dims.validate(arch)
    p, v = dims.pp, cfg.parallel.virtual_stages
    n_blocks = arch.encoder_layers + arch.decoder_layers + 4
    if p * v > n_blocks:
        raise ConfigError(
            f"pipeline_parallel_size({p}) x virtual stages({v}) = {p * v} stages but the model "
            f"has only {n_blocks} blocks ({arch.encoder_layers} encoder + {arch.decoder_layers} "
            f"decoder layers + 4); use fewer stages or more layers"
        )
    balance = cfg.parallel.partition_balance()
    if balance is not None:
        validate_balance(balance, n_blocks, p * v)
    build_schedule(cfg.parallel.pipeline_schedule, p, cfg.parallel.num_microbatches, v)
    return dims


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the config, initialise the process group, train, tear down."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse_config(argv)
    init_distributed(timeout_s=cfg.parallel.dist_timeout_s)
    try:
        return run(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(cfg: JobConfig) -> dict[str, Any]:
    """Train with an initialised default process group (collective); returns the run summary.

    On the logging rank the summary also holds `history`, every row written to metrics.jsonl.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = validate_early(cfg, world)
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    out = prepare_output_dir(cfg, rank)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    set_seed(cfg.training.seed)
    t_start = time.perf_counter()

    raw = load_raw_datasets(cfg.data, cfg.training.seed)
    tok = setup_tokenizer(cfg, raw, out, rank)
    data = tokenize_datasets(raw, tok, cfg.data)
    mc = model_config_for(cfg, tok)
    dims.validate(mc)
    mesh = build_mesh(dims, device.type)
    layout = BatchLayout(
        cfg.training.per_device_train_batch_size,
        cfg.parallel.num_microbatches,
        cfg.training.gradient_accumulation_steps,
        dims.dp,
        cfg.data.max_tokens_per_microbatch,
    )
    sampler = GlobalBatchSampler(
        data.train, layout, cfg.training.seed, tok.pad_id, tok.special_ids()["decoder_start_token_id"]
    )
    balance, partition_text = choose_balance(cfg, mc, mesh, sampler, device)
    pm = build_model(cfg, mc, mesh, balance, device)
    optimizer = build_optimizer(pm.model, cfg.training, only=pm.optimizer_params())
    scheduler = build_scheduler(optimizer, cfg.training)
    log_rank = coords_to_rank((dims.pp - 1, 0, 0), dims.shape)
    is_logger = rank == log_rank
    if rank == 0:
        cfg.save(out / "config.yaml")
        (out / "model_config.json").write_text(json.dumps(mc.to_dict(), indent=1))
        logger.info(
            "mesh pp=%d dp=%d tp=%d, schedule %s (v=%d), remat %s\n%s",
            dims.pp,
            dims.dp,
            dims.tp,
            cfg.parallel.pipeline_schedule,
            cfg.parallel.virtual_stages,
            cfg.parallel.activation_checkpointing,
            partition_text,
        )
        logger.info("model: %.2fM parameters; data skipped: %s", mc.num_parameters() / 1e6, data.skipped)

    step = 0
    resume = ckpt.resolve_resume(cfg.training.resume_from_checkpoint, out)
    if resume is not None:
        state = ckpt.load_checkpoint(
            resume,
            [pm.model],
            optimizer,
            to_logical=pm.to_logical,
            restore_rng=state_mesh_matches(resume, dims),
        )
        scheduler.load_state_dict(state["scheduler"])
        # The optimizer's param groups carry the lr of the *next* step; DCP restored only tensors.
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
        sampler.load_state_dict(state["data"])
        step = int(state["step"])
        logger.info("resumed from %s at step %d", resume, step)

    run_config = {
        **cfg.to_dict(),
        "mesh": {"pp": dims.pp, "dp": dims.dp, "tp": dims.tp},
        "partition": balance,
        "num_parameters": mc.num_parameters(),
    }
    tracker = Tracker(
        str(out),
        is_logger,
        cfg.training.report_to,
        cfg.training.run_name,
        cfg.training.wandb_project,
        run_config,
        cfg.training.max_steps,
        cfg.training.disable_tqdm,
        initial_step=step,
    )
    evaluator = Evaluator(
        pm,
        mesh,
        tok,
        eval_batches(data, tok, cfg.training.per_device_eval_batch_size),
        cfg.training,
        log_rank,
        mc,
    )
    v = cfg.parallel.virtual_stages
    theory = bubble_theory(dims.pp, cfg.parallel.num_microbatches, v)
    summary: dict[str, Any] = {
        "mesh": run_config["mesh"],
        "partition": balance,
        "bubble_fraction_theory": theory,
    }

    if cfg.training.do_eval and step == 0:
        before = evaluator.run(step)
        tracker.log({"step": step, **before})
        summary["before"] = before
    pm.model.train()
    bubbles = []
    timeline_step = min(cfg.training.max_steps, max(2, cfg.training.logging_steps))
    window = LogWindow(pm)
    while step < cfg.training.max_steps:
        step += 1
        log_now = step % cfg.training.logging_steps == 0 or step == cfg.training.max_steps
        gb = next(sampler)
        t_step = time.perf_counter()
        st = train_step(
            pm,
            optimizer,
            scheduler,
            gb,
            mesh.dp_rank,
            cfg.training.max_grad_norm,
            step,
            timed=log_now or step == timeline_step,
        )
        window.add(st, time.perf_counter() - t_step)
        tracker.advance()
        if log_now:
            row = {
                "step": step,
                "lr": st.lr,
                **window.read(st),
                "epoch": gb.epoch,
                **bubble_stats(pm, st.flushes),
            }
            if dims.pp > 1:
                row["bubble_fraction_theory"] = theory
                bubbles.append(row["bubble_fraction"])
            if torch.cuda.is_available():
                row["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
            tracker.log(row)
        if step == timeline_step and dims.pp > 1:
            png = write_timeline(pm, st.flushes, out, is_logger, step)
            if png:
                tracker.log_image(step, "pipeline_timeline", png)
        if cfg.training.eval_steps and step % cfg.training.eval_steps == 0 and step < cfg.training.max_steps:
            tracker.log({"step": step, **evaluator.run(step, tracker)})
            pm.model.train()
        if cfg.training.save_steps and step % cfg.training.save_steps == 0 and step < cfg.training.max_steps:
            save(cfg, pm, optimizer, scheduler, sampler, step, out, dims, balance)

    after: dict[str, Any] = {}
    if cfg.training.do_eval:
        after = evaluator.run(step, tracker)
        tracker.log({"step": step, **after})
    save(cfg, pm, optimizer, scheduler, sampler, step, out, dims, balance)
    summary.update(
        {
            "after": after,
            "steps": step,
            "wall_time_s": time.perf_counter() - t_start,
            "tokens_per_sec": window.total_tokens / window.total_s if window.total_s else 0.0,
            "bubble_fraction": float(np.mean(bubbles)) if bubbles else None,
            "timeline_png": str(out / "timeline.png") if dims.pp > 1 else None,
            "timeline_trace": str(out / "timeline_trace.json") if dims.pp > 1 else None,
            "data_skipped": data.skipped,
        }
    )
    if is_logger:
        (out / "run_summary.json").write_text(json.dumps(summary, indent=1, default=str))
        _print_summary(summary)
    summary["history"] = tracker.history
    tracker.close()
    dist.barrier()
    return summary


def state_mesh_matches(path: Path, dims: ParallelDims) -> bool:
    saved = json.loads((path / "trainer_state.json").read_text()).get("mesh", {})
    return saved == {"pp": dims.pp, "dp": dims.dp, "tp": dims.tp}


def save(
    cfg: JobConfig,
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    sampler: GlobalBatchSampler,
    step: int,
    out: Path,
    dims: ParallelDims,
    balance: list[int],
) -> None:
    state = {
        "step": step,
        "scheduler": scheduler.state_dict(),
        "data": sampler.state_dict(),
        "mesh": {"pp": dims.pp, "dp": dims.dp, "tp": dims.tp},
        "partition": balance,
        "model_config": pm.model.config.to_dict(),
    }
    ckpt.save_checkpoint(
        ckpt.checkpoint_dir(out, step),
        [pm.model],
        optimizer,
        state,
        to_logical=pm.to_logical,
        save_total_limit=cfg.training.save_total_limit,
    )


def _print_summary(s: dict[str, Any]) -> None:
    before, after = s.get("before", {}), s.get("after", {})
    lines = [
        "",
        "=" * 64,
        "run summary",
        "=" * 64,
        f"mesh                 pp={s['mesh']['pp']} dp={s['mesh']['dp']} tp={s['mesh']['tp']}  "
        f"partition {s['partition']}",
    ]
    for key in ("eval_loss", "eval_bleu", "eval_chrf"):
        if key in before or key in after:
            b, a = before.get(key), after.get(key)
            lines.append(
                f"{key:<20} before {b if b is None else round(b, 3)!s:>8}   after "
                f"{a if a is None else round(a, 3)!s:>8}"
            )
    lines.append(f"tokens/s             {s['tokens_per_sec']:.0f}")
    if s.get("bubble_fraction") is not None:
        lines.append(
            f"bubble               measured {s['bubble_fraction']:.3f}   theory "
            f"{s['bubble_fraction_theory']:.3f}"
        )
        lines.append(f"timeline             {s['timeline_png']}")
    lines.append(f"wall time            {s['wall_time_s']:.1f} s over {s['steps']} steps")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, ValueError, FileNotFoundError) as e:  # bad input: one clear line, not a traceback
        if os.environ.get("TRAINER_TRACEBACK"):
            raise
        print(f"error: {type(e).__name__}: {e} (TRAINER_TRACEBACK=1 for the traceback)", file=sys.stderr)
        sys.exit(2)
