"""Benchmark: our pipeline engine vs PyTorch's `torch.distributed.pipelining`, p=2 on CPU gloo ranks.

    torchrun --nproc-per-node 2 scripts/bench_pipeline.py [--steps 5 --d_model 256 ...]
    python scripts/bench_pipeline.py [...]          (spawns the 2 ranks itself)

One run prints (and saves as `<out>.md` / `<out>.json`):

1. step time (forward + backward of one flush of m micro-batches, plus the tied
   embedding gradient all-reduce; no optimizer) of our `gpipe`, `1f1b`,
   `interleaved_1f1b` (v=2) and `zero_bubble` schedules vs PyTorch's
   `ScheduleGPipe`, `Schedule1F1B` and `ScheduleInterleaved1F1B` on the *same*
   stage modules: PyTorch's stages wrap our blocks of the same `M2M100Translation`
   cut by the same balance, fed the same micro-batches, with the same loss (token
   sum x 1 / global tokens, `scale_grads=False`). Two workloads:
   - fixed: every sentence has exactly `seq_len` source and target tokens, so both
     engines see identical shapes (the fair comparison);
   - varlen: sentence lengths vary; ours runs each micro-batch trimmed to its own
     longest sentence (native), PyTorch's `PipelineStage` fixes shapes when it is
     first run, so its side pads the global batch to a length bucket (multiple of
     `--bucket`) and caches one stage/schedule object per bucket.
   Configurations are measured round-robin (one step of each per round, a barrier
   before each step), so machine noise hits all of them alike; ratios are medians
   of the per-round ratios.
   Gradients of every configuration are checked against the single-device model on
   the unsplit batch, and ours against PyTorch's directly (max abs diff).
2. the measured bubble of our schedules, 1 - sum(busy) / (p * makespan) from the
   executor's `FlushResult`s, vs the theory (p-1)/(v m + p - 1) vs the simulator
   fed with the per-stage F / B (I, W) times measured in the same run.
3. peak activation bytes per pipeline rank for each schedule and remat policy.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.config import ModelConfig  # noqa: E402
from models.loss import cross_entropy_sum  # noqa: E402
from models.m2m100 import (  # noqa: E402
    IGNORE_INDEX,
    BlockKind,
    BlockSpec,
    M2M100Translation,
    Seq2SeqBatch,
)
from parallel.mesh import ParallelDims, build_mesh, init_distributed  # noqa: E402
from parallel.parallelize import ParallelModel, build_parallel_model  # noqa: E402
from parallel.pipeline.executor import FlushResult  # noqa: E402
from parallel.pipeline.partition import partition_blocks  # noqa: E402
from parallel.pipeline.schedule import Action, build_schedule, placement_for  # noqa: E402
from parallel.pipeline.simulate import StageCosts, bubble_theory, simulate  # noqa: E402
from parallel.pipeline.stage import boundary_keys  # noqa: E402

P = 2
OUR_SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 1}  # name -> v
THEIR_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}
REMATS = ("none", "full", "selective", "stage")


# ----------------------------------------------------------------------------- data


def make_batch(
    cfg: ModelConfig, n: int, lengths: list[int], tgt_lengths: list[int], seed: int
) -> Seq2SeqBatch:
    """n right-padded pairs with the given source / target lengths (random token ids)."""
    g = torch.Generator().manual_seed(seed)
    s, t = max(lengths), max(tgt_lengths)
    src = torch.full((n, s), cfg.pad_token_id)
    lab = torch.full((n, t), IGNORE_INDEX)
    for i in range(n):
        src[i, : lengths[i]] = torch.randint(4, cfg.vocab_size, (lengths[i],), generator=g)
        src[i, lengths[i] - 1] = cfg.eos_token_id
        lab[i, : tgt_lengths[i]] = torch.randint(4, cfg.vocab_size, (tgt_lengths[i],), generator=g)
    dec = torch.full_like(lab, cfg.pad_token_id)
    dec[:, 0] = cfg.decoder_start_token_id
    dec[:, 1:] = lab[:, :-1].masked_fill(lab[:, :-1] == IGNORE_INDEX, cfg.pad_token_id)
    return Seq2SeqBatch(src, (src != cfg.pad_token_id).long(), dec, lab)


def fixed_batch(cfg: ModelConfig, n: int, length: int, seed: int) -> Seq2SeqBatch:
    return make_batch(cfg, n, [length] * n, [length] * n, seed)


def varlen_batch(cfg: ModelConfig, n: int, length: int, seed: int) -> Seq2SeqBatch:
    """Lengths uniform in [length/2, 3 length/2], sorted longest first (a length-sorted sampler)."""
    g = torch.Generator().manual_seed(seed + 1000)
    lo, hi = max(2, length // 2), length + length // 2
    src = sorted(torch.randint(lo, hi + 1, (n,), generator=g).tolist(), reverse=True)
    tgt = sorted(torch.randint(lo, hi + 1, (n,), generator=g).tolist(), reverse=True)
    return make_batch(cfg, n, src, tgt, seed)


def pad_to(batch: Seq2SeqBatch, s: int, t: int, pad_id: int) -> Seq2SeqBatch:
    """Right-pad to (s, t): pad ids, mask 0, labels -100 (the loss and the real tokens are unchanged)."""

    def pad(x: Tensor, length: int, value: int) -> Tensor:
        return torch.nn.functional.pad(x, (0, length - x.shape[1]), value=value)

    return Seq2SeqBatch(
        pad(batch.input_ids, s, pad_id),
        pad(batch.attention_mask, s, 0),
        pad(batch.decoder_input_ids, t, pad_id),
        pad(batch.labels, t, IGNORE_INDEX),
    )


def bucket(length: int, size: int) -> int:
    return -(-length // size) * size


# ----------------------------------------------------------------------------- partition


def block_flops(cfg: ModelConfig, spec: BlockSpec, length: int) -> float:
    """Forward matmul FLOPs of one block per sentence of `length` tokens (for the balance only)."""
    d, f, v, n = cfg.d_model, cfg.encoder_ffn_dim, cfg.vocab_size, length
    enc = 2 * n * (4 * d * d + 2 * d * f) + 4 * n * n * d
    if spec.kind is BlockKind.ENC_LAYER:
        return enc
    if spec.kind is BlockKind.DEC_LAYER:
        return 2 * n * (8 * d * d + 2 * d * cfg.decoder_ffn_dim) + 8 * n * n * d
    if spec.kind is BlockKind.HEAD:
        return 2 * n * d * v + 6 * n * v  # logits + softmax cross-entropy
    return 0.01 * enc  # embeddings, final norm


def balance_for(cfg: ModelConfig, blocks: list[BlockSpec], n_stages: int, length: int) -> list[int]:
    return partition_blocks([block_flops(cfg, b, length) for b in blocks], n_stages)


# ----------------------------------------------------------------------------- PyTorch's side


class TorchStageModule(nn.Module):
    """A `torch.distributed.pipelining` stage made of our blocks.

    Positional inputs are the boundary tensors (for the first stage: `input_ids`);
    the micro-batch's integer inputs every stage needs (`attention_mask`,
    `decoder_input_ids`) come as kwargs, which `schedule.step(**kwargs)` chunks
    along dim 0 and hands to every stage of the rank. A boundary of several tensors
    (e.g. `encoder_out, hidden` in the decoder) is returned as a tuple.
    """

    def __init__(
        self,
        model: M2M100Translation,
        blocks: list[BlockSpec],
        in_keys: tuple[str, ...],
        out_keys: tuple[str, ...],
    ) -> None:
        super().__init__()
        self.model = model
        self.blocks, self.in_keys, self.out_keys = blocks, in_keys, out_keys

    def forward(self, *tensors: Tensor, attention_mask: Tensor, decoder_input_ids: Tensor) -> Any:
        if self.in_keys:
            state, input_ids = dict(zip(self.in_keys, tensors)), attention_mask  # ids unused past src_embed
        else:
            state, input_ids = {}, tensors[0]
        batch = Seq2SeqBatch(input_ids, attention_mask, decoder_input_ids, decoder_input_ids)
        out = self.model.run_blocks(state, batch, self.blocks)
        outs = tuple(out[k] for k in self.out_keys)
        return outs[0] if len(outs) == 1 else outs


class TorchPipeline:
    """PyTorch's stages + schedule over this rank's pruned copy, one schedule object per shape."""

    def __init__(
        self,
        base: M2M100Translation,
        stage_blocks: list[list[BlockSpec]],
        pp_rank: int,
        v: int,
        m: int,
        schedule: str,
    ) -> None:
        from torch.distributed.pipelining import schedules as pipe_schedules

        self.n = len(stage_blocks)
        self.stage_blocks, self.pp_rank, self.v, self.m = stage_blocks, pp_rank, v, m
        self.my_stages = placement_for(schedule, P, v).stages_of(pp_rank)
        self.model = copy.deepcopy(base)
        self.model.keep_only([b for s in self.my_stages for b in stage_blocks[s]])
        self.cls = getattr(pipe_schedules, THEIR_SCHEDULES[schedule])
        self.cfg = base.config
        self.modules = {
            s: TorchStageModule(self.model, stage_blocks[s], self._in_keys(s), self._out_keys(s))
            for s in self.my_stages
        }
        self.cache: dict[tuple[int, int], Any] = {}
        self.loss_scale = 1.0
        self.losses: list[Tensor] = []

    def _in_keys(self, s: int) -> tuple[str, ...]:
        return () if s == 0 else boundary_keys(self.stage_blocks[s - 1][-1])

    def _out_keys(self, s: int) -> tuple[str, ...]:
        return ("logits",) if s == self.n - 1 else boundary_keys(self.stage_blocks[s][-1])

    def _boundary_examples(self, s_idx: int, after: bool, b: int, s: int, t: int) -> tuple[Tensor, ...]:
        """Example tensors of the boundary before (after=False) or after stage s_idx."""
        last = self.stage_blocks[s_idx if after else s_idx - 1][-1]
        keys = boundary_keys(last)
        on_encoder = last.kind in (BlockKind.SRC_EMBED, BlockKind.ENC_LAYER)
        d = self.cfg.d_model
        shapes = [(b, s, d) if k == "encoder_out" or on_encoder else (b, t, d) for k in keys]
        return tuple(torch.empty(sh, requires_grad=True) for sh in shapes)  # grads flow back

    def _schedule_for(self, s: int, t: int) -> Any:
        if (s, t) in self.cache:
            return self.cache[(s, t)]
        from torch.distributed.pipelining import PipelineStage

        b = self.mb_size
        stages = []
        for idx in self.my_stages:
            inputs = (
                (torch.zeros(b, s, dtype=torch.long),)
                if idx == 0
                else self._boundary_examples(idx, False, b, s, t)
            )
            outputs = (
                (torch.empty(b, t, self.cfg.vocab_size, requires_grad=True),)
                if idx == self.n - 1
                else (self._boundary_examples(idx, True, b, s, t))
            )
            stages.append(
                PipelineStage(
                    self.modules[idx],
                    idx,
                    self.n,
                    torch.device("cpu"),
                    input_args=inputs,
                    output_args=outputs,
                )
            )

        def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
            return cross_entropy_sum(logits, labels) * self.loss_scale

        if self.v == 1:
            sched = self.cls(stages[0], n_microbatches=self.m, loss_fn=loss_fn, scale_grads=False)
        else:
            sched = self.cls(stages, n_microbatches=self.m, loss_fn=loss_fn, scale_grads=False)
        self.cache[(s, t)] = sched
        return sched

    def step(self, global_batch: Seq2SeqBatch, loss_scale: float) -> None:
        """One flush over `global_batch` (all micro-batches must have its shape), then the tied reduce."""
        self.mb_size = global_batch.size // self.m
        sched = self._schedule_for(global_batch.input_ids.shape[1], global_batch.labels.shape[1])
        self.loss_scale = loss_scale
        kwargs = {
            "attention_mask": global_batch.attention_mask,
            "decoder_input_ids": global_batch.decoder_input_ids,
        }
        args = (global_batch.input_ids,) if 0 in self.my_stages else ()
        self.losses = []
        sched.step(*args, target=global_batch.labels, losses=self.losses, return_outputs=False, **kwargs)
        w = self.model.shared.weight if self.model.shared is not None else None
        if w is not None:  # the tied embedding lives on both ranks (src/tgt embed on 0, head on 1)
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            dist.all_reduce(w.grad)

    def named_grads(self) -> dict[str, Tensor]:
        return {k: p.grad for k, p in self.model.named_parameters() if p.grad is not None}

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------- our side


class OurPipeline:
    def __init__(
        self,
        base: M2M100Translation,
        mesh: Any,
        balance: list[int],
        m: int,
        schedule: str,
        v: int,
        remat: str = "none",
    ) -> None:
        self.pm: ParallelModel = build_parallel_model(
            copy.deepcopy(base), mesh, balance, m, schedule, v, remat, label_smoothing=0.0
        )
        self.m = m
        # Work-around (library bug): `PipelineExecutor.__init__` does `wgrad_store or WeightGradStore()`,
        # and an empty store is falsy (`__len__` == 0), so the executor got a fresh store while the
        # linears queue their weight grads into `pm.wgrad_store`: no W was ever deferred. Re-link them.
        self.relinked_wgrad_store = self.pm.executor.wgrad_store is not self.pm.wgrad_store
        if self.relinked_wgrad_store:
            self.pm.executor.wgrad_store = self.pm.wgrad_store

    def step(self, global_batch: Seq2SeqBatch, loss_scale: float) -> FlushResult:
        return self.pm.train_step([global_batch.split(self.m)], loss_scale, timed=True)[0]

    def named_grads(self) -> dict[str, Tensor]:
        return {k: p.grad for k, p in self.pm.named_params().items() if p.grad is not None}

    def zero_grad(self) -> None:
        self.pm.model.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------- helpers


def reference_grads(base: M2M100Translation, batch: Seq2SeqBatch, dtype: torch.dtype) -> dict[str, Tensor]:
    """Gradients of the mean token loss of the unsplit batch on one device, in `dtype`."""
    model = copy.deepcopy(base).to(dtype)
    loss_sum, n = model.loss(batch)
    (loss_sum / n).backward()
    return {k: p.grad.double() for k, p in model.named_parameters() if p.grad is not None}


def max_abs_diff(got: dict[str, Tensor], ref: dict[str, Tensor]) -> tuple[float, float]:
    """(max |got - ref| over this rank's parameters, max |ref|), reduced over ranks."""
    assert set(got) <= set(ref), sorted(set(got) - set(ref))
    diff = max((float((got[k].double() - ref[k].double()).abs().max()) for k in got), default=0.0)
    scale = max((float(ref[k].abs().max()) for k in got), default=0.0)
    t = torch.tensor([diff, scale], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1])


def gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's list (same length on all ranks)."""
    t = torch.tensor(values, dtype=torch.float64)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def measure_link(shape: tuple[int, ...], reps: int = 12) -> float:
    """Seconds one boundary message (a decoder boundary: encoder output + hidden of one
    micro-batch) takes between the two ranks: half a ping-pong round trip, median, as rank 0
    measured it (broadcast so both ranks simulate with the same link)."""
    peer = 1 - dist.get_rank()
    bufs = [torch.randn(shape) for _ in range(2)]
    times = []
    for i in range(reps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        for phase in (0, 1):
            for b in bufs:
                (dist.send if phase == dist.get_rank() else dist.recv)(b, peer)
        if i >= 2:
            times.append((time.perf_counter() - t0) / 2)
    out = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.broadcast(out, src=0)
    return float(out[0])


def comm_floor(results: list[FlushResult]) -> float:
    """10th percentile of the comm-batch spans in this rank's timelines (seconds)."""
    spans = sorted(e - s for r in results for name, s, e in r.timeline if name[0] in "SR")
    return spans[len(spans) // 10] if spans else 0.0


def stage_costs(results: list[FlushResult], n: int) -> tuple[list[float], list[float], list[float]]:
    """Mean per-stage F, backward-input and backward-weight times from this rank's timelines."""
    acc: dict[tuple[str, int], list[float]] = {}
    for res in results:
        for name, start, end in res.timeline:
            if name == "GR" or " " in name:  # GR, or a batch of comm actions
                continue
            a = Action.parse(name)
            if a.type.is_compute:
                acc.setdefault((a.type.value, a.stage), []).append(end - start)
    vals = []
    for code in ("F", "B", "I", "W"):
        vals.append([statistics.fmean(acc[(code, s)]) if (code, s) in acc else 0.0 for s in range(n)])
    f, b, i, w = vals
    bi = [b[s] + i[s] for s in range(n)]  # full backward B counted as backward-input, W = 0
    return f, bi, w


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.0f}"


def mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="timed steps per configuration")
    ap.add_argument(
        "--warmup", type=int, default=2, help="untimed steps per configuration (>= 2: both varlen batches)"
    )
    ap.add_argument("--m", type=int, default=8, help="micro-batches per flush")
    ap.add_argument("--mb_size", type=int, default=8, help="sentences per micro-batch")
    ap.add_argument(
        "--seq_len", type=int, default=32, help="tokens per sentence (fixed); mean length (varlen)"
    )
    ap.add_argument("--bucket", type=int, default=16, help="PyTorch side, varlen: pad lengths to a multiple")
    ap.add_argument("--d_model", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=0, help="FFN width (default 4 d_model)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=3, help="encoder and decoder layers each")
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--skip_memory", action="store_true", help="skip the remat x schedule memory table")
    ap.add_argument("--out", default="benchmarks/pipeline_cpu", help="writes <out>.md and <out>.json")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    init_distributed(backend="gloo")
    if dist.get_world_size() != P:
        raise SystemExit(f"run with exactly {P} ranks (got {dist.get_world_size()})")
    rank = dist.get_rank()
    mesh = build_mesh(ParallelDims(pp=P, dp=1, tp=1, world_size=P))
    load_before = os.getloadavg()
    t_start = time.perf_counter()

    cfg = ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        encoder_layers=args.layers,
        decoder_layers=args.layers,
        encoder_attention_heads=args.heads,
        decoder_attention_heads=args.heads,
        encoder_ffn_dim=args.ffn or 4 * args.d_model,
        decoder_ffn_dim=args.ffn or 4 * args.d_model,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        max_position_embeddings=4 * args.seq_len,
    )
    torch.manual_seed(0)
    base = M2M100Translation(cfg)
    m, n_sent = args.m, args.m * args.mb_size
    batches = {
        "fixed": [fixed_batch(cfg, n_sent, args.seq_len, seed=1)],
        "varlen": [varlen_batch(cfg, n_sent, args.seq_len, seed=s) for s in (2, 3)],
    }
    padded = [
        pad_to(
            b,
            bucket(b.input_ids.shape[1], args.bucket),
            bucket(b.labels.shape[1], args.bucket),
            cfg.pad_token_id,
        )
        for b in batches["varlen"]
    ]
    # fp64 single-device gradients of the unsplit batch: the truth every configuration is compared with;
    # fp32 single-device gradients show the rounding floor of fp32 on the same batch.
    refs = {
        (w, i): reference_grads(base, b, torch.float64) for w, bs in batches.items() for i, b in enumerate(bs)
    }
    fp32_floor = {
        w: max(
            max_abs_diff(reference_grads(base, b, torch.float32), refs[(w, i)])[0] for i, b in enumerate(bs)
        )
        for w, bs in batches.items()
    }
    balances = {v: balance_for(cfg, base.blocks, P * v, args.seq_len) for v in (1, 2)}

    # ---- configurations, measured round-robin
    Runner = Callable[[int], FlushResult | None]
    configs: list[tuple[str, str, str, Any, Runner]] = []  # (workload, engine, schedule, pipe, step(i))

    def add(workload: str, engine: str, schedule: str) -> None:
        v = OUR_SCHEDULES[schedule]
        stage_blocks = _cut(base.blocks, balances[v])
        src = batches[workload]
        if engine == "ours":
            pipe: Any = OurPipeline(base, mesh, balances[v], m, schedule, v)
        else:
            pipe = TorchPipeline(base, stage_blocks, mesh.pp_rank, v, m, schedule)
        feed = src if engine == "ours" or workload == "fixed" else padded

        def step(i: int, pipe: Any = pipe, src: list = src, feed: list = feed) -> FlushResult | None:
            k = i % len(src)
            return pipe.step(feed[k], 1.0 / src[k].num_tokens())

        configs.append((workload, engine, schedule, pipe, step))

    for sched in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"):
        add("fixed", "ours", sched)
        if sched in THEIR_SCHEDULES:
            add("fixed", "torch", sched)
    for sched in ("gpipe", "1f1b"):
        add("varlen", "ours", sched)
        add("varlen", "torch", sched)

    rounds = args.warmup + args.steps
    times = [[0.0] * args.steps for _ in configs]
    flushes: list[list[FlushResult]] = [[] for _ in configs]
    grad_check: dict[int, list[float]] = {}  # config -> [max abs diff vs single device, max |ref|]
    grads_round0: dict[int, dict[str, Tensor]] = {}
    for r in range(rounds):
        for c, (workload, _, _, pipe, step) in enumerate(configs):
            pipe.zero_grad()
            dist.barrier()
            t0 = time.perf_counter()
            res = step(r)
            dt = time.perf_counter() - t0
            if r < args.warmup:
                ref = refs[(workload, r % len(batches[workload]))]
                diff, scale = max_abs_diff(pipe.named_grads(), ref)
                prev = grad_check.get(c, [0.0, 0.0])
                grad_check[c] = [max(prev[0], diff), max(prev[1], scale)]
                if r == 0:
                    grads_round0[c] = {k: g.clone() for k, g in pipe.named_grads().items()}
            else:
                times[c][r - args.warmup] = dt
                if res is not None:
                    flushes[c].append(res)
        if rank == 0:
            print(f"round {r + 1}/{rounds} done ({time.perf_counter() - t_start:.0f} s)", flush=True)

    # ours vs theirs directly (same schedule, same workload, round 0 grads)
    direct: dict[tuple[str, str], float] = {}
    for c, (workload, engine, schedule, _, _) in enumerate(configs):
        if engine != "torch":
            continue
        o = next(i for i, x in enumerate(configs) if x[:3] == (workload, "ours", schedule))
        direct[(workload, schedule)] = max_abs_diff(grads_round0[o], grads_round0[c])[0]

    # step times: max over ranks, per round
    t_all = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t_all, op=dist.ReduceOp.MAX)
    step_t = t_all.tolist()

    # ---- bubble: measured vs theory vs simulator (fixed workload, our schedules)
    link = measure_link((args.mb_size, args.seq_len, cfg.d_model))
    bubble_rows = []
    for c, (workload, engine, schedule, _, _) in enumerate(configs):
        if engine != "ours" or workload != "fixed":
            continue
        v = OUR_SCHEDULES[schedule]
        n = P * v
        per_round = []
        for res in flushes[c]:
            busy, wall = gather_floats([res.busy_s]), gather_floats([res.pipeline_s])  # up to GR
            makespan = max(w[0] for w in wall)
            per_round.append((1 - sum(b[0] for b in busy) / (P * makespan), makespan))
        f, bi, w = stage_costs(flushes[c], n)
        # A comm batch that finds its peer ready still costs the executor's posting and copying:
        # the 10th percentile of this configuration's comm spans, if above the ping-pong.
        link_c = max(link, max(x[0] for x in gather_floats([comm_floor(flushes[c])])))
        f_all, bi_all, w_all = gather_floats(f), gather_floats(bi), gather_floats(w)
        mine = {s: placement_for(schedule, P, v).rank_of(s) for s in range(n)}
        fs = [f_all[mine[s]][s] for s in range(n)]
        bis = [bi_all[mine[s]][s] for s in range(n)]
        ws = [w_all[mine[s]][s] for s in range(n)]
        sim = simulate(build_schedule(schedule, P, m, v), P, m, v, StageCosts(fs, bis, ws, link_c))
        bubble_rows.append(
            {
                "schedule": schedule,
                "v": v,
                "measured": statistics.median(x[0] for x in per_round),
                "theory": bubble_theory(P, m, v),
                "simulated": sim.bubble_fraction,
                "makespan_measured_s": statistics.median(x[1] for x in per_round),
                "makespan_simulated_s": sim.makespan,
                "link_s": link_c,
                "stage_forward_s": fs,
                "stage_backward_input_s": bis,
                "stage_backward_weight_s": ws,
            }
        )

    # ---- memory: peak saved activations per rank, schedule x remat
    mem_rows = []
    if not args.skip_memory:
        fixed = batches["fixed"][0]
        for schedule, v in OUR_SCHEDULES.items():
            for remat in REMATS:
                pipe = OurPipeline(base, mesh, balances[v], m, schedule, v, remat)
                res = pipe.step(fixed, 1.0 / fixed.num_tokens())
                diff, _ = max_abs_diff(pipe.named_grads(), refs[("fixed", 0)])
                peaks = [x[0] for x in gather_floats([float(res.peak_activation_bytes)])]
                mem_rows.append(
                    {"schedule": schedule, "remat": remat, "peak_bytes": peaks, "grad_diff": diff}
                )
                del pipe
    load_after = os.getloadavg()

    if rank != 0:
        dist.barrier()
        return

    # ---- report
    steps_rows = []
    for c, (workload, engine, schedule, _, _) in enumerate(configs):
        row: dict[str, Any] = {
            "workload": workload,
            "engine": engine,
            "schedule": schedule,
            "v": OUR_SCHEDULES[schedule],
            "step_s_median": statistics.median(step_t[c]),
            "step_s": step_t[c],
            "grad_max_abs_diff_vs_single_device": grad_check[c][0],
            "grad_max_abs": grad_check[c][1],
        }
        if engine == "ours":
            t_idx = next((i for i, x in enumerate(configs) if x[:3] == (workload, "torch", schedule)), None)
            if t_idx is not None:
                row["ours_over_torch_median"] = statistics.median(
                    a / b for a, b in zip(step_t[c], step_t[t_idx])
                )
                row["grad_max_abs_diff_vs_torch"] = direct[(workload, schedule)]
        steps_rows.append(row)

    meta = {
        "p": P,
        "m": m,
        "micro_batch": args.mb_size,
        "seq_len": args.seq_len,
        "bucket": args.bucket,
        "model": cfg.to_dict(),
        "params": sum(p.numel() for p in base.parameters()),
        "balance_v1": balances[1],
        "balance_v2": balances[2],
        "threads_per_rank": args.threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg_before": load_before,
        "load_avg_after": load_after,
        "varlen_tokens": [[int(b.attention_mask.sum()), b.num_tokens()] for b in batches["varlen"]],
        "varlen_shapes_torch": [list(b.input_ids.shape) + [b.labels.shape[1]] for b in padded],
        "varlen_padded_tokens_torch": [int(b.input_ids.numel() + b.labels.numel()) for b in padded],
        "varlen_trimmed_tokens_ours": [
            sum(int(mb.input_ids.numel() + mb.labels.numel()) for mb in b.split(m)) for b in batches["varlen"]
        ],
        "grad_fp32_single_device_vs_fp64": fp32_floor,
        "link_s": link,
        "zero_bubble_wgrad_store_relinked": any(
            getattr(x[3], "relinked_wgrad_store", False) for x in configs if x[2] == "zero_bubble"
        ),
        "wall_s": time.perf_counter() - t_start,
    }
    md = render(meta, steps_rows, bubble_rows, mem_rows)
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(md)
    out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "steps": steps_rows, "bubble": bubble_rows, "memory": mem_rows}, indent=1)
    )
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    dist.barrier()


def _cut(blocks: list[BlockSpec], balance: list[int]) -> list[list[BlockSpec]]:
    out, start = [], 0
    for n in balance:
        out.append(list(blocks[start : start + n]))
        start += n
    return out


def render(meta: dict, steps: list[dict], bubble: list[dict], mem: list[dict]) -> str:
    c = meta["model"]
    lines = [
        "# Pipeline engine vs torch.distributed.pipelining (CPU, gloo)",
        "",
        f"p={meta['p']}, m={meta['m']} micro-batches x {meta['micro_batch']} sentences, "
        f"M2M100 d_model={c['d_model']}, ffn={c['encoder_ffn_dim']}, {c['encoder_layers']}+{c['decoder_layers']} "
        f"layers, vocab={c['vocab_size']} ({meta['params'] / 1e6:.1f} M params), dropout 0, fp32; "
        f"balance (blocks per stage) v=1 {meta['balance_v1']}, v=2 {meta['balance_v2']}. "
        f"{meta['threads_per_rank']} thread(s) per rank on {meta['cpus']} CPUs, torch {meta['torch']}. "
        f"Load average (1/5/15 min) before {_load(meta['load_avg_before'])}, "
        f"after {_load(meta['load_avg_after'])}. Median of {meta['steps']} timed steps after "
        f"{meta['warmup']} warm-up steps, configurations interleaved round-robin; whole run {meta['wall_s']:.0f} s.",
        "",
        "## 1. Step time (forward + backward of one flush + tied-embedding all-reduce)",
        "",
        f"*fixed*: every sentence {meta['seq_len']} source and {meta['seq_len']} target tokens (identical "
        f"shapes on both sides: the fair comparison). *varlen*: lengths uniform in "
        f"[{meta['seq_len'] // 2}, {meta['seq_len'] * 3 // 2}], sorted; ours trims each micro-batch to its own "
        f"longest sentence, PyTorch pads the batch to a multiple of {meta['bucket']} "
        f"(shapes (B, S, T) {meta['varlen_shapes_torch']}) with one cached stage/schedule per shape. "
        f"Positions computed per varlen batch (source + target): ours {meta['varlen_trimmed_tokens_ours']}, "
        f"PyTorch {meta['varlen_padded_tokens_torch']}. "
        "Ratio = median over rounds of ours / PyTorch in the same round. Gradients (one flush, fp32): max "
        "abs difference vs the single-device model on the unsplit batch in fp64, for reference the same "
        "for the fp32 single-device model (fp32 rounding floor: fixed "
        f"{meta['grad_fp32_single_device_vs_fp64']['fixed']:.1e}, varlen "
        f"{meta['grad_fp32_single_device_vs_fp64']['varlen']:.1e}), and ours vs PyTorch directly.",
        "",
        "| workload | schedule | ours ms | PyTorch ms | ours / PyTorch | grad diff ours vs fp64 | "
        "grad diff PyTorch vs fp64 | grad diff ours vs PyTorch |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in steps:
        if row["engine"] != "ours":
            continue
        theirs = next(
            (
                x
                for x in steps
                if x["engine"] == "torch"
                and x["workload"] == row["workload"]
                and x["schedule"] == row["schedule"]
            ),
            None,
        )
        name = row["schedule"] + (f" (v={row['v']})" if row["v"] > 1 else "")
        lines.append(
            f"| {row['workload']} | {name} | {fmt_ms(row['step_s_median'])} | "
            + (
                f"{fmt_ms(theirs['step_s_median'])} | {row['ours_over_torch_median']:.2f} | "
                if theirs
                else "- | - | "
            )
            + f"{row['grad_max_abs_diff_vs_single_device']:.1e} | "
            + (
                f"{theirs['grad_max_abs_diff_vs_single_device']:.1e} | {row['grad_max_abs_diff_vs_torch']:.1e} |"
                if theirs
                else "- | - |"
            )
        )
    gmax = max(r["grad_max_abs"] for r in steps)
    lines += [
        "",
        f"(largest gradient entry: {gmax:.1e})",
        "",
        "zero_bubble: "
        + (
            "the executor was re-linked to the model's WeightGradStore by this script (library bug: "
            "`PipelineExecutor` replaces an empty store, which is falsy, by a new one, so W is never "
            "deferred); without it zero_bubble runs as 1F1B with W = 0."
            if meta["zero_bubble_wgrad_store_relinked"]
            else "the executor uses the model's WeightGradStore as built (no work-around needed)."
        ),
        "",
        "## 2. Bubble fraction (fixed workload, our schedules)",
        "",
        "Measured: 1 - sum(busy) / (p x makespan) from the executor's FlushResults (barrier before each "
        "flush), median over the timed steps. Theory: (p-1)/(v m + p - 1) (zero bubble: the 1F1B bound; "
        "ZB-H1 does better). Simulated: `parallel.pipeline.simulate` on the same action lists with per-stage "
        "F / B (I, W) times measured from the executor timelines of the same run, and a link cost per comm "
        f"batch: a ping-pong of one boundary message between the two ranks ({meta['link_s'] * 1e3:.2f} ms), or "
        "the 10th percentile of the run's comm spans where higher (posting and copying cost the executor time "
        "even when the peer is ready).",
        "",
        "| schedule | measured | theory | simulated | makespan ms measured | makespan ms simulated | "
        "F ms per stage | B (or I) ms per stage | W ms per stage |",
        "|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for b in bubble:
        name = b["schedule"] + (f" (v={b['v']})" if b["v"] > 1 else "")

        def ms(xs: list[float]) -> str:
            return " / ".join(f"{x * 1e3:.1f}" for x in xs)

        lines.append(
            f"| {name} | {b['measured']:.3f} | {b['theory']:.3f} | {b['simulated']:.3f} | "
            f"{fmt_ms(b['makespan_measured_s'])} | {fmt_ms(b['makespan_simulated_s'])} | "
            f"{ms(b['stage_forward_s'])} | {ms(b['stage_backward_input_s'])} | "
            f"{ms(b['stage_backward_weight_s']) if any(b['stage_backward_weight_s']) else '-'} |"
        )
    if mem:
        lines += [
            "",
            "## 3. Peak activation memory per pipeline rank (MiB, saved tensors, fixed workload)",
            "",
            "From FlushResult.peak_activation_bytes (the executor's meter counts tensors saved for "
            "backward). Rank 0 / rank 1; with v=2 each rank holds two stages.",
            "",
            "| schedule | " + " | ".join(REMATS) + " |",
            "|---|" + "---:|" * len(REMATS),
        ]
        for schedule in OUR_SCHEDULES:
            cells = []
            for remat in REMATS:
                row = next(x for x in mem if x["schedule"] == schedule and x["remat"] == remat)
                cells.append(" / ".join(mib(x) for x in row["peak_bytes"]))
            lines.append(f"| {schedule} | " + " | ".join(cells) + " |")
        worst = max(x["grad_diff"] for x in mem)
        lines += [
            "",
            f"Every schedule x remat run's gradients match the fp64 single-device model within "
            f"{worst:.1e} (max abs).",
        ]
    return "\n".join(lines) + "\n"


def _load(x: Any) -> str:
    return "/".join(f"{v:.2f}" for v in x)


def _spawn_entry(local_rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(P),
        LOCAL_WORLD_SIZE=str(P),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        run(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # launched by torchrun
        try:
            run(args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawn_entry, args=(args, port), nprocs=P, join=True)


if __name__ == "__main__":
    main()
