"""Entry point: `torchrun --nproc-per-node N -m trainer.train --config configs/X.yaml [--field value ...]`.

Also `python -m trainer.train ...` for one process. Wiring only; each piece lives
in its own module, and `run` is a short sequence of named steps:

    main             config -> process group -> run -> tear down
    run              validate -> resume point (checked) -> claim output dir (lock, fresh-start
                     cleanup) -> setup_run -> ...
    setup_run        data + tokenizer -> mesh -> sampler ->
                     partition -> model (HF import, parallelize) -> optimizer/scheduler
    resume_state     checkpoint -> model, optimizer, scheduler, sampler; the step
    build_tracker, build_evaluator, eval before training
    train_loop       per step: train_step (guarded) -> log_row -> timeline (once) -> preempted? save + exit
                     -> maybe_eval_and_save (eval/save strategies, best model, early stop: trainer.strategies)
    finish_run       final eval -> checkpoint -> best model loaded -> do_predict (trainer.predict)
                     -> run_summary.json
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from dataclasses import dataclass, field
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
from parallel.watchdog import RankIdentity, default_warn_after, start_watchdog
from trainer import checkpoint as ckpt
from trainer.config import ConfigError, JobConfig, parse_config
from trainer.data import (
    BatchLayout,
    DataError,
    GlobalBatchSampler,
    RawDatasets,
    TranslationData,
    eval_batches,
    load_raw_datasets,
    load_test_pairs,
    run_languages,
    tokenize_datasets,
    training_texts,
)
from trainer.evaluation_runner import Evaluator
from trainer.faults import FaultInjection
from trainer.flops import peak_flops, step_flops
from trainer.guard import (
    EXIT_DIVERGED,
    EXIT_PREEMPTED,
    DivergenceError,
    Preempted,
    PreemptionSignals,
    StepGuard,
    assert_finite_state,
)
from trainer.loop import LogWindow, StepStats, bubble_stats, build_optimizer, build_scheduler, train_step
from trainer.outdir import claim_output_dir
from trainer.partitioning import choose_balance
from trainer.predict import check_predict_args, predict
from trainer.resume import ResumePoint, adopt_tokenizer, find_resume, log_changes, run_identity
from trainer.sampling import DirectionSampling
from trainer.strategies import BestModel, check_metric_name, interval_due, resolve_max_steps, tracks_best
from trainer.timeline import write_timeline
from trainer.tokenizer import Tokenizer, load_or_train_tokenizer
from trainer.tracking import Tracker

logger = logging.getLogger("trainer")


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup_tokenizer(cfg: JobConfig, raw: Any, out: Path, rank: int, resume: ResumePoint | None) -> Tokenizer:
    """Rank 0 trains (or loads) and saves the tokenizer; the others load what it saved.

    On resume every rank reads the checkpoint's run's tokenizer back: never retrained or rewritten.
    """
    tok_dir = out / "tokenizer"
    languages = run_languages(cfg.data)
    if resume is not None:
        return Tokenizer.load(adopt_tokenizer(resume, out, rank), languages)
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


def tokenize_shared(cfg: JobConfig, raw: Any, tok: Tokenizer, out: Path, rank: int) -> TranslationData:
    """Rank 0 tokenizes into the on-disk cache (`cache_dir`, default <output_dir>/data_cache); the
    others wait, then load it (a cache hit; on a node without the shared disk they build their own).

    Rank 0's failure is broadcast, so every rank raises it instead of waiting at a barrier
    (one collective: broadcast_object_list).
    """
    cache = Path(cfg.data.cache_dir) if cfg.data.cache_dir else out / "data_cache"
    data: TranslationData | None = None
    failure: list[str | None] = [None]
    if rank == 0:
        try:
            data = tokenize_datasets(raw, tok, cfg.data, cache)
        except Exception as e:
            failure = [f"{type(e).__name__}: {e}"]
            dist.broadcast_object_list(failure, src=0)
            raise
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise DataError(f"rank 0 could not tokenize the data: {failure[0]}")
    return data if data is not None else tokenize_datasets(raw, tok, cfg.data, cache)


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
        from models.hf import load_hf_into

        assert path is not None
        load_hf_into(stage_model, path)  # only this stage's tensors are read

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
        compile_layers=cfg.training.torch_compile,
        saved_tensor_meter=p.profile_activation_memory,
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
    check_predict_args(cfg)
    check_metric_name(cfg.training.metric_for_best_model, [f"{s}-{t}" for s, t in cfg.data.directions()])
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


@dataclass
class RunContext:
    """The pieces `setup_run` builds once; the loop, resume, save and summary read them."""

    cfg: JobConfig
    dims: ParallelDims
    mesh: ParallelMesh
    out: Path
    tok: Tokenizer
    data: TranslationData
    mc: ModelConfig
    sampler: GlobalBatchSampler
    balance: list[int]
    pm: ParallelModel
    optimizer: torch.optim.Optimizer
    scheduler: Any
    log_rank: int  # the last stage's dp=0/tp=0 rank: it holds the loss and writes the metrics
    t_start: float  # perf_counter() before data loading; the summary's wall_time_s counts from here
    fault: FaultInjection | None = None  # TRAINER_FAULT_INJECT, the failure tests' hook
    resume: ResumePoint | None = None  # the checkpoint this session continues, checked by find_resume
    steps_per_epoch: int = 1  # global batches in the sampler's epoch (num_train_epochs, "epoch" strategies)
    best: BestModel = field(default_factory=BestModel)  # best evaluation / checkpoint, early-stop count
    test_raw: RawDatasets | None = (
        None  # do_predict's test pairs, read at set-up (a missing split fails early)
    )

    @property
    def is_logger(self) -> bool:
        return dist.get_rank() == self.log_rank

    @property
    def bubble_theory(self) -> float:
        p = self.cfg.parallel
        return bubble_theory(self.dims.pp, p.num_microbatches, p.virtual_stages, p.pipeline_schedule)


@dataclass
class LoopTotals:
    """What the training loop hands to the summary."""

    step: int
    tokens: int = 0  # source + target tokens over all steps
    time_in_steps: float = 0.0
    bubbles: list[float] = field(default_factory=list)  # measured bubble_fraction per logged step (pp > 1)
    skipped_steps: int = 0  # updates the guard dropped (nan_policy=skip)
    early_stopped: bool = False  # early_stopping_patience ended training before max_steps
    last_eval: tuple[int, dict[str, Any]] | None = None  # (step, metrics) of the latest evaluation
    last_save: int | None = None  # the step of the latest checkpoint written in the loop


def run(cfg: JobConfig) -> dict[str, Any]:
    """Train with an initialised default process group (collective); returns the run summary.

    On the logging rank the summary also holds `history`, every row written to metrics.jsonl.

        validate_early -> find_resume -> claim_output_dir -> setup_run -> resume_state -> tracker, evaluator
        -> [eval before] -> train_loop -> finish_run

    Rank 0 holds output_dir's lock until this returns or raises (trainer.outdir).
    """
    dims = validate_early(cfg, dist.get_world_size())
    resume = find_resume(cfg, dims)  # before the claim: a mismatch with the checkpoint's run writes nothing
    with claim_output_dir(cfg.training, dist.get_rank()) as out:
        ctx = setup_run(cfg, dims, out, resume)
        step = resume_state(ctx)
        tracker = build_tracker(ctx, step)
        evaluator = build_evaluator(ctx)
        before: dict[str, Any] | None = None
        if cfg.training.do_eval and step == 0 and cfg.training.do_train:
            before = evaluator.run(step)
            tracker.log({"step": step, **before})
        args = cfg.training
        # SIGTERM/SIGUSR1 from here on: save at the next step boundary (trainer/guard.py). A signal
        # during the final eval and save is not acted on: the run completes and exits 0.
        with PreemptionSignals() as signals:
            guard = StepGuard(args.nan_policy, args.nan_max_consecutive_skips, ctx.pm.device, signals)
            try:
                totals = (
                    train_loop(ctx, tracker, evaluator, step, guard) if args.do_train else LoopTotals(step)
                )
            except (Preempted, DivergenceError):
                tracker.close()  # rows are already on disk; this ends the W&B run and the progress bar
                raise
            return finish_run(ctx, tracker, evaluator, totals, before)


def setup_run(cfg: JobConfig, dims: ParallelDims, out: Path, resume: ResumePoint | None = None) -> RunContext:
    """Build data, tokenizer, mesh, sampler, partition, model and optimizer (config validated,
    `out` claimed, `resume` checked against the checkpoint's run by `find_resume`).

    Collective (tokenizer barrier, mesh groups, partition profiling). Rank 0 also writes
    config.yaml and model_config.json and logs the mesh and partition.
    """
    rank = dist.get_rank()
    fault = FaultInjection.from_env()
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    set_seed(cfg.training.seed)
    t_start = time.perf_counter()

    raw = load_raw_datasets(cfg.data, cfg.training.seed)
    test_raw = load_test_pairs(cfg.data, cfg.training.seed) if cfg.training.do_predict else None
    tok = setup_tokenizer(cfg, raw, out, rank, resume)
    data = tokenize_shared(cfg, raw, tok, out, rank)
    mc = resume.model_config(cfg) if resume else model_config_for(cfg, tok)
    dims.validate(mc)
    mesh = build_mesh(dims, device.type)
    p = cfg.parallel
    warn_after = p.hang_warning_s or default_warn_after(p.dist_timeout_s)
    start_watchdog(RankIdentity(rank, dims.shape), warn_after, p.dist_timeout_s)
    sampler = build_sampler(cfg, dims.dp, data, tok)
    steps_per_epoch = len(sampler.epoch_plan(0))
    cfg.training.max_steps = resolve_max_steps(cfg.training, steps_per_epoch)  # -1: from num_train_epochs
    logger.info("training %d steps; an epoch is %d global batches", cfg.training.max_steps, steps_per_epoch)
    balance, partition_text = choose_balance(cfg, mc, mesh, sampler, device)
    pm = build_model(cfg, mc, mesh, balance, device)
    optimizer = build_optimizer(pm.model, cfg.training, only=pm.optimizer_params())
    scheduler = build_scheduler(optimizer, cfg.training)
    log_rank = coords_to_rank((pm.plan.last_stage_rank, 0, 0), dims.shape)
    if rank == 0:
        record_setup(cfg, out, dims, mc, partition_text, data.skipped, resume)
    return RunContext(
        cfg=cfg,
        dims=dims,
        mesh=mesh,
        out=out,
        tok=tok,
        data=data,
        mc=mc,
        sampler=sampler,
        balance=balance,
        pm=pm,
        optimizer=optimizer,
        scheduler=scheduler,
        log_rank=log_rank,
        t_start=t_start,
        fault=fault,
        resume=resume,
        steps_per_epoch=steps_per_epoch,
        best=BestModel.from_args(cfg.training),
        test_raw=test_raw,
    )


def build_sampler(cfg: JobConfig, dp: int, data: TranslationData, tok: Tokenizer) -> GlobalBatchSampler:
    """The seeded, resumable sampler of global batches, cut into m * g * dp slots."""
    layout = BatchLayout(
        cfg.training.per_device_train_batch_size,
        cfg.parallel.num_microbatches,
        cfg.training.gradient_accumulation_steps,
        dp,
        cfg.data.max_tokens_per_microbatch,
    )
    weights = cfg.data.direction_weights(cfg.data.sampling_weights)
    sampling = DirectionSampling(cfg.data.sampling_temperature, weights)
    sampler = GlobalBatchSampler(
        data.train,
        layout,
        cfg.training.seed,
        tok.pad_id,
        tok.special_ids()["decoder_start_token_id"],
        sampling,
    )
    expected = {name: share["expected"] for name, share in sampler.shares().items()}
    logger.info(
        "direction sampling T=%g weights %s: expected shares %s", sampling.temperature, weights, expected
    )
    return sampler


def record_setup(
    cfg: JobConfig,
    out: Path,
    dims: ParallelDims,
    mc: ModelConfig,
    partition_text: str,
    skipped: dict[str, dict[str, int]],
    resume: ResumePoint | None = None,
) -> None:
    """Rank 0: config.yaml and model_config.json into output_dir; mesh, partition and size to the log.

    On resume they stay the run's: written only where absent (resuming into a new output_dir);
    the settings changed on resume go to the log (and to later checkpoints' trainer_state.json).
    """
    if resume is not None:
        log_changes(resume)
    if resume is None or not (out / "config.yaml").is_file():
        cfg.save(out / "config.yaml")
    if resume is None or not (out / "model_config.json").is_file():
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
    logger.info("model: %.2fM parameters; data skipped: %s", mc.num_parameters() / 1e6, skipped)


def resume_state(ctx: RunContext) -> int:
    """Restore model, optimizer, scheduler and sampler from `resume_from_checkpoint`.

    Returns:
        The step to continue from: the checkpoint's, or 0 when there is nothing to resume.
    """
    log_restart(ctx.cfg.training.resume_from_checkpoint, ctx.resume.path if ctx.resume else None)
    if ctx.resume is None:
        return 0
    resume = ctx.resume.path
    state = ckpt.load_checkpoint(
        resume,
        [ctx.pm.model],
        ctx.optimizer,
        to_logical=ctx.pm.to_logical,
        restore_rng=state_mesh_matches(resume, ctx.dims),
    )
    ctx.scheduler.load_state_dict(state["scheduler"])
    # The optimizer's param groups carry the lr of the *next* step; DCP restored only tensors.
    for group, lr in zip(ctx.optimizer.param_groups, ctx.scheduler.get_last_lr()):
        group["lr"] = lr
    ctx.sampler.load_state_dict(state["data"])
    ctx.best.load_state_dict(state)
    step = int(state["step"])
    if step > ctx.cfg.training.max_steps:
        raise ConfigError(
            f"num_train_epochs={ctx.cfg.training.num_train_epochs} gives max_steps="
            f"{ctx.cfg.training.max_steps}, below the step of resume_from_checkpoint={resume} ({step})"
        )
    logger.info("resumed from %s at step %d", resume, step)
    return step


def log_restart(resume_from_checkpoint: str | None, resume: Path | None) -> None:
    """On a group restarted by `torchrun --max-restarts`, say where this attempt starts.

    A restart never resumes on its own: the config decides. Resuming without
    `resume_from_checkpoint` would pick up whatever checkpoint lies in output_dir,
    which need not be this run's; so a restart without it trains from step 0 again,
    and says so loudly.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or dist.get_rank() != 0:
        return
    limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
    if resume is not None:
        logger.warning("restart %d of %s: resuming from %s", attempt, limit, resume)
    elif resume_from_checkpoint:
        logger.warning("restart %d of %s: no committed checkpoint yet; training from step 0", attempt, limit)
    else:
        logger.warning(
            "restart %d of %s: resume_from_checkpoint is not set, so this attempt trains from step 0 "
            "again; pass --resume_from_checkpoint latest --save_steps K to continue from the last "
            "committed checkpoint",
            attempt,
            limit,
        )


def build_tracker(ctx: RunContext, step: int) -> Tracker:
    """metrics.jsonl / W&B / progress bar, enabled on the logging rank only; the bar starts at `step`."""
    args = ctx.cfg.training
    run_config = {
        **ctx.cfg.to_dict(),
        "mesh": mesh_sizes(ctx.dims),
        "partition": ctx.balance,
        "num_parameters": ctx.mc.num_parameters(),
    }
    return Tracker(
        str(ctx.out),
        ctx.is_logger,
        args.report_to,
        args.run_name,
        args.wandb_project,
        run_config,
        args.max_steps,
        args.disable_tqdm,
        initial_step=step,
    )


def build_evaluator(ctx: RunContext) -> Evaluator:
    """Evaluation over the validation batches of every direction; metrics land on the logging rank."""
    batches = eval_batches(ctx.data, ctx.tok, ctx.cfg.training.per_device_eval_batch_size)
    return Evaluator(ctx.pm, ctx.mesh, ctx.tok, batches, ctx.cfg.training, ctx.log_rank)


def train_loop(
    ctx: RunContext, tracker: Tracker, evaluator: Evaluator, step: int, guard: StepGuard
) -> LoopTotals:
    """Steps `step + 1 .. max_steps`: train, log, draw the timeline once, evaluate and save between.

    Collective: every rank runs the same steps and, at the same steps, the same
    bubble_stats, timeline gather, evaluation and checkpoint, in that order.

    Raises:
        DivergenceError: the guard stopped training (nan_policy).
        Preempted: a preemption signal arrived; the step it was agreed at is checkpointed.
    """
    args, pm, pp = ctx.cfg.training, ctx.pm, ctx.dims.pp
    theory = ctx.bubble_theory if pp > 1 else None
    pm.model.train()
    totals = LoopTotals(step)
    window = LogWindow(pm, _mesh_peak_flops(ctx))
    timeline_step = min(args.max_steps, max(2, args.logging_steps))
    drawn_mark = ctx.sampler.drawn.copy()  # examples per direction at the window's start
    while step < args.max_steps:
        step += 1
        if ctx.fault is not None:
            ctx.fault.maybe_fire(step, dist.get_rank())
        log_now = step % args.logging_steps == 0 or step == args.max_steps
        gb = next(ctx.sampler)
        start = time.perf_counter()
        st = train_step(
            pm,
            ctx.optimizer,
            ctx.scheduler,
            gb,
            ctx.mesh.dp_rank,
            args.max_grad_norm,
            step,
            timed=log_now or step == timeline_step,
            guard=guard,
        )
        flops = step_flops(ctx.mc, *ctx.sampler.example_lengths(gb)) if window.peak_flops else 0.0
        window.add(st, time.perf_counter() - start, flops)
        tracker.advance()
        if log_now:
            shares = ctx.sampler.shares_since(drawn_mark)
            drawn_mark = ctx.sampler.drawn.copy()
            row = log_row(tracker, pm, st, gb.epoch, theory, window, guard.skipped, shares)
            if pp > 1:
                totals.bubbles.append(row["bubble_fraction"])
        if step == timeline_step and pp > 1:
            png = write_timeline(pm, st.flushes, ctx.out, ctx.is_logger, step)
            if png:
                tracker.log_image(step, "pipeline_timeline", png)
        if st.preempt_signal:
            raise preempt(ctx, step, st.preempt_signal)
        if maybe_eval_and_save(ctx, tracker, evaluator, step, guard, totals):
            totals.early_stopped = True
            logger.info("early stopping at step %d: %s", step, ctx.best.state_dict())
            break
    totals.step, totals.skipped_steps = step, guard.skipped
    totals.tokens, totals.time_in_steps = window.total_tokens, window.total_s
    return totals


def _mesh_peak_flops(ctx: RunContext) -> float | None:
    """Peak FLOP/s of the whole mesh (for MFU), or None where the device's peak is unknown."""
    peak = peak_flops(ctx.pm.device, ctx.cfg.training.bf16, ctx.cfg.training.mfu_peak_tflops)
    return peak * dist.get_world_size() if peak else None


def log_row(
    tracker: Tracker,
    pm: ParallelModel,
    st: StepStats,
    epoch: int,
    theory: float | None,
    window: LogWindow,
    skipped_steps: int = 0,
    shares: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Build and log one training row (collective over dp and pp: call on every rank).

    Args:
        st: the logged step's stats.
        epoch: the sampler's epoch of this step's global batch.
        theory: the schedule's bubble fraction, logged beside the measured one; None when pp == 1.
        window: the steps since the last row: loss, tokens/s, step time and MFU are its averages.
        skipped_steps: steps whose update the guard has skipped so far (nan_policy=skip).
        shares: per direction, its fraction of the examples sampled in the window
            (`GlobalBatchSampler.shares_since`), logged as `share/<direction>` (dashboards:
            `train/share/<direction>`).

    Returns:
        The row (built on every rank; written only by the logging rank's tracker).
    """
    row = {
        "step": st.step,
        "lr": st.lr,
        **window.read(st),
        "epoch": epoch,
        "skipped_steps": skipped_steps,
        **bubble_stats(pm, st.flushes),
        **{f"share/{name}": share for name, share in (shares or {}).items()},
    }
    if theory is not None:
        row["bubble_fraction_theory"] = theory
    if torch.cuda.is_available():
        row["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
    tracker.log(row)
    return row


def maybe_eval_and_save(
    ctx: RunContext, tracker: Tracker, evaluator: Evaluator, step: int, guard: StepGuard, totals: LoopTotals
) -> bool:
    """Evaluate and checkpoint when eval_strategy / save_strategy say so (collective: all ranks, same step).

    An evaluation runs to its end; a preemption signal that arrived during it is agreed
    on right after (one extra read per evaluation) and saved then, not a step later.

    Returns:
        Whether early stopping ends training here (same answer on every rank).

    Raises:
        Preempted: a preemption signal arrived during the evaluation (step `step` is saved).
    """
    args = ctx.cfg.training
    if step >= args.max_steps:  # the last step's eval and checkpoint are finish_run's
        return False
    if interval_due(args.eval_strategy, args.eval_steps, step, ctx.steps_per_epoch):
        evaluate_at(ctx, tracker, evaluator, step, totals)
        signum = guard.preemption_agreed()
        if signum:
            raise preempt(ctx, step, signum)
    if interval_due(args.save_strategy, args.save_steps, step, ctx.steps_per_epoch):
        save(ctx, step)
        totals.last_save = step
    evaluated_now = totals.last_eval is not None and totals.last_eval[0] == step
    return evaluated_now and ctx.best.should_stop(args.early_stopping_patience)


def evaluate_at(
    ctx: RunContext, tracker: Tracker, evaluator: Evaluator, step: int, totals: LoopTotals
) -> dict[str, Any]:
    """Evaluate at `step`, log the row, and (best model / early stopping) record it (collective).

    The metrics live on the logging rank; when a best model is tracked they are broadcast
    from it (one object per evaluation), so every rank takes the same decisions.
    """
    metrics = evaluator.run(step, tracker)
    tracker.log({"step": step, **metrics})
    args = ctx.cfg.training
    if tracks_best(args):
        box = [metrics]
        dist.broadcast_object_list(box, src=ctx.log_rank)
        metrics = box[0]
        ctx.best.update(step, metrics, args.early_stopping_threshold)
    totals.last_eval = (step, metrics)
    return metrics


def load_best_model(ctx: RunContext, step: int) -> None:
    """load_best_model_at_end: read the best checkpoint's weights into the model (collective).

    Only after training (do_train): a do_train=false run evaluates / predicts the checkpoint it
    was given (resume_from_checkpoint or model_name_or_path), as HF's does.
    """
    best, args = ctx.best.best_model_checkpoint, ctx.cfg.training
    if not (args.do_train and args.load_best_model_at_end) or best is None or ctx.best.best_step == step:
        return
    ckpt.load_checkpoint(Path(best), [ctx.pm.model], None, to_logical=ctx.pm.to_logical, restore_rng=False)
    logger.info("loaded the best model: %s (%s = %s)", best, ctx.best.metric, ctx.best.best_metric)


def preempt(ctx: RunContext, step: int, signum: int) -> Preempted:
    """Checkpoint `step` (collective) and return the `Preempted` for the caller to raise."""
    save(ctx, step)
    err = Preempted(step, signum, str(ckpt.checkpoint_dir(ctx.out, step)))
    logger.warning("preempted: %s", err)
    return err


def finish_run(
    ctx: RunContext,
    tracker: Tracker,
    evaluator: Evaluator,
    totals: LoopTotals,
    before: dict[str, Any] | None,
) -> dict[str, Any]:
    """Final eval and checkpoint, the best model loaded, do_predict, then the summary:
    run_summary.json and the printed table on the logging rank, with `history` added on
    return (collective: eval, save, load, predict, barrier)."""
    step, args = totals.step, ctx.cfg.training
    after: dict[str, Any] = {}
    if args.do_eval:  # an evaluation at this very step (early stopping) is not repeated
        last = totals.last_eval
        after = last[1] if last and last[0] == step else evaluate_at(ctx, tracker, evaluator, step, totals)
    if args.do_train and totals.last_save != step:
        save(ctx, step)
    load_best_model(ctx, step)
    if args.do_train and args.load_best_model_at_end and ctx.best.best_metrics is not None:
        after = ctx.best.best_metrics  # the model the run ends with
    predicted = predict(ctx) if args.do_predict else {}
    summary = run_summary(ctx, totals, before, after)
    summary["predict"] = {k: v for k, v in predicted.items() if k.startswith("predict_")}
    if ctx.is_logger:
        (ctx.out / "run_summary.json").write_text(json.dumps(summary, indent=1, default=str))
        _print_summary(summary)
    summary["history"] = tracker.history
    tracker.close()
    dist.barrier()
    return summary


def run_summary(
    ctx: RunContext, totals: LoopTotals, before: dict[str, Any] | None, after: dict[str, Any]
) -> dict[str, Any]:
    """The run_summary.json fields (without `predict` and `history`)."""
    pp, out, step = ctx.dims.pp, ctx.out, totals.step
    return {
        "mesh": mesh_sizes(ctx.dims),
        "partition": ctx.balance,
        "bubble_fraction_theory": ctx.bubble_theory,
        **({"before": before} if before is not None else {}),
        "after": after,
        "steps": step,
        "skipped_steps": totals.skipped_steps,
        "early_stopped": totals.early_stopped,
        "best_metric": ctx.best.best_metric,
        "best_model_checkpoint": ctx.best.best_model_checkpoint,
        "wall_time_s": time.perf_counter() - ctx.t_start,
        "tokens_per_sec": totals.tokens / totals.time_in_steps if totals.time_in_steps else 0.0,
        "bubble_fraction": float(np.mean(totals.bubbles)) if totals.bubbles else None,
        "timeline_png": str(out / "timeline.png") if pp > 1 else None,
        "timeline_trace": str(out / "timeline_trace.json") if pp > 1 else None,
        "data_skipped": ctx.data.skipped,
        "direction_shares": ctx.sampler.shares(),
        "output_dir": str(out),
        "last_checkpoint": str(ckpt.checkpoint_dir(out, step)) if ctx.cfg.training.do_train else None,
    }


def mesh_sizes(dims: ParallelDims) -> dict[str, int]:
    """The mesh as recorded in run config, checkpoints and the summary."""
    return {"pp": dims.pp, "dp": dims.dp, "tp": dims.tp}


def state_mesh_matches(path: Path, dims: ParallelDims) -> bool:
    saved = json.loads((path / "trainer_state.json").read_text()).get("mesh", {})
    return saved == mesh_sizes(dims)


def save(ctx: RunContext, step: int) -> None:
    """Checkpoint model, optimizer, scheduler and sampler at `step` (collective).

    Raises:
        DivergenceError: some rank holds a non-finite parameter or optimizer state; nothing is written.
    """
    path = ckpt.checkpoint_dir(ctx.out, step)
    assert_finite_state(ctx.pm.model, ctx.optimizer, path.name)
    state = {
        "step": step,
        "scheduler": ctx.scheduler.state_dict(),
        "data": ctx.sampler.state_dict(),
        "mesh": mesh_sizes(ctx.dims),
        "partition": ctx.balance,
        "model_config": ctx.pm.model.config.to_dict(),
        **run_identity(ctx.cfg, ctx.out / "tokenizer"),  # what a resume checks it continues
    }
    ctx.best.saved(step, str(path))
    state["best_model"] = ctx.best.state_dict()  # HF's best_metric / best_model_checkpoint, at top level too
    state["best_metric"], state["best_model_checkpoint"] = (
        ctx.best.best_metric,
        ctx.best.best_model_checkpoint,
    )
    best = ctx.best.best_model_checkpoint
    ckpt.save_checkpoint(
        path,
        [ctx.pm.model],
        ctx.optimizer,
        state,
        to_logical=ctx.pm.to_logical,
        save_total_limit=ctx.cfg.training.save_total_limit,
        keep=Path(best) if best else None,
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
    lines.append(f"output_dir           {s['output_dir']}")
    lines.append(f"last checkpoint      {s['last_checkpoint']}")
    if s.get("best_model_checkpoint"):
        lines.append(
            f"best checkpoint      {s['best_model_checkpoint']} (best_metric {s['best_metric']:.4g})"
        )
    export_from = s.get("best_model_checkpoint") or s["last_checkpoint"]
    export_dir = str(Path(s["output_dir"]) / "hf_export")
    if export_from:
        lines.append(
            f"export               python -m trainer.export --checkpoint {export_from} --output {export_dir}"
        )
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    try:
        main()
    except Preempted as e:  # a committed checkpoint was written: requeue and resume (trainer/guard.py)
        print(f"preempted: {e}", file=sys.stderr)
        sys.exit(EXIT_PREEMPTED)
    except (ConfigError, ValueError, FileNotFoundError, DivergenceError, ckpt.CheckpointWriteError) as e:
        # bad input (2), divergence (3) or a failed checkpoint write (1): one clear line, not a traceback
        if os.environ.get("TRAINER_TRACEBACK"):
            raise
        print(f"error: {type(e).__name__}: {e} (TRAINER_TRACEBACK=1 for the traceback)", file=sys.stderr)
        if isinstance(e, DivergenceError):
            sys.exit(EXIT_DIVERGED)
        sys.exit(1 if isinstance(e, ckpt.CheckpointWriteError) else 2)
