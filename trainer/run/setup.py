"""Set-up of a training run: everything built once before the first step.

    setup_run        data + tokenizer (trainer.run.data) -> mesh -> sampler ->
                     partition -> model (HF import, parallelize) -> distillation teacher
                     (trainer.run.distill) -> optimizer/scheduler (-> fp16 loss scale)

The pieces land in a `RunContext`, which the loop, resume, save and summary read.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from models.config import ModelConfig
from parallel.distill.teacher import DistillationLoss
from parallel.loss_scale import DynamicLossScale
from parallel.mesh import ParallelDims, ParallelMesh, build_mesh, coords_to_rank
from parallel.parallelize import ParallelModel, build_parallel_model
from parallel.pipeline.simulate import bubble_theory
from parallel.watchdog import RankIdentity, default_warn_after, start_watchdog
from trainer.checkpoint.async_save import CheckpointSaver
from trainer.checkpoint.resume import ResumePoint, log_changes
from trainer.config.pretrained import pretrained_sources
from trainer.config.schema import JobConfig
from trainer.config.training_args import TrainingArguments
from trainer.data.sources import RawDatasets, nonzero_skips
from trainer.data.tokenization import TranslationData
from trainer.progress import PROGRESS_LOGGER
from trainer.run.balance import choose_partition
from trainer.run.data import build_sampler, setup_data
from trainer.run.distill import build_teacher, check_mesh, distilling, teacher_source
from trainer.run.faults import FaultInjection
from trainer.run.memory import peak_host_bytes
from trainer.run.step import build_optimizer, build_scheduler
from trainer.run.strategies import BestModel, resolve_max_steps
from trainer.tokenizer.vocab import Tokenizer

logger = logging.getLogger("trainer")


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def model_config_for(cfg: JobConfig, tok: Tokenizer) -> ModelConfig:
    """The run's architecture: the pretrained model's (with the run's regularisation), or the config's
    fields for a new model on the tokenizer's vocabulary (`run_tokenizer` checked a pretrained one)."""
    model = pretrained_sources(cfg.model.model_name_or_path, cfg.model.tokenizer_name).model
    if model is not None:
        from models.hf import read_hf_config

        mc = cfg.model.apply_session(read_hf_config(model))
        return mc
    rows = tok.vocab_size
    if cfg.model.teacher_model_name_or_path:  # the teacher's embedding rows: the KL term goes id by id
        rows = teacher_source(cfg.model.teacher_model_name_or_path).config.vocab_size
    return cfg.model.model_config(rows, tok.special_ids())


def working_dtype(args: TrainingArguments) -> torch.dtype | None:
    """The working-weight and autocast dtype: float16 (fp16), bfloat16 (bf16), or None (fp32)."""
    return torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else None


def full_eval_dtype(args: TrainingArguments) -> torch.dtype | None:
    """The dtype evaluation casts every weight to (bf16_full_eval / fp16_full_eval), or None:
    evaluation then autocasts to `working_dtype`, as training does."""
    return torch.bfloat16 if args.bf16_full_eval else torch.float16 if args.fp16_full_eval else None


def build_loss_scale(args: TrainingArguments, device: torch.device) -> DynamicLossScale | None:
    """fp16's dynamic loss scale on `device` (None without fp16)."""
    if not args.fp16:
        return None
    return DynamicLossScale(device, args.fp16_initial_scale, growth_interval=args.fp16_scale_growth_interval)


def build_model(
    cfg: JobConfig,
    mc: ModelConfig,
    mesh: ParallelMesh,
    balance: list[int],
    device: torch.device,
    resume: ResumePoint | None = None,
) -> ParallelModel:
    """This rank's share of the model, built stage-local: created on the meta device, cut and
    tp- (and, under fsdp, dp-) sharded there, then only its shards get memory on `device`, drawn
    from the keyed init of `seed` (equal on every mesh to the one-process model's) or read slice
    by slice from `model_name_or_path`. No rank ever holds the whole model.

    On resume nothing is drawn or read (`model_name_or_path` may be gone): the parameters are
    zeroed placeholders that `trainer.run.state.resume_state` loads the checkpoint into, once."""
    torch.manual_seed(
        cfg.training.seed
    )  # the same global RNG on every rank (training dropout is keyed: parallel.rng)
    path = None
    if resume is None:
        model = pretrained_sources(cfg.model.model_name_or_path, cfg.model.tokenizer_name).model
        path = None if model is None else str(model)
    p = cfg.parallel
    pm = build_parallel_model(
        mc,
        mesh,
        balance,
        p.num_microbatches,
        p.pipeline_schedule,
        p.virtual_stages,
        p.activation_checkpointing,
        cfg.training.label_smoothing_factor,
        autocast_dtype=working_dtype(cfg.training),
        eval_dtype=full_eval_dtype(cfg.training),
        sequence_parallel=p.sequence_parallel,
        dp_sharding=p.data_parallel_sharding,
        device=device,
        seed=None if path or resume is not None else cfg.training.seed,
        pretrained=path or None,
        from_checkpoint=resume is not None,
        compile_layers=cfg.training.torch_compile,
        saved_tensor_meter=p.profile_activation_memory,
    )
    pm.model.moe.dropless = cfg.model.moe_dropless  # NLLB-MoE routing options of the run
    pm.model.moe.capacity_factor = cfg.model.moe_capacity_factor
    return pm


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
    sampler: Any  # GlobalBatchSampler, or StreamSampler under streaming (one interface)
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
    saver: CheckpointSaver = field(default_factory=CheckpointSaver)  # holds an async save in flight
    test_raw: RawDatasets | None = (
        None  # do_predict's test pairs, read at set-up (a missing split fails early)
    )
    loss_scale: DynamicLossScale | None = None  # fp16's dynamic loss scale (None: bf16 / fp32)
    startup_peak_host_bytes: int = 0  # ru_maxrss once the model and optimizer are built (trainer.run.memory)
    distill: DistillationLoss | None = None  # word-level distillation: the loss and its frozen teacher

    @property
    def is_logger(self) -> bool:
        return dist.get_rank() == self.log_rank

    @property
    def bubble_theory(self) -> float:
        p = self.cfg.parallel
        return bubble_theory(self.dims.pp, p.num_microbatches, p.virtual_stages, p.pipeline_schedule)


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

    run_data = setup_data(cfg, out, rank, resume)
    tok, data, test_raw = run_data.tok, run_data.data, run_data.test_raw
    mc = resume.model_config(cfg) if resume else model_config_for(cfg, tok)
    name = cfg.model.teacher_model_name_or_path
    source = teacher_source(name) if name else None  # its experts may be what ep spreads (check_mesh)
    check_mesh(dims, mc, source.config if source is not None else None)
    teacher = source if distilling(cfg) else None
    mesh = build_mesh(dims, device.type)
    p = cfg.parallel
    warn_after = p.hang_warning_s or default_warn_after(p.dist_timeout_s)
    start_watchdog(RankIdentity(rank, dims.shape), warn_after, p.dist_timeout_s)
    sampler = build_sampler(cfg, dims.dp, run_data, log=rank == 0)
    # a stream's epoch length is not known before it is read: streaming needs max_steps (preflight)
    steps_per_epoch = 0 if run_data.stream else len(sampler.epoch_plan(0))
    cfg.training.max_steps = resolve_max_steps(cfg.training, steps_per_epoch)  # -1: from num_train_epochs
    if steps_per_epoch:
        logger.info(
            "training %d steps; an epoch is %d global batches", cfg.training.max_steps, steps_per_epoch
        )
    else:
        logger.info("training %d steps on a stream of %d shard(s)", cfg.training.max_steps,
                    len(run_data.stream[0].shards))  # type: ignore[index]  # fmt: skip
    balance, partition_text = choose_partition(cfg, mc, mesh, sampler, device, working_dtype(cfg.training))
    pm = build_model(cfg, mc, mesh, balance, device, resume)
    distill = (
        build_teacher(cfg, teacher, mesh, device, pm, working_dtype(cfg.training))
        if teacher is not None
        else None
    )
    optimizer = build_optimizer(pm.model, cfg.training, only=pm.optimizer_params())
    scheduler = build_scheduler(optimizer, cfg.training)
    startup_host = peak_host_bytes()  # the start-up peak: model and optimizer built, no step run yet
    log_rank = coords_to_rank((pm.plan.last_stage_rank, 0, 0), dims.shape)
    if rank == log_rank:  # its per-step, evaluation and progress lines, also where it is not rank 0
        logging.getLogger(PROGRESS_LOGGER).setLevel(logging.INFO)
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
        loss_scale=build_loss_scale(cfg.training, pm.device),
        startup_peak_host_bytes=startup_host,
        distill=distill,
    )


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
        "mesh pp=%d dp=%d tp=%d%s, schedule %s (v=%d), remat %s\n%s",
        dims.pp,
        dims.dp,
        dims.tp,
        f" ep={dims.ep} (edp={dims.edp})" if dims.ep > 1 else "",
        cfg.parallel.pipeline_schedule,
        cfg.parallel.virtual_stages,
        cfg.parallel.activation_checkpointing,
        partition_text,
    )
    dropped = nonzero_skips(skipped)  # the counters at 0 (most, in a clean corpus) say nothing
    logger.info(
        "model: %.2fM parameters%s",
        mc.num_parameters() / 1e6,
        f"; data skipped: {dropped}" if dropped else "",
    )
