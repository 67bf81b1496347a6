"""Workers for the FSDP tests (module-level so spawn can pickle them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from models.config import ModelConfig
from models.m2m100 import M2M100Translation, Seq2SeqBatch
from parallel.mesh import ParallelDims, build_mesh
from parallel.parallelize import ParallelModel, build_parallel_model
from parallel.pipeline.partition import uniform_partition
from tests.dist.pipeline_workers import TINY, random_batch

LR, MAX_NORM, BATCH = 1e-2, 0.5, 8


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01, foreach=True)


def reference_run(steps: int, seed: int = 0) -> tuple[list[float], dict[str, Tensor], dict[str, Tensor]]:
    """One process: (mean token loss per step, grads after the first step, params after the last)."""
    cfg = ModelConfig(**TINY)
    torch.manual_seed(seed)
    model = M2M100Translation(cfg)
    opt = _adamw(list(model.parameters()))
    losses, first_grads = [], {}
    for step in range(steps):
        batch = random_batch(cfg, BATCH, seed=100 + step)
        loss_sum, n = model.loss(batch)
        (loss_sum / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if step == 0:
            first_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss_sum.detach()) / n)
    return losses, first_grads, {k: p.detach().clone() for k, p in model.named_parameters()}


def full(pm: ParallelModel, name: str, t: Tensor) -> Tensor:
    """The single-device tensor behind this rank's piece `t` of parameter `name` (collective)."""
    out = pm.to_logical(name, t.detach())
    return out.full_tensor() if isinstance(out, DTensor) else out


def build(
    world: int,
    pp: int,
    dp: int,
    tp: int,
    schedule: str,
    m: int,
    sharding: str = "fsdp",
    seed: int = 0,
    remat: str = "none",
    **kw: Any,
) -> ParallelModel:
    cfg = ModelConfig(**TINY)
    torch.manual_seed(seed)
    model = M2M100Translation(cfg)
    mesh = build_mesh(ParallelDims(pp=pp, dp=dp, tp=tp, world_size=world))
    v = 2 if schedule in ("interleaved_1f1b", "zbv") else 1
    balance = uniform_partition(len(model.blocks), pp * v)
    return build_parallel_model(model, mesh, balance, m, schedule, v, remat, 0.0, dp_sharding=sharding, **kw)


def flushes_of(pm: ParallelModel, batch: Seq2SeqBatch, m: int, flushes: int) -> list[list[Seq2SeqBatch]]:
    """This dp rank's share of `batch`, in `flushes` flushes of m micro-batches."""
    dp, dp_rank = pm.mesh.size("dp"), pm.mesh.dp_rank
    share = batch.select(slice(dp_rank * batch.size // dp, (dp_rank + 1) * batch.size // dp))
    rows = share.size // flushes
    return [share.select(slice(i * rows, (i + 1) * rows)).split(m) for i in range(flushes)]


def train(pm: ParallelModel, steps: int, m: int, flushes: int = 1) -> tuple[list[float | None], dict[str, Tensor]]:
    """`steps` optimizer steps on the reference's batches (this dp rank's share, split in
    `flushes` flushes of m micro-batches); returns (loss per step on the last stage's ranks,
    None elsewhere; first-step grads as single-device tensors)."""
    cfg = pm.model.config
    opt = _adamw(pm.optimizer_params())
    losses: list[float | None] = []
    first: dict[str, Tensor] = {}
    for step in range(steps):
        batch = random_batch(cfg, BATCH, seed=100 + step)
        results = pm.train_step(flushes_of(pm, batch, m, flushes), loss_scale=1.0 / batch.num_tokens())
        pm.grads.clip_(MAX_NORM)
        if step == 0:
            first = {k: full(pm, k, p.grad) for k, p in pm.named_params().items()}
        opt.step()
        pm.after_optimizer_step()
        opt.zero_grad(set_to_none=True)
        sums = [r.loss_sum for r in results if r.loss_sum is not None]
        if sums:
            total = torch.stack(sums).sum()
            dist.all_reduce(total, group=pm.mesh.group("dp"))
            losses.append(float(total) / batch.num_tokens())
        else:
            losses.append(None)
    return losses, first


def fsdp_parity(rank: int, world: int, cases: list[tuple[Any, ...]], steps: int) -> list[Any]:
    """For each (pp, dp, tp, schedule, m, flushes[, remat]): this rank's (losses per step, max loss
    error, worst first-step grad error, worst final param error, params are DTensors, eval-loss
    error after training on the last stage's ranks or None) vs one process."""
    ref_losses, ref_grads, ref_params = reference_run(steps)
    ref_model = M2M100Translation(ModelConfig(**TINY))
    ref_model.load_state_dict(ref_params, strict=False)
    held_out = random_batch(ref_model.config, 4, seed=999)
    with torch.no_grad():
        ref_sum, ref_tokens = ref_model.loss(held_out)
    out = []
    for pp, dp, tp, schedule, m, flushes, *remat in cases:
        pm = build(world, pp, dp, tp, schedule, m, remat=remat[0] if remat else "none")
        losses, grads = train(pm, steps, m, flushes)
        loss_err = max((abs(a - b) for a, b in zip(losses, ref_losses) if a is not None), default=None)
        grad_err = max(_rel(grads[k], ref_grads[k]) for k in grads)
        params = {k: full(pm, k, p) for k, p in pm.named_params().items()}
        param_err = max(float((params[k] - ref_params[k]).abs().max()) for k in params)
        sharded = all(isinstance(p, DTensor) for p in pm.params())
        eval_sum, eval_tokens = pm.eval_loss(held_out.split(2))
        eval_err = abs(eval_sum / eval_tokens - float(ref_sum) / ref_tokens) if eval_tokens else None
        case = (pp, dp, tp, schedule, m, flushes, *remat)
        out.append((case, losses, loss_err, grad_err, param_err, sharded, eval_err))
    return out


def _rel(got: Tensor, ref: Tensor) -> float:
    return float((got - ref).norm() / ref.norm().clamp(min=1e-6))


def checkpoint_round_trip(
    rank: int, world: int, tmp: str, meshes: list[tuple[int, int, int, str]]
) -> list[tuple[float, int]]:
    """Train one step on meshes[0], save with the trainer's DCP functions; load into each next
    mesh (a fresh model of another seed), compare, train one step and save again. Each mesh is
    (pp, dp, tp, dp_sharding). Returns per load (worst difference, tensors compared) over the
    weights and AdamW moments, as single-device tensors, this rank holds on both meshes."""
    from pathlib import Path

    from trainer.checkpoint.dcp import load_checkpoint, save_checkpoint

    worst: list[tuple[float, int]] = []
    saved: dict[str, Tensor] = {}
    for i, (pp, dp, tp, sharding) in enumerate(meshes):
        pm = build(world, pp, dp, tp, "1f1b", 2, sharding=sharding, seed=i)
        opt = _adamw(pm.optimizer_params())
        if i > 0:
            load_checkpoint(Path(tmp) / f"ckpt-{i - 1}", [pm.model], opt, to_logical=pm.to_logical)
            now = _full_state(pm, opt)
            both = [k for k in now if k in saved]
            worst.append((max(float((now[k] - saved[k]).abs().max()) for k in both), len(both)))
        _train_one(pm, opt, step=i)
        saved = _full_state(pm, opt)
        save_checkpoint(Path(tmp) / f"ckpt-{i}", [pm.model], opt, {"step": i}, to_logical=pm.to_logical)
    return worst


def _train_one(pm: ParallelModel, opt: torch.optim.Optimizer, step: int) -> None:
    batch = random_batch(pm.model.config, BATCH, seed=100 + step)
    pm.train_step(flushes_of(pm, batch, 2, 1), loss_scale=1.0 / batch.num_tokens())
    pm.grads.clip_(MAX_NORM)
    opt.step()
    pm.after_optimizer_step()
    opt.zero_grad(set_to_none=True)


def _full_state(pm: ParallelModel, opt: torch.optim.Optimizer) -> dict[str, Tensor]:
    """Weights and AdamW moments of every parameter this rank holds, as single-device tensors
    (collective; under ZeRO-1 only owners hold moments, so use none/fsdp meshes here)."""
    out = {}
    for name, p in sorted(pm.named_params().items()):
        out[name] = full(pm, name, p)
        st = opt.state.get(p)
        for key in ("exp_avg", "exp_avg_sq"):
            if st:
                out[f"{name}.{key}"] = full(pm, name, st[key])
    return out


def comm_counts(rank: int, world: int, cases: list[tuple[int, int, str, int, int]]) -> list[tuple[int, int, int]]:
    """For each (pp, dp, schedule, m, flushes): this rank's (FSDP parameter groups, all-gathers,
    reduce-scatters) during one optimizer step."""
    from parallel.dp.fsdp_internals import all_states, collectives_module, param_groups

    group_module = collectives_module()
    counts = {"gather": 0, "reduce": 0}
    real = {"gather": group_module.foreach_all_gather, "reduce": group_module.foreach_reduce}

    def counting(kind: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[kind] += 1
            return real[kind](*args, **kwargs)

        return call

    out = []
    group_module.foreach_all_gather, group_module.foreach_reduce = counting("gather"), counting("reduce")
    try:
        for pp, dp, schedule, m, flushes in cases:
            pm = build(world, pp, dp, 1, schedule, m)
            assert pm.fsdp is not None
            counts.update(gather=0, reduce=0)
            batch = random_batch(pm.model.config, BATCH, seed=100)
            pm.train_step(flushes_of(pm, batch, m, flushes), loss_scale=1.0 / batch.num_tokens())
            groups = sum(len(param_groups(s)) for s in all_states(pm.model))
            out.append((groups, counts["gather"], counts["reduce"]))
    finally:
        group_module.foreach_all_gather, group_module.foreach_reduce = real["gather"], real["reduce"]
    return out


def bf16_sequence_parallel(rank: int, world: int, steps: int) -> tuple[list[float | None], float, bool]:
    """(2, 2, 2) with bf16 (FSDP's MixedPrecisionPolicy) and sequence parallelism: (this rank's
    losses, reference losses, largest difference between tp ranks of a sequence-parallel
    gradient shard, whether master weights and gradients stayed fp32)."""
    ref_losses, _, _ = reference_run(steps)
    pm = build(world, 2, 2, 2, "1f1b", 2, autocast_dtype=torch.bfloat16, sequence_parallel=True)
    cfg = pm.model.config
    opt = _adamw(pm.optimizer_params())
    losses: list[float | None] = []
    worst, fp32 = 0.0, True
    for step in range(steps):
        batch = random_batch(cfg, BATCH, seed=100 + step)
        results = pm.train_step(flushes_of(pm, batch, 2, 1), loss_scale=1.0 / batch.num_tokens())
        for p in pm.params():
            fp32 = fp32 and p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32)
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                mine = p.grad.to_local().clone()
                other = mine.clone()
                dist.broadcast(other, src=dist.get_global_rank(pm.mesh.group("tp"), 0), group=pm.mesh.group("tp"))
                worst = max(worst, float((mine - other).abs().max()))
        pm.grads.clip_(MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sums = [r.loss_sum for r in results if r.loss_sum is not None]
        if sums:
            total = torch.stack(sums).sum().float()
            dist.all_reduce(total, group=pm.mesh.group("dp"))
            losses.append(float(total) / batch.num_tokens() - ref_losses[step])
        else:
            losses.append(None)
    return losses, worst, fp32


def bad_sharding(rank: int, world: int) -> str:
    try:
        build(world, 1, 1, 1, "1f1b", 1, sharding="zero3")
    except ValueError as e:
        return str(e)
    return "no error"


def generate_after_training(rank: int, world: int, pp: int, tp: int) -> tuple[list[tuple[list, list]], float]:
    """One fsdp training step on (pp, world / (pp tp), tp), then greedy and beam search on this
    replica's own sources, against `models.generate.generate` on the same single-device weights,
    then one more training step. Returns (this rank's (got, want) per search on the last
    stage's ranks, empty elsewhere; worst weight error after the second step)."""
    from models.generate import SearchSettings, generate

    dp = world // (pp * tp)
    pm = build(world, pp, dp, tp, "1f1b", 2)
    opt = _adamw(pm.optimizer_params())
    assert pm.fsdp is not None
    with pm.fsdp.gathered():  # before any forward (FSDP not lazily initialised yet): nothing run
        pass
    _train_one(pm, opt, step=0)
    _, _, ref_params = reference_run(1)
    base = M2M100Translation(pm.model.config)
    base.load_state_dict(ref_params, strict=False)
    base.eval()
    pm.model.eval()
    batch = random_batch(pm.model.config, 4, seed=7 + pm.mesh.dp_rank)
    ids, mask = batch.input_ids, batch.attention_mask
    out = []
    from parallel.generate import pipeline_generate

    # Replicas make different numbers of calls (as the last batches of a split evaluation set
    # do) inside one outer gather, as `trainer.eval.runner.translate_on_mesh` does: the calls'
    # own gathers nest and must not issue dp collectives (they would not match: a hang).
    with pm.fsdp.gathered():
        for beams in (1, 3) if pm.mesh.dp_rank == 0 else (3,):
            got = pipeline_generate(pm, ids, mask, 5, SearchSettings(num_beams=beams, max_length=8))
            if got is not None:
                with torch.no_grad():
                    want = generate(base, ids, mask, 5, num_beams=beams, max_length=8)
                out.append((got.tolist(), want.tolist()))
    pm.model.train()
    _train_one(pm, opt, step=1)  # the gathered weights are gone: training goes on from the shards
    _, _, ref_after = reference_run(2)
    after = max(float((full(pm, k, p) - ref_after[k]).abs().max()) for k, p in pm.named_params().items())
    return out, after


def train_eval_resume(rank: int, world: int, base: dict[str, Any], cases: list[dict[str, Any]]) -> list[Any]:
    """The real trainer on fsdp, evaluation on: per case (overrides of `base`) a straight run
    saving at step 2, the run resumed from checkpoint-2 into a new output_dir, then (cases with
    `"fp32_eval": True`) checkpoint-4 evaluated again in fp32 (bf16 / fp16 off, the same weights).

    Returns per case, on the logging rank ({} elsewhere): the straight run's rows, the resumed
    run's rows, and the fp32 re-evaluation's rows (or None).
    """
    import logging

    import datasets

    from trainer.config.parse import load_config_dict
    from trainer.run.loop import run

    datasets.disable_progress_bars()
    logging.basicConfig(level=logging.WARNING)
    out: list[Any] = []
    for i, case in enumerate(cases):
        case = dict(case)
        fp32_eval = case.pop("fp32_eval", False)
        values = {**base, **case, "output_dir": f"{base['output_dir']}-{i}"}
        straight = run(load_config_dict(values)).get("history")
        ckpt = f"{values['output_dir']}/checkpoint-2"
        resumed_values = {**values, "output_dir": f"{values['output_dir']}-resumed", "resume_from_checkpoint": ckpt}
        resumed = run(load_config_dict(resumed_values)).get("history")
        again = None
        if fp32_eval:
            fp32 = {**values, "bf16": False, "fp16": False, "do_train": False, "output_dir": f"{values['output_dir']}-fp32"}
            fp32["resume_from_checkpoint"] = f"{values['output_dir']}/checkpoint-4"
            again = run(load_config_dict(fp32)).get("history")
        out.append((straight, resumed, again) if straight is not None else {})
    return out
