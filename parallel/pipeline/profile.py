"""Measure each block's cost on a sample micro-batch: for `partition_method: time | memory`
(`profile_blocks`) and for the planner (`profile_block_phases`: forward, backward, the
zero-bubble I / W split and the activation bytes the executor's meter counts, per block).

`profile_blocks_by_kind` measures one block of each kind on a one-layer model and gives
every block of the real model its kind's costs, so balancing never builds the whole model.

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
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from models.config import ModelConfig
from models.loss import cross_entropy_sum
from models.m2m100 import BlockKind, BlockSpec, M2M100Translation, Seq2SeqBatch, State, block_specs


def _saved_bytes(fn) -> tuple[object, int]:  # type: ignore[no-untyped-def]
    seen: set[int] = set()
    total = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if not isinstance(t, torch.nn.Parameter) and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


def profile_blocks(
    model: M2M100Translation, batch: Seq2SeqBatch, repeats: int = 3
) -> tuple[list[float], list[float], list[int]]:
    """(seconds fwd+bwd, bytes params+activations, parameter count) per block of `model.blocks`."""
    times, mems, counts = [], [], []
    state: State = {}
    for spec in model.blocks:
        inputs = {k: v.detach().requires_grad_(True) for k, v in state.items()}
        params = _block_params(model, spec)
        samples = []
        out: State = {}
        act = 0
        for i in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            out, act = _saved_bytes(functools.partial(model.run_block, spec, dict(inputs), batch))  # type: ignore[assignment]
            if spec.kind is BlockKind.HEAD:
                loss = cross_entropy_sum(out["logits"], batch.labels)
                loss.backward()
            else:
                tensors = [t for t in out.values() if t.requires_grad]
                torch.autograd.backward(tensors, [torch.randn_like(t) for t in tensors])
            if i > 0:
                samples.append(time.perf_counter() - t0)
        times.append(statistics.median(samples))
        pbytes = sum(p.numel() * p.element_size() for p in params)
        mems.append(float(pbytes + act))
        counts.append(sum(p.numel() for p in params))
        state = {k: v.detach() for k, v in out.items() if k != "logits"}
    model.zero_grad(set_to_none=True)
    return times, mems, counts


def profile_blocks_by_kind(
    config: ModelConfig,
    batch: Seq2SeqBatch,
    device: torch.device,
    seed: int = 0,
    repeats: int = 3,
    ep: int = 1,
) -> tuple[list[float], list[float], list[int]]:
    """`profile_blocks`'s (seconds, bytes, parameter count) for every block of `config`'s model,
    measured on a model with one block of each kind (one encoder and one decoder layer), never
    the whole model: the layers of a stack are alike, so each gets its kind's cost. An NLLB-MoE's
    sparse layers are a kind of their own (measured on a one-layer copy whose layers are sparse),
    and a rank holds E / ep of their experts: their parameter count and bytes are this rank's.

    Args:
        config: the model to partition.
        batch: one sample micro-batch on `device`.
        device: where to build the one-layer model and run it.
        seed: its init seed (the values do not change the costs).
        repeats: timed repetitions per block after a warm-up.
        ep: expert-parallel size.
    """
    costs: dict[tuple[BlockKind, bool], tuple[float, float, int]] = {}
    for sparse in (False, True) if config.sparse_layers() else (False,):
        step = 1 if sparse else 0
        one = replace(
            config, encoder_layers=1, decoder_layers=1, encoder_sparse_step=step, decoder_sparse_step=step
        )
        with torch.device(device):
            small = M2M100Translation(one, seed=seed)
        experts = expert_params_per_block(small)
        for spec, t, m, c, x in zip(small.blocks, *profile_blocks(small, batch, repeats), experts):
            cut = x - x // ep  # the experts other ranks hold
            costs.setdefault((spec.kind, x > 0), (t, m - 4.0 * cut, c - cut))
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

    own: bytes saved for backward that are not the block's inputs.
    inputs: bytes of each input state key; saved_inputs: the input keys it saves.
    outputs: bytes of each output key; passthrough: output keys that are the input tensor itself.
    """

    own: int
    inputs: tuple[tuple[str, int], ...]
    saved_inputs: frozenset[str]
    outputs: tuple[tuple[str, int], ...]
    passthrough: frozenset[str]

    @property
    def alone(self) -> int:
        """What the meter charges the block run as a stage of its own: its inputs and own bytes."""
        return sum(n for _, n in self.inputs) + self.own

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
) -> list[BlockPhases]:
    """Per block of `model.blocks`: forward, backward and the I / W split, medians of `repeats`.

    Every block runs alone on the state the blocks before it produce (inputs detached),
    as `profile_blocks` does. `model` is changed in place: its linears are routed through
    the zero-bubble store (exactly `F.linear` outside a deferral), so pass a copy; apply the
    remat policy to it first to measure the policy's recompute and kept bytes.

    Args:
        model: the single-device model (any remat policy applied).
        batch: one micro-batch on the model's device.
        repeats: timed repetitions after one warm-up.
        autocast_dtype: run forwards under autocast (bf16 runs), as the executor does.
        timed: False measures only the activation bytes (one forward per block, times 0).

    Returns:
        One `BlockPhases` per block, in block order.
    """
    from parallel.pipeline.memory import SavedTensorMeter
    from parallel.pipeline.zero_bubble import WeightGradStore, enable_deferred_wgrad

    store = WeightGradStore()
    enable_deferred_wgrad(model, store)
    meter = SavedTensorMeter(model)
    phases: list[BlockPhases] = []
    state: State = {}
    for spec in model.blocks:
        inputs = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in state.items()}
        run = functools.partial(_run_block, model, spec, inputs, batch, autocast_dtype)
        samples = []
        for _ in range(repeats + 1 if timed else 0):
            samples.append(_time_phases(model, spec, inputs, run, meter, store))
        meter.reset()
        parts, out = _activation_parts(model, inputs, run)
        times = [statistics.median(s[k] for s in samples[1:]) if timed else 0.0 for k in range(4)]
        phases.append(BlockPhases(times[0], times[1], times[2], times[3], parts.alone, parts))
        state = {k: v.detach() for k, v in out.items() if k != "logits"}
    model.zero_grad(set_to_none=True)
    return phases


def _activation_parts(model: M2M100Translation, inputs: State, run) -> tuple[ActivationParts, State]:  # type: ignore[no-untyped-def]
    """One forward of the block (its output returned too), its saved storages classified as
    inputs (by key) or its own.

    Counts as `SavedTensorMeter` does: parameters excluded, each storage once, the inputs
    that rematerialised regions keep included (reported through `parallel.remat`).
    """
    from parallel import remat

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    by_ptr = {t.untyped_storage().data_ptr(): k for k, t in inputs.items()}
    seen: set[int] = set()
    own, saved = 0, set()

    def charge(t: Tensor) -> None:
        nonlocal own
        ptr = t.untyped_storage().data_ptr()
        if ptr in params or ptr in seen:
            return
        seen.add(ptr)
        if ptr in by_ptr:
            saved.add(by_ptr[ptr])
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
    )
    return parts, out


def _run_block(
    model: M2M100Translation,
    spec: BlockSpec,
    inputs: State,
    batch: Seq2SeqBatch,
    autocast_dtype: torch.dtype | None,
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
            return out, [cross_entropy_sum(out["logits"], batch.labels)]
    return out, [t for t in out.values() if t.requires_grad]


def _time_phases(model, spec, inputs, run, meter, store) -> tuple[float, float, float, float]:  # type: ignore[no-untyped-def]
    """(F, B, I, W) seconds of one micro-batch through one block; forwards metered, as in a timed flush."""
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
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
