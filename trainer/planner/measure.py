"""What the planner measures on this machine: micro-batch shapes, block costs, link, optimizer.

TeacherCosts    the same for a distillation teacher's block kinds (forward, remat none)
CostSource      the job's architecture and micro-batch shapes (the data's first global
                batches for each batch cut, or a fixed sentence length when the data is
                not at hand or --seq_len is given), the per-kind costs of each shape and
                remat policy (`trainer.planner.blocks.measure_kind_costs` here, or the device table),
                cached
measure_link    latency and bandwidth between two local gloo processes (ping-pong)
measure_optimizer_s_per_param   clip + AdamW time per parameter
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from models.config import ModelConfig
from models.m2m100 import M2M100Translation
from parallel.pipeline.profile import BlockPhases
from trainer.config.pretrained import pretrained_sources
from trainer.config.schema import JobConfig
from trainer.data.batching import FixedBatch
from trainer.errors import DataError
from trainer.planner.blocks import (
    SPARSE,
    KindCosts,
    Shape,
    activation_kind_costs,
    measure_kind_costs,
    one_layer_config,
    padded_vocab_config,
    table_kind_costs,
)
from trainer.planner.cost import CostContext, block_costs
from trainer.planner.hardware import DeviceSpec, LinkModel
from trainer.planner.options import PlanOptions
from trainer.planner.teacher import TeacherBlocks

logger = logging.getLogger("trainer.plan")

# Global batches whose micro-batches give the median shape: a validation run's first 24 steps
SHAPE_SAMPLE_BATCHES = 24


class CostSource:
    """Micro-batch shapes (from the data, or a fixed length) and per-kind costs, cached."""

    def __init__(self, cfg: JobConfig, opts: PlanOptions, device: DeviceSpec | None) -> None:
        self.cfg, self.opts, self.device = cfg, opts, device
        self.sampler_data: Any = None
        self.mc = self._load(cfg, opts)
        self.teacher = self._teacher(cfg, opts, device)
        self.fetch_s: dict[tuple[int, ...], float] = {}
        self._shapes: dict[tuple[int, ...], Shape] = {}
        self._costs: dict[tuple[Shape, str, int], KindCosts] = {}  # (shape, remat, padded vocab)
        self._acts: dict[tuple[int, int, str, int], KindCosts] = {}

    def _load(self, cfg: JobConfig, opts: PlanOptions) -> ModelConfig:
        """The architecture; with data at hand (and no --seq_len), its tokenizer's vocabulary too."""
        if opts.seq_len is None:
            try:
                return self._load_data(cfg)
            except (OSError, DataError) as e:
                logger.warning("data not loadable (%s): shapes from max_source/target_length", e)
        model = pretrained_sources(cfg.model.model_name_or_path, cfg.model.tokenizer_name).model
        if model is not None:
            from models.hf import read_hf_config

            return read_hf_config(model)
        return cfg.model.model_config(cfg.model.vocab_size, {})

    @staticmethod
    def _teacher(cfg: JobConfig, opts: PlanOptions, device: DeviceSpec | None) -> TeacherCosts | None:
        """A distillation teacher's costs (None: the job does not distill)."""
        from trainer.run.distill import distilling, teacher_source

        name = cfg.model.teacher_model_name_or_path
        if not name or not distilling(cfg):
            return None
        return TeacherCosts(teacher_source(name).config, cfg.training.half_precision, device, opts.repeats)

    def teacher_blocks(self, shape: Shape, tp: int, ep: int, ctx: CostContext) -> TeacherBlocks | None:
        """The teacher's blocks for this cut and mesh (None without a teacher)."""
        return None if self.teacher is None else self.teacher.blocks(shape, tp, ep, ctx)

    def _load_data(self, cfg: JobConfig) -> ModelConfig:
        from trainer.data.sources import load_raw_datasets, training_texts
        from trainer.data.tokenization import tokenize_datasets
        from trainer.run.data import run_tokenizer
        from trainer.run.setup import model_config_for

        seed = cfg.training.seed
        if cfg.data.streaming:  # the shards' first global batches, as the trainer's stream reads them
            from trainer.data.streaming import open_corpus, sample_texts, stream_spec

            spec, expected = stream_spec(open_corpus(cfg.data), cfg.data, seed)
            tok = run_tokenizer(cfg, sample_texts(spec, expected, cfg.data.spm_input_sentence_size, seed))
            self.sampler_data = ((spec, expected), tok)
            return model_config_for(cfg, tok)
        raw = load_raw_datasets(cfg.data, seed)
        tok = run_tokenizer(cfg, training_texts(raw.train))  # the trainer's: a pretrained model's own
        self.sampler_data = (tokenize_datasets(raw, tok, cfg.data).train, tok)
        return model_config_for(cfg, tok)

    def shape(self, mb: int, m: int, g: int, dp: int, token_mode: bool) -> Shape:
        """Median micro-batch of this batch cut: from the data's first global batches, else fixed length."""
        key = (mb, m, g, dp, int(token_mode))
        if key not in self._shapes:
            self._shapes[key] = (
                self._data_shape(key) if self.sampler_data else self._fixed_shape(mb, token_mode)
            )
        return self._shapes[key]

    def _fixed_shape(self, mb: int, token_mode: bool) -> Shape:
        d = self.cfg.data
        length = self.opts.seq_len or max(d.max_source_length, d.max_target_length)
        return Shape(max(1, mb // length) if token_mode else mb, length, length)

    def _data_shape(self, key: tuple[int, ...]) -> Shape:
        import time

        import numpy as np

        from trainer.data.batching import BatchLayout, GlobalBatchSampler, bucket

        mb, m, g, dp, token_mode = key
        train, tok = self.sampler_data
        pad = self.cfg.data.pad_to_multiple_of
        layout = BatchLayout(1 if token_mode else mb, m, g, dp, mb if token_mode else None, pad)
        sampler: Any
        if isinstance(train, tuple):  # streaming: (spec, expected shares)
            from trainer.data.streaming import build_stream_sampler

            spec, expected = train
            sampler = build_stream_sampler(
                spec, expected, self.cfg.data, layout, tok, log_notes=False, workers=0
            )
        else:
            sampler = GlobalBatchSampler(train, layout, self.cfg.training.seed, tok.pad_id,
                                         tok.special_ids()["decoder_start_token_id"])  # fmt: skip
        rows, src, tgt, fetch = [], [], [], []
        for _ in range(SHAPE_SAMPLE_BATCHES):
            gb = next(sampler)
            for flush in gb.replica_slots(0):
                for idx in flush:
                    rows.append(len(idx))
                    src.append(bucket(int(gb.src_len[idx].max()), pad))  # the collated shape
                    tgt.append(bucket(int(gb.tgt_len[idx].max()), pad))
            t0 = time.perf_counter()
            gb.shard(0)
            fetch.append((time.perf_counter() - t0) / (m * g))
        sampler.close()
        self.fetch_s[key] = statistics.median(fetch)
        # the median micro-batch: `--validate` compares with the median step
        med = [round(float(np.median(x))) for x in (rows, src, tgt)]
        return Shape(max(1, med[0]), med[1], med[2])

    def kind_costs(self, shape: Shape, remat: str, tp: int = 1) -> KindCosts:
        """Per-kind costs of one micro-batch on one tp rank under `remat` ("stage" is costed as
        "none" here): measured on the rank's shard, in the run's precision."""
        remat = "none" if remat == "stage" else remat
        sp = self.cfg.parallel.sequence_parallel and tp > 1
        mc = padded_vocab_config(self.mc, tp)  # the head counts V' = ceil(V / tp) tp rows, as tp pads
        key = (shape, remat, tp)
        if key not in self._costs:
            bf16 = self.cfg.training.half_precision  # fp16 is costed as bf16: same bytes, same peak
            if self.device is None:
                self._costs[key] = measure_kind_costs(mc, shape, remat, bf16, self.opts.repeats, tp=tp,
                                                      sequence_parallel=sp)  # fmt: skip
            else:
                one = self._one_sentence_bytes(shape.s, shape.t, remat, tp, sp)
                scale = shape.b * (0.5 if bf16 else 1.0)  # bf16 keeps 2-byte activations
                self._costs[key] = table_kind_costs(mc, shape, remat, self.device, one, scale, tp)
        return self._costs[key]

    def _one_sentence_bytes(self, s: int, t: int, remat: str, tp: int, sp: bool) -> KindCosts:
        """Activation bytes per block kind of one sentence on a tp rank, measured here in fp32
        (table mode; times 0)."""
        key = (s, t, remat, tp)
        if key not in self._acts:
            self._acts[key] = activation_kind_costs(self.mc, Shape(1, s, t), remat, tp, sp)
        return self._acts[key]

    @property
    def measured(self) -> int:
        """Cost tables made so far (per-kind costs, and activation bytes in table mode): a
        progress count."""
        return len(self._costs) + len(self._acts)

    def block_costs(
        self, shape: Shape, remat: str, tp: int, ctx: CostContext, ep: int = 1
    ) -> list[BlockPhases]:
        """Every block's costs on one (tp, ep) rank (`trainer.planner.cost.block_costs`)."""
        kinds = self.kind_costs(shape, remat, tp)
        return block_costs(kinds, self.mc, shape, tp, ctx, ep, recompute=remat == "full")


class TeacherCosts:
    """The teacher's per-kind costs, measured here or from a device table, cached by (shape, tp).

    Args:
        mc: the teacher's architecture.
        half: bf16 / fp16 run (the teacher computes in it, under autocast).
        device: a device table (None: measure on this machine).
        repeats: timed repetitions per kind.
    """

    def __init__(self, mc: ModelConfig, half: bool, device: DeviceSpec | None, repeats: int) -> None:
        self.mc, self.half, self.device, self.repeats = mc, half, device, repeats
        self._kinds: dict[tuple[Shape, int], KindCosts] = {}
        self._acts: dict[tuple[int, int, int], KindCosts] = {}  # one sentence's bytes (table mode)

    def kind_costs(self, shape: Shape, tp: int) -> KindCosts:
        key = (shape, tp)
        if key not in self._kinds:
            mc = padded_vocab_config(self.mc, tp)
            if self.device is None:
                self._kinds[key] = measure_kind_costs(mc, shape, "none", self.half, self.repeats, tp=tp)
            else:  # as `CostSource.kind_costs`: one sentence's activation bytes, scaled to the micro-batch
                one_key = (shape.s, shape.t, tp)
                if one_key not in self._acts:
                    self._acts[one_key] = activation_kind_costs(
                        self.mc, Shape(1, shape.s, shape.t), "none", tp
                    )
                scale = shape.b * (0.5 if self.half else 1.0)
                self._kinds[key] = table_kind_costs(
                    mc, shape, "none", self.device, self._acts[one_key], scale, tp
                )
        return self._kinds[key]

    def blocks(self, shape: Shape, tp: int, ep: int, ctx: CostContext) -> TeacherBlocks:
        """Every block's forward on one (tp, ep) rank, its tp all-reduces and ep all-to-alls included."""
        costs = block_costs(self.kind_costs(shape, tp), self.mc, shape, tp, replace(ctx, mc=self.mc), ep)
        return TeacherBlocks(self.mc, tuple(costs), shape, tp, ep)


def measure_optimizer_s_per_param(mc: ModelConfig, repeats: int = 3) -> float:
    """Seconds per parameter of clip + AdamW (fused, as `trainer.run.step.build_optimizer`) on this
    machine, from the one-layer model."""
    torch.manual_seed(0)
    model = M2M100Translation(one_layer_config(mc))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    samples = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        if i:
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples) / sum(p.numel() for p in params)


def measure_link(repeats: int = 10, timeout_s: float = 120) -> LinkModel:
    """Latency and bandwidth between two local gloo processes (half a ping-pong round trip).

    Raises:
        RuntimeError: the two processes failed or did not finish within `timeout_s`.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_ping_pong, args=(r, port, repeats, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    alive = [proc for proc in procs if proc.is_alive()]
    for proc in alive:
        proc.kill()
    if alive or any(proc.exitcode != 0 for proc in procs) or queue.empty():
        raise RuntimeError(f"link measurement failed (exit codes {[p.exitcode for p in procs]})")
    small, large, small_s, large_s = queue.get()
    bw = (large - small) / max(large_s - small_s, 1e-9)
    latency = max(small_s - small / bw, 1e-7)
    return LinkModel(latency, bw, latency, bw)


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ping_pong(rank: int, port: int, repeats: int, queue) -> None:  # type: ignore[no-untyped-def]
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    sizes = (1024, 4 * 1024 * 1024)
    medians = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4)
        samples = []
        for i in range(repeats + 2):
            dist.barrier()
            t0 = time.perf_counter()
            for phase in (0, 1):
                (dist.send if phase == rank else dist.recv)(buf, 1 - rank)
            if i >= 2:
                samples.append((time.perf_counter() - t0) / 2)
        medians.append(statistics.median(samples))
    if rank == 0:
        queue.put((float(sizes[0]), float(sizes[1]), medians[0], medians[1]))
    dist.barrier()
    dist.destroy_process_group()


def measure_overheads(
    cfg: JobConfig, mc: ModelConfig, shape: Shape, kinds: KindCosts, opt_s_per_param: float, repeats: int = 5
) -> tuple[float, float]:
    """(per action, per step) seconds the trainer's real step spends beyond the block costs.

    Runs `trainer.run.step.train_step` (timed, as the validation runs log every step) on a
    one-rank mesh with the one-layer model and m = 1 and m = 3 micro-batches of `shape`,
    subtracts the modelled block time (m x sum of F + B) and optimizer time, and fits
    overhead(m) = per_step + 2 m per_action (a stage runs one F and one B per micro-batch).
    """
    import torch.distributed as dist

    from parallel.mesh import ParallelDims, build_mesh, init_distributed

    created = not dist.is_initialized()
    init_distributed(backend="gloo")
    try:
        mesh = build_mesh(ParallelDims(1, 1, 1, 1).validate(), "cpu")
        over = _step_overheads(cfg, mc, shape, kinds, opt_s_per_param, repeats, mesh)
    finally:
        if created:
            dist.destroy_process_group()
    per_action = max(0.0, (over[3] - over[1]) / 4)
    return per_action, max(0.0, over[1] - 2 * per_action)


def _step_overheads(cfg, mc, shape, kinds, opt_s_per_param, repeats, mesh) -> dict[int, float]:  # type: ignore[no-untyped-def]
    """Measured train_step time minus the modelled block and optimizer time, for m = 1 and 3."""
    from parallel.parallelize import build_parallel_model
    from trainer.planner.blocks import synthetic_batch
    from trainer.run.step import build_optimizer, build_scheduler, train_step

    small = one_layer_config(mc)
    block_s = sum(ph.forward_s + ph.backward_s for k, ph in kinds.items() if not k.endswith(SPARSE))
    over = {}
    for m in (1, 3):
        torch.manual_seed(0)
        model = M2M100Translation(small)
        pm = build_parallel_model(model, mesh, [len(model.blocks)], m, "1f1b", 1, "none", 0.0)
        opt = build_optimizer(pm.model, cfg.training, only=pm.optimizer_params())
        sched = build_scheduler(opt, cfg.training)
        batch = FixedBatch([synthetic_batch(mc, shape, seed=i) for i in range(m)])
        n_params = sum(p.numel() for p in pm.model.parameters())
        samples = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            train_step(pm, opt, sched, batch, 0, 1.0, i, timed=True)
            if i:
                samples.append(time.perf_counter() - t0)
        over[m] = statistics.median(samples) - m * block_s - opt_s_per_param * n_params
    return over
