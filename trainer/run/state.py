"""The run's state to and from checkpoints: save at a step, resume, load the best model.

What a checkpoint holds beside the tensors (`trainer_state.json`): the step, scheduler, sampler,
mesh, partition, model config, the run identity a resume checks, the best-model record, and
(fp16) the loss scale and its growth tracker.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch.distributed as dist

from parallel.mesh import ParallelDims
from trainer.checkpoint import dcp as ckpt
from trainer.checkpoint.resume import run_identity
from trainer.errors import ConfigError
from trainer.run.guard import assert_finite_state
from trainer.run.setup import RunContext

logger = logging.getLogger("trainer")


def resume_state(ctx: RunContext) -> int:
    """Restore model, optimizer, scheduler, sampler (and fp16's loss scale) from `resume_from_checkpoint`.

    Returns:
        The step to continue from: the checkpoint's, or 0 when there is nothing to resume.
    """
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
    if ctx.loss_scale is not None and "loss_scale" in state:  # else: an fp32/bf16 run goes on in fp16
        ctx.loss_scale.load_state_dict(state["loss_scale"])
    step = int(state["step"])
    if step > ctx.cfg.training.max_steps:
        raise ConfigError(
            f"num_train_epochs={ctx.cfg.training.num_train_epochs} gives max_steps="
            f"{ctx.cfg.training.max_steps}, below the step of resume_from_checkpoint={resume} ({step})"
        )
    logger.info("resumed from %s at step %d", resume, step)
    return step


def log_start(resume_from_checkpoint: str | None, resume: Path | None, output_dir: str) -> None:
    """Say in one line where this run starts (rank 0, before the set-up) when that is not what the
    config reads as: `resume_from_checkpoint` asked for and nothing to resume (a mistyped output_dir
    would otherwise become a fresh run in silence), and on every group restarted by
    `torchrun --max-restarts`.

    A restart never resumes on its own: the config decides. Resuming without
    `resume_from_checkpoint` would pick up whatever checkpoint lies in output_dir,
    which need not be this run's; so a restart without it trains from step 0 again,
    and says so loudly.
    """
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    restart = f"restart {attempt} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}: " if attempt else ""
    if resume is not None:
        if attempt:
            logger.warning("%sresuming from %s", restart, resume)
    elif resume_from_checkpoint:  # "latest" with nothing there yet ("true" was refused by find_resume)
        logger.warning(
            "%sresume_from_checkpoint=%s: no committed checkpoint in output_dir %r: training starts from step 0",
            restart, resume_from_checkpoint, output_dir,
        )  # fmt: skip
    elif attempt:
        logger.warning(
            "%sresume_from_checkpoint is not set, so this attempt trains from step 0 again; pass "
            "--resume_from_checkpoint latest --save_steps K to continue from the last committed checkpoint",
            restart,
        )


def load_best_model(ctx: RunContext, step: int) -> None:
    """load_best_model_at_end: read the best checkpoint's weights into the model (collective).

    Only after training (do_train): a do_train=false run evaluates / predicts the checkpoint it
    was given (resume_from_checkpoint or model_name_or_path), as HF's does.
    """
    best, args = ctx.best.best_model_checkpoint, ctx.cfg.training
    if not (args.do_train and args.load_best_model_at_end) or best is None or ctx.best.best_step == step:
        return
    ctx.saver.wait()  # the best checkpoint may be the one still being written
    ckpt.load_checkpoint(Path(best), [ctx.pm.model], None, to_logical=ctx.pm.to_logical, restore_rng=False)
    logger.info("loaded the best model: %s (%s = %s)", best, ctx.best.metric, ctx.best.best_metric)


def mesh_sizes(dims: ParallelDims) -> dict[str, int]:
    """The mesh as recorded in run config, checkpoints and the summary (ep where experts are spread)."""
    return {"pp": dims.pp, "dp": dims.dp, "tp": dims.tp, **({"ep": dims.ep} if dims.ep > 1 else {})}


def state_mesh_matches(path: Path, dims: ParallelDims) -> bool:
    saved = json.loads((path / "trainer_state.json").read_text()).get("mesh", {})
    return saved == mesh_sizes(dims)


def save(ctx: RunContext, step: int) -> None:
    """Checkpoint model, optimizer, scheduler and sampler at `step` (collective); with async_save
    the write goes on in the background until `ctx.saver.wait()` (the next save waits for it).

    Raises:
        DivergenceError: some rank holds a non-finite parameter or optimizer state; nothing is written.
        CheckpointWriteError: this save (or the asynchronous one before it) failed on some rank.
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
    if ctx.loss_scale is not None:  # fp16: S and its growth tracker (one read, at save time only)
        state["loss_scale"] = ctx.loss_scale.state_dict()
    ctx.best.saved(step, str(path))
    state["best_model"] = ctx.best.state_dict()  # HF's best_metric / best_model_checkpoint, at top level too
    state["best_metric"], state["best_model_checkpoint"] = (
        ctx.best.best_metric,
        ctx.best.best_model_checkpoint,
    )
    best = ctx.best.best_model_checkpoint
    ctx.saver.save(
        path,
        [ctx.pm.model],
        ctx.optimizer,
        state,
        to_logical=ctx.pm.to_logical,
        save_total_limit=ctx.cfg.training.save_total_limit,
        keep=Path(best) if best else None,
        asynchronous=ctx.cfg.training.async_save,
    )
