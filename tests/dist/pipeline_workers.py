"""Workers for the pipeline parity tests (module-level so spawn can pickle them)."""

from __future__ import annotations

import copy

import torch

from models.config import ModelConfig
from models.m2m100 import IGNORE_INDEX, M2M100Translation, Seq2SeqBatch
from parallel.mesh import ParallelDims, build_mesh
from parallel.parallelize import build_parallel_model
from parallel.pipeline.partition import uniform_partition

TINY = dict(
    vocab_size=61,
    d_model=16,
    encoder_layers=3,
    decoder_layers=3,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    max_position_embeddings=64,
)


def random_batch(cfg: ModelConfig, n: int, seed: int) -> Seq2SeqBatch:
    """n pairs of varied lengths, sorted so micro-batches get different trimmed lengths."""
    g = torch.Generator().manual_seed(seed)
    src_lens = sorted(torch.randint(2, 12, (n,), generator=g).tolist(), reverse=True)
    tgt_lens = sorted(torch.randint(2, 10, (n,), generator=g).tolist(), reverse=True)
    s, t = max(src_lens), max(tgt_lens)
    src = torch.full((n, s), cfg.pad_token_id)
    lab = torch.full((n, t), IGNORE_INDEX)
    for i in range(n):
        src[i, : src_lens[i]] = torch.randint(4, cfg.vocab_size, (src_lens[i],), generator=g)
        src[i, src_lens[i] - 1] = cfg.eos_token_id
        lab[i, : tgt_lens[i]] = torch.randint(4, cfg.vocab_size, (tgt_lens[i],), generator=g)
    dec = torch.full_like(lab, cfg.pad_token_id)
    dec[:, 0] = cfg.decoder_start_token_id
    dec[:, 1:] = lab[:, :-1].masked_fill(lab[:, :-1] == IGNORE_INDEX, cfg.pad_token_id)
    return Seq2SeqBatch(src, (src != cfg.pad_token_id).long(), dec, lab)


def reference_grads(model: M2M100Translation, batch: Seq2SeqBatch) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss_sum, n = model.loss(batch)
    (loss_sum / n).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def pipeline_grad_parity(rank: int, world: int, cases: list[tuple[int, str, str]], v_of: dict) -> list:
    """For each (m, schedule, remat): max relative grad error vs the unsplit batch on this rank."""
    cfg = ModelConfig(**TINY)
    torch.manual_seed(0)
    base = M2M100Translation(cfg)
    batch = random_batch(cfg, 8, seed=1)
    ref = reference_grads(copy.deepcopy(base), batch)
    mesh = build_mesh(ParallelDims(pp=world, dp=1, tp=1, world_size=world))
    out = []
    for m, schedule, remat in cases:
        v = v_of.get(schedule, 1)
        model = copy.deepcopy(base)
        balance = uniform_partition(len(model.blocks), world * v)
        pm = build_parallel_model(model, mesh, balance, m, schedule, v, remat, label_smoothing=0.0)
        micro = batch.split(m)
        pm.train_step([micro], loss_scale=1.0 / batch.num_tokens())
        got = {k: p.grad for k, p in pm.named_params().items()}
        out.append((m, schedule, remat, *grad_errors(got, ref)))
    return out


def grad_errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(||g - r|| / ||r|| over the parameters this rank holds, worst per-parameter relative error).

    Per-parameter errors skip gradients that are zero up to rounding (e.g. k_proj.bias, whose
    exact gradient is 0 because softmax ignores a per-row constant): they count only where
    ||r_param|| > 1e-4 * ||r||.
    """
    diff = sum(float((got[k] - ref[k]).double().pow(2).sum()) for k in got) ** 0.5
    norm = sum(float(ref[k].double().pow(2).sum()) for k in got) ** 0.5
    worst = 0.0
    for k in got:
        rn = float(ref[k].double().norm())
        if rn > 1e-4 * norm:
            worst = max(worst, float((got[k] - ref[k]).double().norm()) / rn)
    return diff / norm, worst


def zero_bubble_defers_weight_grads(rank: int, world: int) -> tuple[int, int, bool]:
    """Regression: an empty WeightGradStore is falsy (it has __len__), and the executor once
    replaced the model's store with a new one, so W did nothing and zero_bubble ran as 1F1B.

    Returns (closures queued during the flush, closures still pending after it, same store).
    """
    cfg = ModelConfig(**TINY)
    torch.manual_seed(0)
    model = M2M100Translation(cfg)
    mesh = build_mesh(ParallelDims(pp=world, dp=1, tp=1, world_size=world))
    pm = build_parallel_model(
        model,
        mesh,
        uniform_partition(len(model.blocks), world),
        4,
        "zero_bubble",
        1,
        "none",
        label_smoothing=0.0,
    )
    store = pm.wgrad_store
    queued = 0
    put = store.put

    def counting_put(fn):  # type: ignore[no-untyped-def]
        nonlocal queued
        queued += 1
        put(fn)

    store.put = counting_put  # type: ignore[method-assign]
    batch = random_batch(cfg, 8, seed=2)
    pm.train_step([batch.split(4)], loss_scale=1.0 / batch.num_tokens())
    return queued, len(store), pm.executor.wgrad_store is store


def dp_overlap(rank: int, world: int, pp: int, schedule: str) -> tuple[int, float]:
    """dp=2 (x pp): (buckets launched during the last backward, grad error vs the unsplit batch)."""
    cfg = ModelConfig(**TINY)
    torch.manual_seed(0)
    base = M2M100Translation(cfg)
    batch = random_batch(cfg, 8, seed=3)
    ref = reference_grads(copy.deepcopy(base), batch)
    dp = world // pp
    mesh = build_mesh(ParallelDims(pp=pp, dp=dp, tp=1, world_size=world))
    model = copy.deepcopy(base)
    pm = build_parallel_model(
        model, mesh, uniform_partition(len(model.blocks), pp), 2, schedule, 1, "none", label_smoothing=0.0
    )
    share = batch.select(slice(mesh.dp_rank * 8 // dp, (mesh.dp_rank + 1) * 8 // dp))
    pm.train_step([share.split(2)], loss_scale=1.0 / batch.num_tokens())
    got = {k: p.grad for k, p in pm.named_params().items()}
    return pm.grads.reducer.launched_during_backward, grad_errors(got, ref)[0]


def host_reads_in_step(rank: int, world: int, meshes: list[tuple[int, int, int, str, bool]]) -> list:
    """For each (pp, dp, tp, schedule, sequence_parallel): device-to-host reads and aten ops
    during two timed flushes of 4 micro-batches (gradient accumulation) plus the global
    norm and clip. On a GPU each read would stall the launch of the next micro-batch.
    Dropout is on, keyed per micro-batch (`parallel.rng`): re-seeding and tp forks read nothing."""
    from parallel.dispatch_count import DispatchCounter

    cfg = ModelConfig(**{**TINY, "dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.1})
    keys = [[1, 2, 3, 4], [5, 6, 7, 8]]
    out = []
    for pp, dp, tp, schedule, sp in meshes:
        torch.manual_seed(0)
        model = M2M100Translation(cfg)
        mesh = build_mesh(ParallelDims(pp=pp, dp=dp, tp=tp, world_size=world))
        v = 2 if schedule in ("interleaved_1f1b", "zbv") else 1
        balance = uniform_partition(len(model.blocks), pp * v)
        pm = build_parallel_model(model, mesh, balance, 4, schedule, v, "none", 0.1, sequence_parallel=sp)
        batch = random_batch(cfg, 8 * dp, seed=4)
        share = batch.select(slice(mesh.dp_rank * 8, (mesh.dp_rank + 1) * 8))
        flushes = [share.split(4), share.split(4)]
        pm.train_step(flushes, loss_scale=1.0 / batch.num_tokens(), dropout_keys=keys)  # warm-up
        pm.model.zero_grad(set_to_none=True)
        with DispatchCounter() as counter:
            results = pm.train_step(
                flushes, loss_scale=1.0 / batch.num_tokens(), timed=True, dropout_keys=keys
            )
            pm.grads.clip_(1.0)
        assert results[-1].timeline, "a timed flush has a timeline"
        out.append((pp, dp, tp, schedule, sp, counter.host_reads, counter.num_ops))
    return out


def bf16_sequence_parallel_grads(rank: int, world: int) -> float:
    """Regression: inside a bf16 step the modules hold working copies, and the sequence-
    parallel gradient sum once iterated the model's parameters then, so it summed nothing.
    Returns the largest difference between tp ranks of a replicated parameter's gradient
    (row-parallel biases and norms: identical after the sum)."""
    import torch.distributed as dist

    cfg = ModelConfig(**TINY)
    torch.manual_seed(0)
    model = M2M100Translation(cfg)
    mesh = build_mesh(ParallelDims(pp=1, dp=1, tp=world, world_size=world))
    pm = build_parallel_model(
        model, mesh, [len(model.blocks)], 2, "1f1b", 1, "none", 0.0,
        autocast_dtype=torch.bfloat16, sequence_parallel=True,
    )  # fmt: skip
    batch = random_batch(cfg, 8, seed=5)
    pm.train_step([batch.split(2)], loss_scale=1.0 / batch.num_tokens())  # two micro-batches: working weights
    worst = 0.0
    for name, p in pm.named_params().items():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            other = p.grad.clone()
            dist.broadcast(other, src=0, group=mesh.group("tp"))
            worst = max(worst, float((p.grad - other).abs().max()))
            assert type(p) is torch.nn.Parameter and p.dtype == torch.float32, name
    return worst


def zbv_parity(rank: int, world: int, cases: list[tuple[int, str, list[int] | None]]) -> list:
    """ZB-V on `world` pp ranks. For each (m, remat, balance; None: uniform) returns this rank's
    (m, remat, grad error, worst param error, eval-loss relative error on the last stage's
    rank (None elsewhere), pp ranks sharing the tied embedding, weight grads queued for W,
    queued ones never run)."""
    cfg = ModelConfig(**TINY)
    torch.manual_seed(0)
    base = M2M100Translation(cfg)
    batch = random_batch(cfg, 8, seed=1)
    ref = reference_grads(copy.deepcopy(base), batch)
    with torch.no_grad():
        ref_sum, ref_tokens = base.loss(batch)
    ref_loss = float(ref_sum) / ref_tokens
    mesh = build_mesh(ParallelDims(pp=world, dp=1, tp=1, world_size=world))
    out = []
    for m, remat, balance in cases:
        model = copy.deepcopy(base)
        balance = balance or uniform_partition(len(model.blocks), 2 * world)
        pm = build_parallel_model(model, mesh, balance, m, "zbv", 2, remat, label_smoothing=0.0)
        queued = _count_queued(pm.wgrad_store)
        pm.train_step([batch.split(m)], loss_scale=1.0 / batch.num_tokens())
        got = {k: p.grad for k, p in pm.named_params().items()}
        loss_sum, tokens = pm.eval_loss(batch.split(4))
        loss_err = abs(loss_sum / tokens - ref_loss) / ref_loss if rank == pm.plan.last_stage_rank else None
        errors = grad_errors(got, ref)
        out.append((m, remat, *errors, loss_err, pm.grads.tied_ranks, queued[0], len(pm.wgrad_store)))
    return out


def _count_queued(store) -> list[int]:  # type: ignore[no-untyped-def]
    """Count the closures `store` defers from now on (a one-element list, updated in place)."""
    queued = [0]
    put = store.put

    def counting_put(fn):  # type: ignore[no-untyped-def]
        queued[0] += 1
        put(fn)

    store.put = counting_put
    return queued


PROFILE_CASES = [  # (name, autocast dtype, micro-batches, sequence parallel, remat)
    ("bf16 autocast (m=1)", torch.bfloat16, 1, False, "none"),
    ("bf16 working weights (m=2)", torch.bfloat16, 2, False, "none"),
    ("bf16 sequence parallel, selective remat", torch.bfloat16, 2, True, "selective"),
    ("fp32 full remat", None, 1, False, "full"),
]


def profile_matches_meter(rank: int, world: int) -> list[tuple[str, float, int]]:
    """Balancing measures what runs: per `PROFILE_CASES`, a stage's activation bytes summed from
    `profile_kinds` (one tp rank's shard built without a process group, in the run's precision
    and remat) and what the executor's meter counts for that stage in a real tp=`world` step
    of the same model and micro-batch: (case, profiled, metered)."""
    from models.m2m100 import block_specs
    from parallel.pipeline.profile import RunSetting, profile_kinds
    from trainer.planner.cost import stage_activation_bytes

    drop = {"dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.1}
    cfg = ModelConfig(**{**TINY, "encoder_layers": 1, "decoder_layers": 1, **drop})
    mesh = build_mesh(ParallelDims(pp=1, dp=1, tp=world, world_size=world))
    batch = random_batch(cfg, 4, seed=7)
    n = len(block_specs(cfg))
    out = []
    for name, dtype, m, sp, remat in PROFILE_CASES:
        pm = build_parallel_model(
            cfg, mesh, [n], m, "1f1b", 1, remat, 0.0, autocast_dtype=dtype, sequence_parallel=sp, seed=0
        )
        pm.model.train()
        results = pm.train_step([[batch] * m], loss_scale=1.0 / (m * batch.num_tokens()), timed=True)
        run = RunSetting(world, sp, dtype, working_weights=m > 1, remat=remat)
        kinds = profile_kinds(cfg, batch, torch.device("cpu"), run, timed=False)
        profiled = stage_activation_bytes([kinds[s.kind] for s in block_specs(cfg)], range(n))
        out.append((name, profiled, results[0].peak_activation_bytes))
    return out


def dp_bounded_buffers(rank: int, world: int, bucket_bytes: int = 4096) -> dict[str, object]:
    """dp = world with small buckets: the gradient reducer (overlapped with the backward) and
    ZeRO-1's broadcast keep at most `MAX_BUCKETS_IN_FLIGHT` flat buckets alive, and their
    results are bit-identical to one all-reduce / broadcast per tensor."""
    import torch.distributed as dist

    from parallel.dp.reduce import MAX_BUCKETS_IN_FLIGHT, GradReducer
    from parallel.dp.zero1 import ZeroOneSharding

    cfg = ModelConfig(**TINY)
    torch.manual_seed(0)
    model = M2M100Translation(cfg)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    reducer = GradReducer([params], dist.group.WORLD, bucket_bytes=bucket_bytes)
    batch = random_batch(cfg, 4, seed=20 + rank)  # each replica its own data
    want = reference_grads(model, batch)
    for g in want.values():
        dist.all_reduce(g)  # one tensor at a time: the plain sum
    model.zero_grad(set_to_none=True)
    reducer.arm(0)
    loss_sum, n = model.loss(batch)
    (loss_sum / n).backward()
    reducer.all_reduce()
    grads_exact = all(torch.equal(p.grad, want[k]) for k, p in named)
    largest = max(p.numel() * p.element_size() for p in params)

    zero = ZeroOneSharding(named, dist.group.WORLD, bucket_bytes=bucket_bytes)
    before = {k: p.detach().clone() for k, p in named}
    with torch.no_grad():
        for p in zero.owned():  # an "update" only the owner makes
            p.add_(1.0 + rank)
    zero.broadcast_updated()
    params_exact = all(torch.equal(p, before[k] + (1.0 + zero.owner[k])) for k, p in named)
    return {
        "buckets": len(reducer.buckets),
        "launched_during_backward": reducer.launched_during_backward,
        "peak_in_flight": reducer.peak_in_flight,
        "bound": MAX_BUCKETS_IN_FLIGHT,
        "grads_exact": grads_exact,
        "zero1_buckets": len(zero.buckets),
        "zero1_peak_bytes": zero.peak_in_flight_bytes,
        "zero1_bound_bytes": MAX_BUCKETS_IN_FLIGHT * max(bucket_bytes, largest),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "params_exact": params_exact,
    }
