"""Measure each block's cost on a sample micro-batch, as the run executes it: for
`partition_method: time | memory` (`profile_blocks_by_kind`) and for the planner
(`profile_block_phases`: forward, backward, the zero-bubble I / W split and the activation
bytes the executor's meter counts, per block).

`profile_kinds` measures one block of each kind on a one-layer model built as the run builds
its rank's share (`RunSetting`): tp-sharded to one rank's widths without a process group
(`parallel.tp.comm.ShardOnlyGroup`), in the run's precision (autocast, and the step's
low-precision working weights when it has several micro-batches), with its remat policy. So
the times and activation bytes are those the executor meets on a tp rank, never those of an
unsharded fp32 block, and balancing never builds the whole model.

Every block runs forward and backward alone on the state the blocks before it
produce (inputs detached, so each timing covers one block only; a random
gradient stands in for the one the next block would send). Time is the median
of `repeats` runs after a warm-up; memory is the block's parameter bytes plus
the bytes autograd saves for its backward (activations), as GPipe/torchgpipe's
balance-by-memory counts them. The head's cost includes the output projection
and the loss over the full vocabulary, which is why the last stage tends to get
fewer decoder layers.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from models.config import ModelConfig
from models.loss import cross_entropy_sum
from models.m2m100 import BlockKind, BlockSpec, M2M100Translation, Seq2SeqBatch, State, block_specs

LossFn = Callable[[Tensor, Tensor], Tensor]  # (logits, labels) -> sum of token losses


@dataclass(frozen=True)
class RunSetting:
    """How the run executes a block, so that a profile measures what the executor meets.

    tp, sequence_parallel: the tp shard: the last rank's, whose vocabulary slice holds the
        padding (its head keeps a mask of it: a few bytes more than the other ranks).
    dtype: the autocast / working-weight dtype (bf16, fp16), None for fp32.
    working_weights: the step's low-precision weight copies, cast once (a step of several
        micro-batches, `ParallelModel.train_step`): weights, not activations, for the meter.
        Without them autocast casts a weight at each use and keeps the copy for backward.
    remat: the activation_checkpointing policy ("stage" is profiled as "none": the stage
        keeps only its input, which the caller accounts for).
    moe_dropless, moe_capacity_factor: a sparse layer's routing (`models.moe.MoERun`): how many
        token slots its experts compute.
    """

    tp: int = 1
    sequence_parallel: bool = False
    dtype: torch.dtype | None = None
    working_weights: bool = False
    remat: str = "none"
    moe_dropless: bool = False
    moe_capacity_factor: float = 1.0


def one_layer_model(
    config: ModelConfig, device: torch.device, seed: int = 0, run: RunSetting = RunSetting()
) -> tuple[M2M100Translation, LossFn]:
    """`config`'s model with one encoder and one decoder layer (every block kind once), built
    as a rank's share is: on meta, tp-sharded as the last tp rank (`ShardOnlyGroup`: no process
    group), materialised
    on `device` from the keyed init of `seed`, remat applied; with the head's loss (vocab-
    parallel under tp). In training mode.

    Raises:
        ValueError: tp does not divide the model (heads, FFN, d_model).
    """
    from parallel.materialize import keyed_init_fill, materialize
    from parallel.remat import apply_remat

    with torch.device("meta"):
        model = M2M100Translation(replace(config, encoder_layers=1, decoder_layers=1))
    loss_fn: LossFn = cross_entropy_sum
    if run.tp > 1:
        from parallel.tp.apply import apply_tensor_parallel
        from parallel.tp.comm import ShardOnlyGroup

        shard = ShardOnlyGroup(run.tp, run.tp - 1)
        loss_fn = apply_tensor_parallel(model, shard, run.sequence_parallel).loss
    materialize(model, device, keyed_init_fill(model, seed), run.tp, run.tp - 1)
    model.moe.dropless, model.moe.capacity_factor = run.moe_dropless, run.moe_capacity_factor
    apply_remat(model, "none" if run.remat == "stage" else run.remat)
    return model.train(), loss_fn


def profile_kinds(
    config: ModelConfig,
    batch: Seq2SeqBatch,
    device: torch.device,
    run: RunSetting = RunSetting(),
    repeats: int = 3,
    timed: bool = True,
    seed: int = 0,
) -> dict[BlockKind, BlockPhases]:
    """Each block kind's `BlockPhases` on `batch`, measured on `one_layer_model` under `run`
    (sequence parallelism pads the batch to a multiple of tp, as the run does)."""
    model, loss_fn = one_layer_model(config, device, seed, run)
    return _profile_one_layer(model, loss_fn, batch, run, repeats, timed)


def _profile_one_layer(
    model: M2M100Translation, loss_fn: LossFn, batch: Seq2SeqBatch, run: RunSetting, repeats: int, timed: bool
) -> dict[BlockKind, BlockPhases]:
    batch = batch.to(next(model.parameters()).device)
    if run.tp > 1 and run.sequence_parallel:
        batch = batch.pad_to_multiple(run.tp, model.config.pad_token_id)
    working = run.working_weights and run.dtype is not None
    phases = profile_block_phases(model, batch, repeats, run.dtype, timed, loss_fn, working)
    return {spec.kind: ph for spec, ph in zip(model.blocks, phases)}


def profile_blocks_by_kind(
    config: ModelConfig,
    batch: Seq2SeqBatch,
    device: torch.device,
    seed: int = 0,
    repeats: int = 3,
    run: RunSetting = RunSetting(),
    ep: int = 1,
) -> tuple[list[float], list[float], list[int]]:
    """(seconds of forward + backward, bytes of parameters + activations, parameter count) for
    every block of `config`'s model on one rank of `run`, measured on `one_layer_model`: the
    layers of a stack are alike, so each gets its kind's cost. Parameters are the rank's shards
    (fp32 masters, the tied table at the source embedding); activations as the executor's meter
    counts a stage of that one block. An NLLB-MoE's sparse layers are a kind of their own
    (measured on a one-layer copy whose layers are sparse), and a rank holds E / ep of their
    experts: their parameter count and bytes are this rank's.

    Args:
        config: the model to partition.
        batch: one sample micro-batch.
        device: where to build the one-layer model and run it.
        seed: its init seed (the values do not change the costs).
        repeats: timed repetitions per block after a warm-up.
        run: the run's tp shard, precision and remat.
        ep: expert-parallel size.
    """
    costs: dict[tuple[BlockKind, bool], tuple[float, float, int]] = {}
    for sparse in (False, True) if config.sparse_layers() else (False,):
        step = 1 if sparse else 0
        one = replace(config, encoder_sparse_step=step, decoder_sparse_step=step)
        model, loss_fn = one_layer_model(one, device, seed, run)
        kinds = _profile_one_layer(model, loss_fn, batch, run, repeats, timed=True)
        counts, experts = param_counts_per_block(model), expert_params_per_block(model)
        for spec, c, x in zip(model.blocks, counts, experts):
            mine = c - (x - x // ep)  # less the experts other ranks hold
            ph = kinds[spec.kind]
            costs.setdefault(
                (spec.kind, x > 0),
                (ph.forward_s + ph.backward_s, float(4 * mine + ph.activation_bytes), mine),
            )
    per_block = [costs[(s.kind, _is_sparse(config, s))] for s in block_specs(config)]
    return [c[0] for c in per_block], [c[1] for c in per_block], [c[2] for c in per_block]


def _is_sparse(config: ModelConfig, spec: BlockSpec) -> bool:
    layer = spec.kind in (BlockKind.ENC_LAYER, BlockKind.DEC_LAYER)
    return layer and config.is_sparse(spec.kind is BlockKind.DEC_LAYER, spec.index)


def expert_params_per_block(model: M2M100Translation) -> list[int]:
    """Expert parameters of each block of `model` (0 but for its sparse layers; meta models too)."""
    ffns = model.sparse_ffns()
    return [
        sum(p.numel() for p in ffns[spec.name].experts.parameters()) if spec.name in ffns else 0
        for spec in model.blocks
    ]


def param_counts_per_block(model: M2M100Translation) -> list[int]:
    """Parameters of each block of `model` (the tied table counted once, at the source embedding);
    works on a meta-device model (shapes only)."""
    return [sum(p.numel() for p in _block_params(model, spec)) for spec in model.blocks]


def _block_params(model: M2M100Translation, spec: BlockSpec) -> list[torch.nn.Parameter]:
    """The block's parameters; the tied table counts once, at the source embedding."""
    params = model.block_parameters([spec])
    if spec.kind is BlockKind.SRC_EMBED or model.shared is None:
        return params
    table = {id(p) for p in model.shared.parameters()}
    return [p for p in params if id(p) not in table]


@dataclass(frozen=True)
class ActivationParts:
    """Where a block's activation bytes come from, so a stage of several blocks counts each tensor once.

    The executor's meter charges a stage's inputs once and every saved storage once per
    (stage, micro-batch); a block profiled alone charges its own inputs again (the encoder
    output that every decoder layer receives, for one). Stage sums use these parts instead
    (`trainer.planner.cost.stage_activation_bytes`).

    own: bytes saved for backward that are neither the block's inputs nor the micro-batch's.
    inputs: bytes of each input state key; saved_inputs: the input keys it saves.
    outputs: bytes of each output key; passthrough: output keys that are the input tensor itself.
    batch: bytes of each micro-batch tensor it saves (ids, labels, the source key mask that
        every layer's checkpoint keeps under full remat): once per stage, however many use it.
    """

    own: int
    inputs: tuple[tuple[str, int], ...]
    saved_inputs: frozenset[str]
    outputs: tuple[tuple[str, int], ...]
    passthrough: frozenset[str]
    batch: tuple[tuple[str, int], ...] = ()

    @property
    def alone(self) -> int:
        """What the meter charges the block run as a stage of its own: its inputs, the batch
        tensors it saves and its own bytes."""
        return sum(n for _, n in self.inputs) + sum(n for _, n in self.batch) + self.own

    def scaled(self, factor: float) -> ActivationParts:
        """Every byte count times `factor` (another micro-batch size, or a tp shard)."""

        def scale(pairs: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
            return tuple((k, int(n * factor)) for k, n in pairs)

        return ActivationParts(
            int(self.own * factor),
            scale(self.inputs),
            self.saved_inputs,
            scale(self.outputs),
            self.passthrough,
            scale(self.batch),
        )


@dataclass(frozen=True)
class BlockPhases:
    """One block's costs on one micro-batch, phase by phase (seconds; bytes).

    forward_s: the forward (the head's includes the loss, as the last stage runs it).
    backward_s: the full backward (input and weight grads, as 1F1B's B).
    backward_input_s / backward_weight_s: the zero-bubble split: I with the linear
        weight grads deferred, then W running them (`parallel.pipeline.zero_bubble`).
    activation_bytes: what the forward keeps for backward, counted by the executor's
        `SavedTensorMeter` (the block's input included; rematerialised regions count
        only the inputs they keep).
    parts: the same bytes split by origin (`ActivationParts`), where measured.
    """

    forward_s: float
    backward_s: float
    backward_input_s: float
    backward_weight_s: float
    activation_bytes: int
    parts: ActivationParts | None = None


def profile_block_phases(
    model: M2M100Translation,
    batch: Seq2SeqBatch,
    repeats: int = 3,
    autocast_dtype: torch.dtype | None = None,
    timed: bool = True,
    loss_fn: LossFn = cross_entropy_sum,
    working_weights: bool = False,
) -> list[BlockPhases]:
    """Per block of `model.blocks`: forward, backward and the I / W split, medians of `repeats`.

    Every block runs alone on the state the blocks before it produce (inputs detached).
    `model` is changed in place: its linears are routed through the zero-bubble store
    (exactly `F.linear` outside a deferral), so pass a copy; apply the remat policy to it
    first to measure the policy's recompute and kept bytes.

    Args:
        model: the model (any remat policy and tp sharding applied).
        batch: one micro-batch on the model's device.
        repeats: timed repetitions after one warm-up.
        autocast_dtype: run forwards under autocast (bf16 runs), as the executor does.
        timed: False measures only the activation bytes (one forward per block, times 0).
        loss_fn: the head's loss (the vocab-parallel one under tp).
        working_weights: hold the `autocast_dtype` working copies of the weights throughout
            (`parallel.mixed_precision`), as a step of several micro-batches does.

    Returns:
        One `BlockPhases` per block, in block order.
    """
    from parallel.mixed_precision import WorkingWeights
    from parallel.pipeline.memory import SavedTensorMeter
    from parallel.pipeline.zero_bubble import WeightGradStore, enable_deferred_wgrad

    store = WeightGradStore()
    enable_deferred_wgrad(model, store)
    meter = SavedTensorMeter(model)
    masters = list(model.parameters())
    phases: list[BlockPhases] = []
    state: State = {}
    swap: contextlib.AbstractContextManager[list[Tensor]] = (
        WorkingWeights(model, autocast_dtype).swapped()
        if working_weights and autocast_dtype
        else contextlib.nullcontext([])
    )
    with swap as working:
        meter.ignore(working)
        for spec in model.blocks:
            inputs = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in state.items()}
            run = functools.partial(_run_block, model, spec, inputs, batch, autocast_dtype, loss_fn)
            samples = []
            for _ in range(repeats + 1 if timed else 0):
                samples.append(_time_phases(masters, spec, inputs, run, meter, store))
            meter.reset()
            parts, out = _activation_parts([*masters, *working], inputs, run, _batch_tensors(batch))
            times = [statistics.median(s[k] for s in samples[1:]) if timed else 0.0 for k in range(4)]
            phases.append(BlockPhases(times[0], times[1], times[2], times[3], parts.alone, parts))
            state = {k: v.detach() for k, v in out.items() if k != "logits"}
    for p in masters:
        p.grad = None
    return phases


def _batch_tensors(batch: Seq2SeqBatch) -> dict[str, Tensor]:
    """The micro-batch's tensors a block may save (the source key mask is built once per batch)."""
    named = {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "decoder_input_ids": batch.decoder_input_ids,
        "labels": batch.labels,
        "src_key_mask": batch.src_key_mask,
    }
    return {k: t for k, t in named.items() if t is not None}


def _activation_parts(
    weights: list[Tensor], inputs: State, run, batch: dict[str, Tensor]
) -> tuple[ActivationParts, State]:  # type: ignore[no-untyped-def]
    """One forward of the block (its output returned too), its saved storages classified as
    inputs (by key), micro-batch tensors (by name) or its own.

    Counts as `SavedTensorMeter` does: `weights` (parameters, working copies) excluded, each
    storage once, the inputs that rematerialised regions keep included (reported through
    `parallel.remat`).
    """
    from parallel import remat

    params = {p.untyped_storage().data_ptr() for p in weights}
    by_ptr = {t.untyped_storage().data_ptr(): k for k, t in inputs.items()}
    batch_ptr = {t.untyped_storage().data_ptr(): k for k, t in batch.items()}
    seen: set[int] = set()
    own, saved, batch_saved = 0, set(), {}

    def charge(t: Tensor) -> None:
        nonlocal own
        ptr = t.untyped_storage().data_ptr()
        if ptr in params or ptr in seen:
            return
        seen.add(ptr)
        if ptr in by_ptr:
            saved.add(by_ptr[ptr])
        elif ptr in batch_ptr:
            batch_saved[batch_ptr[ptr]] = t.untyped_storage().nbytes()
        else:
            own += t.untyped_storage().nbytes()

    def pack(t: Tensor) -> Tensor:
        if isinstance(t, Tensor):
            charge(t)
        return t

    token = remat.KEPT_INPUT_OBSERVER.set(charge)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, _ = run()
    finally:
        remat.KEPT_INPUT_OBSERVER.reset(token)
    outputs = {k: v for k, v in out.items() if k != "logits"}
    parts = ActivationParts(
        own,
        tuple((k, t.untyped_storage().nbytes()) for k, t in inputs.items()),
        frozenset(saved),
        tuple((k, t.untyped_storage().nbytes()) for k, t in outputs.items()),
        frozenset(k for k, t in outputs.items() if k in inputs and t.data_ptr() == inputs[k].data_ptr()),
        tuple(sorted(batch_saved.items())),
    )
    return parts, out


def _run_block(
    model: M2M100Translation,
    spec: BlockSpec,
    inputs: State,
    batch: Seq2SeqBatch,
    autocast_dtype: torch.dtype | None,
    loss_fn: LossFn = cross_entropy_sum,
) -> tuple[State, list[Tensor]]:
    """The block's output and the tensors its backward starts from (the head's: its loss)."""
    device = batch.input_ids.device
    cast = (
        torch.autocast(device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with cast:
        out = model.run_block(spec, dict(inputs), batch)
        if spec.kind is BlockKind.HEAD:
            return out, [loss_fn(out["logits"], batch.labels)]
    return out, [t for t in out.values() if t.requires_grad]


def _time_phases(params, spec, inputs, run, meter, store) -> tuple[float, float, float, float]:  # type: ignore[no-untyped-def]
    """(F, B, I, W) seconds of one micro-batch through one block; forwards metered, as in a timed flush."""
    device = params[0].device
    for p in params:  # the masters' (working copies pass their gradients on to them)
        p.grad = None
    meter.reset()
    _sync(device)
    t0 = time.perf_counter()
    with meter.record(spec, inputs):
        _, roots = run()
    _sync(device)
    t1 = time.perf_counter()
    grads = None if spec.kind is BlockKind.HEAD else [torch.randn_like(t) for t in roots]
    t1b = time.perf_counter()
    torch.autograd.backward(roots, grads)
    _sync(device)
    t2 = time.perf_counter()
    with meter.record(spec, inputs):
        _, roots = run()
    _sync(device)
    t3 = time.perf_counter()
    with store.deferring(spec):
        torch.autograd.backward(roots, grads)
    _sync(device)
    t4 = time.perf_counter()
    store.flush(spec)
    _sync(device)
    t5 = time.perf_counter()
    return t1 - t0, t2 - t1b, t4 - t3, t5 - t4


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
