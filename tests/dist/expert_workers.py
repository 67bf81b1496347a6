"""Workers for the expert-parallel tests (module-level so spawn can pickle them).

`trainer_cases` runs the real trainer on each case. `mesh_cases` builds, on one spawned group, the (pp, dp, tp, ep) model of each case stage- and
expert-locally (meta device, keyed init), trains 3 AdamW steps and compares the per-step loss
and grad norm with one process computed on the same rank (a plain model, no collectives) that
routes the same micro-batches. `dispatch_edges` checks the all-to-all dispatcher alone where
ranks send or receive nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from models.config import ModelConfig
from models.m2m100 import M2M100Translation, Seq2SeqBatch, block_specs
from models.moe import Experts, LocalDispatcher, Routing
from models.moe.experts import GroupedRows
from tests.dist.pipeline_workers import TINY, random_batch

MOE = dict(TINY, num_experts=4, encoder_sparse_step=2, decoder_sparse_step=2, moe_token_dropout=0.0)
BATCH, STEPS, LR, MAX_NORM = 8, 3, 1e-2, 0.5


@dataclass
class Case:
    """One mesh and routing setting; `same_microbatches`: the reference routes the mesh's
    micro-batches (needed with capacity or the aux loss), else the whole batch at once."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    m: int = 2
    schedule: str = "1f1b"
    remat: str = "none"
    sharding: str = "none"
    sequence_parallel: bool = False
    dropless: bool = True
    capacity_factor: float = 1.0
    aux: float = 0.0
    model: dict[str, Any] = field(default_factory=dict)

    @property
    def same_microbatches(self) -> bool:
        return not self.dropless or self.aux > 0


def _microbatches(batch: Seq2SeqBatch, dp: int, m: int) -> list[list[Seq2SeqBatch]]:
    """Replica r's m micro-batches of `batch`, slots r * m + j (as the trainer numbers them)."""
    out = []
    for r in range(dp):
        share = batch.select(slice(r * batch.size // dp, (r + 1) * batch.size // dp))
        parts = share.split(m)
        for j, part in enumerate(parts):
            part.slot = r * m + j
        out.append(parts)
    return out


def _configure(model: M2M100Translation, case: Case) -> None:
    model.moe.dropless, model.moe.capacity_factor, model.moe.aux_loss_coef = (
        case.dropless,
        case.capacity_factor,
        case.aux,
    )


def reference(case: Case) -> tuple[list[tuple[float, float]], int]:
    """One process, on this rank alone: (mean token loss, grad norm) per step, and the
    assignments its routing dropped (capacity) over the run."""
    cfg = ModelConfig(**{**MOE, **case.model})
    model = M2M100Translation(cfg, seed=0)
    _configure(model, case)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    out, dropped = [], 0
    for step in range(STEPS):
        batch = random_batch(cfg, BATCH, seed=100 + step)
        n = batch.num_tokens()
        model.moe.begin_step(0, step, 1.0 / n)
        groups = [mb for rep in _microbatches(batch, case.dp, case.m) for mb in rep]
        total = 0.0
        for mb in groups if case.same_microbatches else [batch]:
            loss_sum, _ = model.loss(mb)
            (loss_sum / n).backward()
            total += float(loss_sum.detach())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((total / n, float(norm)))
        dropped += sum(int(st.dropped) for ffn in model.sparse_ffns().values() for st in ffn.pop_stats())
    return out, dropped


def build(world: int, case: Case) -> Any:
    """The case's ParallelModel on the whole group, built stage- and expert-locally (seed 0)."""
    from parallel.mesh import ParallelDims, build_mesh
    from parallel.parallelize import build_parallel_model
    from parallel.pipeline.partition import uniform_partition

    cfg = ModelConfig(**{**MOE, **case.model})
    dims = ParallelDims(pp=case.pp, dp=case.dp, tp=case.tp, world_size=world, ep=case.ep).validate(cfg)
    mesh = build_mesh(dims)
    v = 2 if case.schedule in ("interleaved_1f1b", "zbv") else 1
    balance = uniform_partition(len(block_specs(cfg)), case.pp * v)
    pm = build_parallel_model(
        cfg,
        mesh,
        balance,
        case.m,
        case.schedule,
        v,
        case.remat,
        0.0,
        seed=0,
        dp_sharding=case.sharding,
        sequence_parallel=case.sequence_parallel,
    )
    _configure(pm.model, case)
    return pm


def train(pm: Any, case: Case, opt: torch.optim.Optimizer, steps: range) -> list[tuple[float, float]]:
    """`steps` optimizer steps on the global batches of those steps: (loss, grad norm) each."""
    mesh, cfg = pm.mesh, pm.model.config
    out = []
    for step in steps:
        batch = random_batch(cfg, BATCH, seed=100 + step)
        n = batch.num_tokens()
        mbs = _microbatches(batch, case.dp, case.m)[mesh.dp_rank]
        res = pm.train_step([mbs], 1.0 / n, step=step)
        norm = pm.grads.clip_(MAX_NORM)
        opt.step()
        pm.after_optimizer_step()
        pm.model.zero_grad(set_to_none=True)
        loss = res[0].loss_sum
        total = torch.zeros(()) if loss is None or mesh.tp_rank else loss.detach().clone()
        dist.all_reduce(total)  # the last stage's dp replicas (tp rank 0) hold the loss
        out.append((float(total) / n, float(norm)))
    return out


def on_mesh(rank: int, world: int, case: Case) -> tuple[list[tuple[float, float]], int]:
    """The case on the whole group: (loss, grad norm) per step, and the all-to-all bytes rank sent."""
    pm = build(world, case)
    opt = torch.optim.AdamW(pm.optimizer_params(), lr=LR, foreach=True)
    out = train(pm, case, opt, range(STEPS))
    sent = pm.ep_info.stats.bytes_sent if pm.ep_info is not None else 0
    return out, sent


def mesh_cases(rank: int, world: int, cases: list[Case]) -> list[dict[str, Any]]:
    """Every case on the group; per case the largest relative error (loss, grad norm) against one process."""
    results = []
    for case in cases:
        got, sent = on_mesh(rank, world, case)
        ref, dropped = reference(case)
        err = max(max(abs(a - b) / abs(b) for a, b in zip(g, r)) for g, r in zip(got, ref))
        results.append({"err": err, "bytes": sent, "dropped": dropped, "got": got, "ref": ref})
    return results


def reshard_cases(rank: int, world: int, tmp: str, save: Case, loads: list[Case]) -> list[float]:
    """Train `save` 2 steps, checkpoint (DCP: weights and AdamW state, per-expert names), train
    step 3; then each of `loads` restores the checkpoint on its mesh and trains step 3. Returns
    per load the largest relative error of step 3's (loss, grad norm) against `save`'s."""
    from pathlib import Path

    from trainer.checkpoint.dcp import load_checkpoint, save_checkpoint

    path = Path(tmp) / "ckpt"
    pm = build(world, save)
    opt = torch.optim.AdamW(pm.optimizer_params(), lr=LR, foreach=True)
    train(pm, save, opt, range(2))
    save_checkpoint(path, [pm.model], opt, {"step": 2}, to_logical=pm.to_logical)
    [want] = train(pm, save, opt, range(2, 3))
    errs = []
    for case in loads:
        pm = build(world, case)
        opt = torch.optim.AdamW(pm.optimizer_params(), lr=LR, foreach=True)
        load_checkpoint(path, [pm.model], opt, to_logical=pm.to_logical, restore_rng=False)
        [got] = train(pm, case, opt, range(2, 3))
        errs.append(max(abs(a - b) / abs(b) for a, b in zip(got, want)))
    return errs


def trainer_cases(rank: int, world: int, base: dict[str, Any], cases: list[dict[str, Any]]) -> list[Any]:
    """Train each case with the real trainer; per case the logging rank's metrics rows (empty elsewhere)."""
    import logging

    from trainer.config.parse import load_config_dict
    from trainer.run.loop import run

    logging.basicConfig(level=logging.WARNING)
    out = []
    for i, case in enumerate(cases):
        values = {**base, **case}
        values["output_dir"] = case.get("output_dir", f"{base['output_dir']}-{i}")
        out.append(run(load_config_dict(values)).get("history"))
    return out


def _edge_routing(case: str, rank: int, world: int, experts: int, h: int) -> tuple[Tensor, Routing]:
    """This rank's tokens and routing for an edge case of `dispatch_edges` (slots in token order)."""
    g = torch.Generator().manual_seed(100 + rank)
    n = 0 if case == "no tokens anywhere" else 5 + rank
    low = experts // world if case == "nothing to rank 0" else 0  # rank 0 holds experts [0, E / world)
    pairs = [torch.randperm(experts - low, generator=g)[:2] + low for _ in range(n)]
    index = torch.stack(pairs) if n else torch.zeros(0, 2, dtype=torch.long)
    kept = torch.rand(n, 2, generator=g) >= 0.3  # some assignments dropped (capacity)
    if case == "last rank keeps none":
        kept &= rank != world - 1
    slot = torch.full((n, 2), -1, dtype=torch.long)
    seen: dict[int, int] = {}
    for a, e in enumerate(index.reshape(-1).tolist()):
        if kept.reshape(-1)[a]:
            slot.view(-1)[a] = seen.get(e, 0)
            seen[e] = int(slot.view(-1)[a]) + 1
    gate = torch.rand(n, 2, generator=g) * kept
    tokens = torch.bincount(index.reshape(-1), minlength=experts)
    return torch.randn(n, h, generator=g), Routing(
        index, gate, slot, torch.zeros(()), tokens, torch.zeros((), dtype=torch.long), None
    )


def _rel(got: Tensor, want: Tensor) -> float:
    """Largest error relative to the largest reference value (1 for an all-zero reference)."""
    return float((got - want).abs().max()) / max(1.0, float(want.abs().max())) if want.numel() else 0.0


def dispatch_edges(rank: int, world: int) -> dict[str, float]:
    """`AllToAllDispatcher` over the whole group (ep = world, 2 experts per rank) against the
    one-process `LocalDispatcher` with every expert, on both layouts: routings where a rank keeps
    no assignment, no rank sends to rank 0's experts, or no rank has a token. Per case and layout
    the largest relative error (`_rel`) of the output, the input's gradient and this rank's
    expert gradients (the reference's summed over the ranks); every rank enters every collective, so a miss hangs."""
    from unittest import mock

    import torch.nn.functional as F

    from parallel.expert import dispatch

    experts, h, ffn = 2 * world, 8, 8
    torch.manual_seed(0)
    full = Experts(h, ffn, experts, F.relu)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_()
    first = 2 * rank
    mine = Experts(h, ffn, experts, F.relu, local=(first, first + 2))
    with torch.no_grad():
        for name, p in mine.named_parameters():
            p.copy_(getattr(full, name)[first : first + 2])
    out = {}
    for case in ("mixed", "last rank keeps none", "nothing to rank 0", "no tokens anywhere"):
        for grouped in (True, False):
            x, routing = _edge_routing(case, rank, world, experts, h)
            x.requires_grad_(True)
            full.zero_grad(), mine.zero_grad()
            with mock.patch.object(dispatch, "grouped_layout", lambda *_: grouped):
                a2a = dispatch.AllToAllDispatcher(dist.group.WORLD)
                rows, ctx = a2a.dispatch(x, routing, mine)
                y = a2a.combine(mine(rows, ctx) if isinstance(ctx, GroupedRows) else mine(rows), routing, ctx)
            y.sum().backward()
            x_ref = x.detach().clone().requires_grad_(True)
            local = LocalDispatcher(grouped=False)
            buffer, ctx_ref = local.dispatch(x_ref, routing, full)
            y_ref = local.combine(full(buffer), routing, ctx_ref)
            y_ref.sum().backward()
            assert x.grad is not None and x_ref.grad is not None
            errs = [_rel(y, y_ref), _rel(x.grad, x_ref.grad)] if len(x) else []
            for name, p in full.named_parameters():
                got = getattr(mine, name).grad
                assert p.grad is not None and got is not None, f"{case}: {name} has no gradient"
                summed = p.grad.clone()
                dist.all_reduce(summed)
                errs.append(_rel(got, summed[first : first + 2]))
            out[f"{case}, {'grouped' if grouped else 'buffer'}"] = max(errs)
    return out


def group_run(
    rank: int,
    world: int,
    tmp: str,
    base: dict[str, Any],
    runs: list[dict[str, Any]],
    cases: list[Case],
    save: Case,
    loads: list[Case],
) -> dict[str, Any]:
    """Every check of one spawned group: trainer runs, `mesh_cases` and `reshard_cases`."""
    return {
        "trainer": trainer_cases(rank, world, base, runs),
        "meshes": mesh_cases(rank, world, cases),
        "reshard": reshard_cases(rank, world, tmp, save, loads),
        "dispatch": dispatch_edges(rank, world),
    }


def translate_lines(rank: int, world: int, flags: dict[str, Any], lines: list[str]) -> str | None:
    """`trainer.translate` on this group's mesh (`flags`: TranslateArguments fields); rank 0's stdout."""
    import io

    from trainer.eval.hf_translate import TranslateArguments, run

    out = io.StringIO()
    run(TranslateArguments(**flags), io.StringIO("\n".join(lines) + "\n"), out)
    return out.getvalue() if rank == 0 else None


def trainer_and_translate(
    rank: int, world: int, base: dict[str, Any], runs: list[dict[str, Any]], flags: dict[str, Any], lines: list[str]
) -> dict[str, Any]:
    """The 8-rank group: trainer runs, then `trainer.translate` on the mesh in `flags`."""
    return {"trainer": trainer_cases(rank, world, base, runs), "translate": translate_lines(rank, world, flags, lines)}
