"""A training run from a validated config to its summary, and the loop over steps.

run              resume point (checked) -> validate -> claim output dir (lock, fresh-start
                 cleanup) -> setup_run -> resume_state -> tracker, evaluator -> ...
                 (every evaluation row is logged to the console; curves.png redrawn once a minute at most)
train_loop       per step: train_step (guarded) -> log_row -> timeline (once) -> preempted? save + exit
                 -> maybe_eval_and_save (eval/save strategies, best model, early stop: trainer.run.strategies)
finish_run       final eval -> checkpoint -> best model loaded -> do_predict (trainer.eval.predict,
                 its scores on the console) -> run_summary.json
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from parallel.compile import CompileCounts
from parallel.parallelize import ParallelModel
from trainer.checkpoint import dcp as ckpt
from trainer.checkpoint.resume import TOKENIZER, find_resume
from trainer.config.checks import check_trackers
from trainer.config.dims import parallel_dims
from trainer.config.schema import JobConfig
from trainer.data.batching import eval_batches
from trainer.eval.predict import predict_test_set
from trainer.eval.runner import Evaluator
from trainer.lifetime import ParentWatch
from trainer.progress import PROGRESS_LOGGER
from trainer.run.console import predict_line
from trainer.run.flops import peak_flops, step_flops
from trainer.run.guard import (
    DivergenceError,
    Preempted,
    PreemptionSignals,
    StepGuard,
)
from trainer.run.memory import gather_memory, memory_lines, peak_host_bytes
from trainer.run.moe_load import load_line
from trainer.run.outdir import claim_output_dir
from trainer.run.preflight import idle_option_warnings, validate_early
from trainer.run.setup import RunContext, setup_run
from trainer.run.state import load_best_model, log_start, mesh_sizes, resume_state, save
from trainer.run.step import LogWindow, StepStats, bubble_stats, train_step
from trainer.run.strategies import interval_due, tracks_best
from trainer.run.summary import LoopTotals, compile_summary, print_summary, run_summary
from trainer.run.timeline import write_timeline
from trainer.run.tracking import Tracker

logger = logging.getLogger("trainer")


def run(cfg: JobConfig, launcher: ParentWatch | None = None) -> dict[str, Any]:
    """Train with an initialised default process group (collective); returns the run summary.

    `launcher`: torchrun's agent, watched from the rank's start (trainer/lifetime.py): once it is
    gone the rank saves at the next step boundary and exits (trainer.run.guard).

    On the logging rank the summary also holds `history`, every row written to metrics.jsonl.

        find_resume (log_start) -> validate_early -> claim_output_dir -> setup_run -> resume_state -> tracker, evaluator
        -> [eval before] -> train_loop -> finish_run

    Rank 0 holds output_dir's lock until this returns or raises (trainer.run.outdir).
    """
    world = dist.get_world_size()
    # Before the claim: a mismatch with the checkpoint's run writes nothing. A resume takes the
    # architecture from the checkpoint (model_name_or_path is not read again: it may be gone).
    resume = find_resume(cfg, parallel_dims(cfg.parallel, world).validate())  # the mesh alone
    log_start(cfg.training.resume_from_checkpoint, resume.path if resume else None, cfg.training.output_dir)
    dims = validate_early(
        cfg, world, arch=resume.model_config(cfg) if resume else None,
        run_tokenizer=resume.run_dir / TOKENIZER if resume else None,
    )  # fmt: skip
    check_trackers(cfg.training.report_to)  # W&B / TensorBoard installed: refused here, not after set-up
    if dist.get_rank() == 0:
        for line in idle_option_warnings(cfg):
            logger.warning("config: %s", line)
    with claim_output_dir(cfg.training, dist.get_rank()) as out:
        ctx = setup_run(cfg, dims, out, resume)
        try:
            return _run(ctx, cfg, launcher)
        finally:
            ctx.sampler.close()  # a stream's worker processes


def _run(ctx: RunContext, cfg: JobConfig, launcher: ParentWatch | None) -> dict[str, Any]:
    """`run` from the set-up on: resume, the evaluation before, the loop and the end."""
    step = resume_state(ctx)
    tracker = build_tracker(ctx, step)
    evaluator = build_evaluator(ctx)
    before: dict[str, Any] | None = None
    if cfg.training.do_eval and step == 0 and cfg.training.do_train:
        before = evaluator.run(step)
        tracker.log({"step": step, **before})
        tracker.draw_curves(step)
    args = cfg.training
    # Stop signals (SIGTERM, SIGUSR1, SIGINT, SIGHUP) from here on: save at the next step boundary
    # (trainer/run/guard.py). A signal during the final eval and save is not acted on: the run
    # completes and exits 0.
    with PreemptionSignals(launcher=launcher, announce=dist.get_rank() == 0) as signals:
        guard = StepGuard(args.nan_policy, args.nan_max_consecutive_skips, ctx.pm.device, signals)
        try:
            totals = train_loop(ctx, tracker, evaluator, step, guard) if args.do_train else LoopTotals(step)
        except (Preempted, DivergenceError):  # agreed by every rank: the save in flight can finish
            tracker.draw_curves(tracker.step, final=True)  # up to the stop (a divergence shows there)
            tracker.close()  # rows are already on disk; this ends the W&B run and the progress bar
            ctx.saver.wait()
            raise
        return finish_run(ctx, tracker, evaluator, totals, before)


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
        plots=args.plots,
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
    window = LogWindow(pm, _mesh_peak_flops(ctx), ctx.loss_scale)
    timeline_step = min(args.max_steps, max(2, args.logging_steps))
    drawn_mark = ctx.sampler.drawn.copy()  # examples per direction at the window's start
    while step < args.max_steps:
        step += 1
        if ctx.fault is not None:
            ctx.fault.maybe_fire(step, dist.get_rank())
        log_now = step % args.logging_steps == 0 or step == args.max_steps
        waited = time.perf_counter()
        gb = next(ctx.sampler)  # streaming: may wait for its chunks to be read and tokenized
        compiled = CompileCounts.now()
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
            seed=args.seed,
            scaler=ctx.loss_scale,
            distill=ctx.distill,
        )
        seconds = time.perf_counter() - start
        totals.count_compiles(CompileCounts.now() - compiled)
        flops = step_flops(ctx.mc, *gb.example_lengths()) if window.peak_flops else 0.0
        window.add(st, seconds, flops, start - waited, gb.padded_tokens)
        tracker.advance()
        if log_now:
            shares = ctx.sampler.shares_since(drawn_mark)
            drawn_mark = ctx.sampler.drawn.copy()
            row = log_row(tracker, pm, st, gb.epoch, theory, window, guard.skipped, shares, guard.overflows)
            if pp > 1:
                totals.bubbles.append(row["bubble_fraction"])
        if step == timeline_step and pp > 1:
            png = write_timeline(pm, st.flushes, ctx.out, ctx.is_logger, step, draw=args.plots)
            if png:
                tracker.log_image(step, "pipeline_timeline", png)
        if st.preempt_signal:
            raise preempt(ctx, step, st.preempt_signal, guard)
        if maybe_eval_and_save(ctx, tracker, evaluator, step, guard, totals):
            totals.early_stopped = True
            logger.info("early stopping at step %d: %s", step, ctx.best.state_dict())
            break
    totals.step, totals.skipped_steps, totals.overflow_steps = step, guard.skipped, guard.overflows
    totals.tokens, totals.time_in_steps = window.total_tokens, window.total_s
    totals.data_time = window.total_data_s
    return totals


def _mesh_peak_flops(ctx: RunContext) -> float | None:
    """Peak FLOP/s of the whole mesh (for MFU), or None where the device's peak is unknown."""
    args = ctx.cfg.training
    peak = peak_flops(ctx.pm.device, args.half_precision, args.mfu_peak_tflops)
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
    overflow_steps: int = 0,
) -> dict[str, Any]:
    """Build and log one training row (collective over dp and pp: call on every rank).

    Args:
        st: the logged step's stats.
        epoch: the sampler's epoch of this step's global batch.
        theory: the schedule's bubble fraction, logged beside the measured one; None when pp == 1.
        window: the steps since the last row: loss, tokens/s, step time and MFU are its averages.
        skipped_steps: steps whose update the guard has skipped so far (nan_policy=skip).
        overflow_steps: steps skipped so far for an fp16 gradient overflow (apart from skipped_steps).
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
        "overflow_steps": overflow_steps,
        **bubble_stats(pm, st.flushes),
        **{f"share/{name}": share for name, share in (shares or {}).items()},
    }
    if theory is not None:
        row["bubble_fraction_theory"] = theory
    if torch.cuda.is_available():
        row["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
    tracker.log(row)
    if (
        tracker.enabled and "moe_aux_loss" in row
    ):  # beside the step's line, also where the logging rank is not 0
        logging.getLogger(PROGRESS_LOGGER).info("step %d %s", st.step, load_line(row))
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
            raise preempt(ctx, step, signum, guard)
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
    tracker.log({"step": step, **metrics})  # also the console's evaluation line
    tracker.draw_curves(step)
    args = ctx.cfg.training
    if tracks_best(args):
        box = [metrics]
        dist.broadcast_object_list(box, src=ctx.log_rank)
        metrics = box[0]
        ctx.best.update(step, metrics, args.early_stopping_threshold)
    totals.last_eval = (step, metrics)
    return metrics


def preempt(ctx: RunContext, step: int, signum: int, guard: StepGuard) -> Preempted:
    """Checkpoint `step` (collective) and return the `Preempted` for the caller to raise."""
    save(ctx, step)
    ctx.saver.wait()  # exit only once it is committed
    cause = guard.signals.cause(signum) if guard.signals is not None else None
    return Preempted(step, signum, str(ckpt.checkpoint_dir(ctx.out, step)), cause)


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
    train_host = peak_host_bytes()  # before the final eval and save
    after: dict[str, Any] = {}
    if args.do_eval:  # an evaluation at this very step (early stopping) is not repeated
        last = totals.last_eval
        after = last[1] if last and last[0] == step else evaluate_at(ctx, tracker, evaluator, step, totals)
    if args.do_train and totals.last_save != step:
        save(ctx, step)
    ctx.saver.wait()  # the last checkpoint committed before the best model is read and the run ends
    load_best_model(ctx, step)
    if args.do_train and args.load_best_model_at_end and ctx.best.best_metrics is not None:
        after = ctx.best.best_metrics  # the model the run ends with
    predicted = predict_test_set(ctx) if args.do_predict else {}
    if predicted:  # the logging rank's scores; the files are predict_results.json and predictions_*.txt
        tracker.say(f"{predict_line(predicted)} | {ctx.out / 'predict_results.json'}")
    summary = run_summary(ctx, totals, before, after)
    teacher = ctx.distill.teacher.parameter_bytes if ctx.distill is not None else -1
    summary["memory"] = gather_memory(ctx.startup_peak_host_bytes, train_host, ctx.pm.device, teacher)
    summary["compile"] = compile_summary(totals, ctx.cfg.training.torch_compile, ctx.pm.device)
    summary["predict"] = {k: v for k, v in predicted.items() if k.startswith("predict_")}
    if ctx.is_logger:
        (ctx.out / "run_summary.json").write_text(json.dumps(summary, indent=1, default=str))
        print_summary(summary)
        logger.info("memory per rank: %s", "; ".join(memory_lines(summary["memory"])))
    summary["history"] = tracker.history
    tracker.draw_curves(step, final=True)  # the last rows since the last drawing (none drawn twice)
    tracker.close()
    dist.barrier()
    return summary
