"""`parallelize()`: from the single-device model to this rank's share of the 3D mesh.

    model (all blocks)                      a ModelConfig built on meta (or one real M2M100Translation,
                                            identical on every rank)
      -> pipeline split (pp)                keep_only(the blocks of this rank's stages)
      -> tensor parallel (tp)               swap linears/embedding/head for Megatron-style modules
      -> expert parallel (ep)               keep this rank's experts, split their FFN dim over tp,
                                            all-to-all dispatch (parallel.expert.apply)
      -> rematerialisation                  wrap layers / attention in torch.utils.checkpoint
      -> regional compilation               torch.compile each layer (torch_compile: true)
      -> fully sharded dp (dp_sharding=fsdp) FSDP2 units on the dp axis (parallel.dp.fsdp)
      -> materialise (meta models)          this rank's shard only (under fsdp its dp shard), keyed
                                            init, HF slices or zeros for a checkpoint (parallel.materialize)
      -> zero-bubble weight-grad deferral   (zero_bubble and zbv: schedules with split backward)
      -> executor                           walks this rank's schedule; dp + tied-embedding reduce at GR

The resulting `ParallelModel` is what the training loop drives: `train_step` runs
the step's flushes (the dp, sequence-parallel and tied-embedding reduces happen at
the last GR), then `grads.clip_` over the whole mesh, then the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from models.config import ModelConfig
from models.loss import cross_entropy_sum
from models.m2m100 import M2M100Translation, Seq2SeqBatch
from models.moe import is_expert_param as is_stacked_expert
from parallel.dp.fsdp import FullySharded
from parallel.dp.fsdp import logical as logical_fsdp
from parallel.dp.zero1 import ZeroOneSharding
from parallel.expert.apply import ExpertParallelInfo, apply_expert_parallel, replicated_tokens
from parallel.expert.logical import expert_entries
from parallel.expert.params import is_expert_param
from parallel.grads import StepGradients
from parallel.materialize import is_meta, materialize, stage_fill
from parallel.mesh import ParallelMesh
from parallel.mixed_precision import WorkingWeights, evaluation_precision
from parallel.pipeline.executor import FlushResult, LossFn, PipelineExecutor, PipelineTopology
from parallel.pipeline.memory import meter_for
from parallel.pipeline.plan import PipelinePlan, make_plan
from parallel.pipeline.schedule import (
    Action,
    forward_only,
)
from parallel.pipeline.stage import PipelineStage
from parallel.pipeline.timing import clock_for
from parallel.pipeline.zero_bubble import WeightGradStore, enable_deferred_wgrad
from parallel.remat import apply_remat
from parallel.rng import uses_dropout
from parallel.tp.layers import tp_local_slice

DP_SHARDINGS = ("none", "zero1", "fsdp")
FlushHook = Callable[[Sequence[Seq2SeqBatch], int], None]  # (a flush's micro-batches, step)


def check_dp_sharding(dp_sharding: str) -> None:
    """Raises: ValueError: `dp_sharding` is not one of `DP_SHARDINGS`."""
    if dp_sharding not in DP_SHARDINGS:
        raise ValueError(f"dp_sharding {dp_sharding!r} is not one of {DP_SHARDINGS}")


def shard_over_dp(
    model: M2M100Translation,
    plan: PipelinePlan,
    mesh: ParallelMesh,
    dp_sharding: str,
    param_dtype: torch.dtype | None,
) -> FullySharded | None:
    """FSDP2 units over dp (`parallel.dp.fsdp`) when `dp_sharding` is "fsdp" and dp > 1, else None.

    Applied before the parameters get memory (a meta model: each rank then materialises only its
    dp shard) or to a model with weights (its parameters are cut over dp in place).

    Raises:
        ValueError: an unknown `dp_sharding`, or fsdp with LayerDrop.
    """
    check_dp_sharding(dp_sharding)
    if dp_sharding != "fsdp" or mesh.size("dp") == 1:
        return None
    c = model.config
    if max(c.encoder_layerdrop, c.decoder_layerdrop) > 0:  # every config path ends here
        raise ValueError(
            f"dp_sharding='fsdp' does not support LayerDrop yet (encoder_layerdrop="
            f"{c.encoder_layerdrop}, decoder_layerdrop={c.decoder_layerdrop}): a skipped layer "
            f"leaves its FSDP unit unused; set both to 0 or use dp_sharding 'none' | 'zero1'"
        )
    deferred = plan.p > 1 or plan.split_backward  # see parallel.dp.fsdp
    return FullySharded(model, mesh, param_dtype, deferred=deferred)


class ParallelModel:
    """This rank's stages, their executor, and the step's gradient work (`grads`)."""

    def __init__(
        self,
        model: M2M100Translation,
        plan: PipelinePlan,
        mesh: ParallelMesh,
        loss_fn: LossFn,
        autocast_dtype: torch.dtype | None = None,
        tp_info: Any = None,
        dp_sharding: str = "none",
        remat_stage: bool = False,
        saved_tensor_meter: bool = False,
        fsdp: FullySharded | None = None,
        eval_dtype: torch.dtype | None = None,
        ep_info: ExpertParallelInfo | None = None,
        seed: int = 0,
    ) -> None:
        self.model, self.plan, self.mesh, self.tp_info = model, plan, mesh, tp_info
        self.ep_info, self.seed = ep_info, seed
        # Evaluation's precision (`evaluating`): every weight cast to eval_dtype, or autocast.
        self.eval_dtype, self._evaluating = eval_dtype, False
        self.master_dtype = next(model.parameters()).dtype
        check_dp_sharding(dp_sharding)
        self.fsdp = fsdp  # `shard_over_dp`: applied before the parameters got memory
        pp_rank = mesh.pp_rank
        self.stages = {
            s: PipelineStage(model, plan.stage_blocks[s], s, plan.n_stages, remat_stage=remat_stage)
            for s in plan.placement.stages_of(pp_rank)
        }
        self.topo = PipelineTopology(
            plan.stage_blocks, plan.placement, pp_rank, [mesh.pp_peer(q) for q in range(plan.p)]
        )
        self._params_by_name = dict(model.named_parameters())
        self.device = next(model.parameters()).device
        self.zero: ZeroOneSharding | None = None
        self.zero_experts: ZeroOneSharding | None = None  # ep > 1: the experts' state over edp
        if dp_sharding == "zero1" and mesh.size("dp") > 1:
            named = list(model.named_parameters())
            self.zero = ZeroOneSharding(
                [(n, p) for n, p in named if not is_expert_param(p)], mesh.group("dp")
            )
            experts = [(n, p) for n, p in named if is_expert_param(p)]
            if experts and mesh.size("edp") > 1:
                self.zero_experts = ZeroOneSharding(experts, mesh.group("edp"))
        self.grads = StepGradients(
            model,
            [model.block_parameters(self.stages[s].blocks) for s in sorted(self.stages)],
            mesh,
            plan.shared_embedding_ranks(),
            sequence_parallel=tp_info is not None and tp_info.sequence_parallel,
            overlap_dp=not plan.split_backward,  # deferred W writes grads without hooks
            fsdp=self.fsdp,
        )
        self.wgrad_store = WeightGradStore()
        if plan.split_backward:
            enable_deferred_wgrad(model, self.wgrad_store)
        self.loss_fn, self.autocast_dtype = loss_fn, autocast_dtype
        self.meter = meter_for(model, self.device, saved_tensors=saved_tensor_meter)
        # Mixed precision: low-precision working weights, cast once per step (parallel.mixed_precision).
        # Under FSDP its MixedPrecisionPolicy gathers bf16 working weights instead.
        self.working = WorkingWeights(model, autocast_dtype) if autocast_dtype and not self.fsdp else None
        self.clock = clock_for(self.device)
        self.executor = self._executor(plan.schedule[pp_rank], self.grads)
        self.before_flush: FlushHook | None = None  # `train_with`: a distillation teacher's forward

    def train_with(self, loss_fn: LossFn, before_flush: FlushHook) -> None:
        """Train on `loss_fn` (evaluation keeps `self.loss_fn`), calling `before_flush(micro-batches,
        step)`, collective like a flush, before each training flush (word-level distillation: the
        teacher's forward, whose last-stage states `loss_fn` reads by slot; `parallel.distill`)."""
        self.executor = self._executor(self.plan.schedule[self.mesh.pp_rank], self.grads, loss_fn=loss_fn)
        self.before_flush = before_flush

    def _executor(
        self,
        actions: Sequence[Action],
        grads: StepGradients | None,
        evaluation: bool = False,
        loss_fn: LossFn | None = None,
    ) -> PipelineExecutor:
        cast = evaluation and self.eval_dtype is not None  # weights cast: no autocast
        return PipelineExecutor(
            self.stages,
            actions,
            self.topo,
            loss_fn or self.loss_fn,
            self.meter,
            self.clock,
            grads=grads,
            autocast_dtype=None if cast else self.autocast_dtype,
            wgrad_store=self.wgrad_store,
            boundary_dtype=self.activation_dtype if evaluation else None,
        )

    # ------------------------------------------------------------------ training

    def params(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def optimizer_params(self) -> list[nn.Parameter]:
        """What this rank's optimizer updates: all parameters (FSDP: their dp shards, as
        DTensors), or its ZeRO-1 share (experts cut over ep: its share over edp)."""
        if self.zero is None:
            return self.params()
        experts = [p for p in self.params() if is_expert_param(p)]
        return self.zero.owned() + (self.zero_experts.owned() if self.zero_experts is not None else experts)

    def after_optimizer_step(self) -> None:
        """ZeRO-1: owners broadcast the parameters they updated."""
        for zero in (self.zero, self.zero_experts):
            if zero is not None:
                zero.broadcast_updated()

    def named_params(self) -> dict[str, nn.Parameter]:
        return dict(self.model.named_parameters())

    def train_step(
        self,
        flushes: Sequence[Sequence[Seq2SeqBatch]],
        loss_scale: float | Tensor,
        timed: bool = False,
        skip_layers: frozenset[str] = frozenset(),
        step: int = 0,
        dropout_keys: Sequence[Sequence[int]] | None = None,
    ) -> list[FlushResult]:
        """Forward+backward over `gradient_accumulation_steps` flushes; grads are final after it.

        `loss_scale` multiplies each micro-batch's loss sum before its backward: 1 / tokens, or
        (fp16) S / tokens as a 0-d device tensor. Sparse layers (NLLB-MoE) take it too, for
        their load-balancing loss, with `step` keying their routing randomness
        (`models.moe.MoERun.begin_step`).

        Every micro-batch of the step is copied to the device first (pinned, asynchronous),
        so the copies overlap the compute instead of waiting inside the flush.
        `skip_layers`: the layers LayerDrop skips in this step (`models.m2m100.layerdrop_skips`,
        the same on every rank); their parameters end the step without gradients, as in one
        process, so AdamW leaves them untouched (the dp reduce fills zeros, removed here).
        `dropout_keys` ([flush][micro-batch], `parallel.rng.microbatch_keys`) key each
        micro-batch's dropout masks, so they do not depend on the mesh beyond tp; None (or a
        model without dropout): the global generators.
        """
        if dropout_keys is not None and [len(k) for k in dropout_keys] != [len(f) for f in flushes]:
            raise ValueError(
                f"dropout keys per flush {[len(k) for k in dropout_keys]} do not match the "
                f"micro-batches per flush {[len(f) for f in flushes]}"
            )
        if not uses_dropout(self.model.config):
            dropout_keys = None  # nothing to draw: no block re-seeds
        self.model.skip_layers = skip_layers
        self.model.moe.begin_step(self.seed, step, loss_scale)
        try:
            results = self._run_flushes(flushes, loss_scale, timed, dropout_keys, step)
        finally:
            self.model.skip_layers = frozenset()
        if skip_layers:
            for name, p in self.model.named_parameters():
                if ".".join(name.split(".")[:3]) in skip_layers:  # encoder.layers.<i>.*
                    p.grad = None
        return results

    def _run_flushes(
        self,
        flushes: Sequence[Sequence[Seq2SeqBatch]],
        loss_scale: float | Tensor,
        timed: bool,
        keys: Sequence[Sequence[int]] | None,
        step: int = 0,
    ) -> list[FlushResult]:
        on_device = [self._prepare(microbatches) for microbatches in flushes]
        hook = self.before_flush
        if self.fsdp is not None:
            self.fsdp.begin_step()
        # One micro-batch per step reads each weight once: autocast's cast per use is then the
        # same single cast, and measured faster on an H100 (1.2B, m=1: 0.225 vs 0.241 s/step),
        # so the working copies are made only when several micro-batches share them.
        share = self.working is not None and sum(len(f) for f in flushes) > 1
        working_weights: AbstractContextManager[list[Tensor]] = (
            self.working.swapped() if share and self.working is not None else nullcontext([])
        )
        with working_weights as working:
            self.meter.ignore(working)
            results = []
            for i, mbs in enumerate(on_device):
                if hook is not None:
                    hook(mbs, step)
                results.append(
                    self.executor.run_flush(
                        mbs,
                        loss_scale,
                        last_flush=i == len(on_device) - 1,
                        timed=timed,
                        dropout_keys=None if keys is None else keys[i],
                    )
                )
            return results

    def _prepare(self, batches: Sequence[Seq2SeqBatch]) -> list[Seq2SeqBatch]:
        """To the model's device; sequence parallelism also needs S and T divisible by tp."""
        out = [b.to(self.device, non_blocking=True) for b in batches]
        if self.tp_info is not None and self.tp_info.sequence_parallel:
            out = [b.pad_to_multiple(self.tp_info.tp_size, self.model.config.pad_token_id) for b in out]
        return out

    def to_logical(self, name: str, tensor: Tensor) -> Tensor | dict[str, Tensor]:
        """The tensor (a parameter or its optimizer state) as DCP should see it: single-device
        shape, tp shards wrapped as `DTensor` on the tp sub-mesh (vocab padding cut off); a
        stacked expert tensor as its experts' entries under their transformers names
        (`parallel.expert.logical`)."""
        param = self._params_by_name.get(name)
        info = self.tp_info
        if param is not None and is_stacked_expert(name):
            tp_mesh = self.mesh["tp"] if self.mesh.size("tp") > 1 else None
            return expert_entries(name, tensor, param, tp_mesh, self.mesh.size("tp"))
        # rows [start, end) of the padded vocabulary: keep the real ones
        real = max(0, min(info.vocab_end, info.vocab_size) - info.vocab_start) if info is not None else 0
        if param is not None and self.fsdp is not None:  # a DTensor on the (dp, tp) sub-mesh
            vocab = (real, info.vocab_size) if info is not None and name == "shared.weight" else None
            return logical_fsdp(tensor, param, self.mesh, self.mesh.size("tp"), vocab)
        if param is None or info is None or not getattr(param, "tp_sharded", False):
            return tensor
        from torch.distributed.tensor import DTensor, Shard

        part = tp_local_slice(param, self.tp_info.tp_size, self.tp_info.tp_rank)
        assert part.dim is not None
        dim, logical = part.dim, part.full_shape
        local = tensor.narrow(dim, 0, part.length)  # the vocab padding cut off
        stride = torch.empty(logical, device="meta").stride()
        return DTensor.from_local(
            local, self.mesh["tp"], [Shard(dim)], run_check=False, shape=torch.Size(logical), stride=stride
        )

    # ------------------------------------------------------------------ evaluation

    @property
    def activation_dtype(self) -> torch.dtype:
        """dtype of the hidden states evaluation passes between stages: eval_dtype when the
        weights are cast, else the masters' (autocast keeps the residual stream fp32)."""
        return self.eval_dtype or self.master_dtype

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """Within: the weights as evaluation reads them, in the run's precision: fsdp units
        gathered (a dp collective), then `parallel.mixed_precision.evaluation_precision`.
        Re-entrant (a nested entry does nothing): one evaluation gathers and casts once."""
        if self._evaluating:
            yield
            return
        self._evaluating = True
        gathered = self.fsdp.gathered() if self.fsdp is not None else nullcontext()
        precision = evaluation_precision(self.model, self.device.type, self.autocast_dtype, self.eval_dtype)
        try:
            with gathered, precision:
                yield
        finally:
            self._evaluating = False

    @torch.no_grad()
    def eval_loss(self, batches: Sequence[Seq2SeqBatch]) -> tuple[float, int]:
        """Sum of token losses and token count over `batches` (meaningful on the last stage):
        `forward_flush` of the same batches on every rank. Collective over the mesh."""
        if not batches:
            return 0.0, 0
        res = self.forward_flush(batches)
        return (0.0 if res.loss_sum is None else float(res.loss_sum)), res.num_tokens

    @torch.no_grad()
    def forward_flush(self, batches: Sequence[Seq2SeqBatch], replicated: bool = True) -> FlushResult:
        """One forward-only flush (`parallel.pipeline.schedule.forward_only`: any number of batches,
        any placement) in evaluation's precision (`evaluating`); collective over the mesh.
        `replicated`: every rank holds the same batches (evaluation), so sparse layers spread over
        ep take their tokens as replicated (`parallel.expert.apply.replicated_tokens`: no
        all-to-all); False: each replica its own (a distillation teacher's), all-to-all as trained."""
        batches = self._prepare(batches)
        actions = forward_only(self.plan.placement, len(batches))[self.mesh.pp_rank]
        tokens = replicated_tokens(self.model) if replicated else nullcontext()
        with self.evaluating(), tokens:
            executor = self._executor(actions, grads=None, evaluation=True)
            return executor.run_flush(batches, 1.0, last_flush=False, timed=False)


def default_loss_fn(label_smoothing: float) -> LossFn:
    def loss_fn(logits: Tensor, batch: Seq2SeqBatch) -> Tensor:
        return cross_entropy_sum(logits, batch.labels, label_smoothing)

    return loss_fn


def build_parallel_model(
    model: M2M100Translation | ModelConfig,
    mesh: ParallelMesh,
    balance: Sequence[int],
    m: int,
    schedule: str,
    v: int,
    remat: str,
    label_smoothing: float,
    autocast_dtype: torch.dtype | None = None,
    sequence_parallel: bool = False,
    before_tp: Callable[[M2M100Translation], None] | None = None,
    dp_sharding: str = "none",
    saved_tensor_meter: bool = False,
    compile_layers: bool = False,
    device: torch.device | None = None,
    seed: int | None = None,
    pretrained: str | Path | None = None,
    eval_dtype: torch.dtype | None = None,
    from_checkpoint: bool = False,
) -> ParallelModel:
    """Apply pipeline split, tensor parallelism and remat to `model` (in place) for this rank.

    Two ways in:

    * stage-local (no rank holds the whole model): `model` is a `ModelConfig` (or a model
      built under `torch.device("meta")`) and one of `seed` / `pretrained` /
      `from_checkpoint` is given. The model is cut, tp-sharded and (fsdp) dp-sharded on
      meta, then only this rank's blocks and shards get memory on `device`
      (`parallel.materialize`): drawn from the keyed init of `seed` (equal to
      `M2M100Translation(config, seed=seed)`'s slices on any mesh), read slice by slice
      from the HF directory `pretrained`, or zeroed for a checkpoint the caller loads next.
    * from a real model: `model` is the full single-device model, identical on every rank
      (same seed or same checkpoint); `before_tp` may load weights into the pruned stage.

    Args:
        model: a `ModelConfig`, a meta-built model, or the full single-device model.
        mesh: the (pp, dp, tp) mesh.
        balance: block counts per stage (p * v stages).
        m: micro-batches per flush; schedule: schedule name; v: stages per rank.
        remat: activation_checkpointing policy.
        label_smoothing: epsilon of the loss.
        dp_sharding: "none", "zero1" (optimizer state sharded over dp) or "fsdp" (parameters,
            gradients and optimizer state sharded over dp: `parallel.dp.fsdp`; nothing to shard,
            and no FSDP, when dp is 1).
        saved_tensor_meter: measure activation memory with saved-tensor hooks even on
            CUDA (a profiling switch; CPUs always use them).
        compile_layers: `torch.compile` each encoder/decoder layer (`parallel.compile`).
        device: where this rank's shard goes (or is materialised) after the split and tp
            sharding, so the device never holds more than the shard; None: the model stays
            where it is (a meta model is materialised on the CPU).
        seed: stage-local only: the init seed.
        pretrained: stage-local only: an HF directory to read the weights from instead.
        autocast_dtype: the working dtype of bf16 / fp16 runs (autocast, working weights;
            evaluation autocasts to it too); None: fp32.
        eval_dtype: evaluation with every weight cast to it (`bf16_full_eval`); None: autocast.
        from_checkpoint: stage-local only: neither draw nor read the weights (resume: the
            caller loads a checkpoint into every parameter right after).

    Raises:
        ValueError: `seed` / `pretrained` / `from_checkpoint` with a real model, not exactly
            one of them (or `before_tp`) with a meta one, or a balance / schedule that does not fit.
    """
    if isinstance(model, ModelConfig):
        with torch.device("meta"):
            model = M2M100Translation(model)
    meta = is_meta(model)
    fill = stage_fill(model, seed, pretrained, from_checkpoint, before_tp is not None)
    p = mesh.size("pp")
    plan = make_plan(model.blocks, balance, p, v, m, schedule)
    model.keep_only(plan.rank_blocks(mesh.pp_rank))
    if before_tp is not None:
        before_tp(model)
    loss_fn = default_loss_fn(label_smoothing)
    tp_info = None
    if mesh.size("tp") > 1:
        from parallel.tp.apply import apply_tensor_parallel

        tp_info = apply_tensor_parallel(model, mesh.group("tp"), sequence_parallel=sequence_parallel)

        def loss_fn(logits: Tensor, batch: Seq2SeqBatch) -> Tensor:
            return tp_info.loss(logits, batch.labels, label_smoothing)

    ep_group = mesh.group("ep") if mesh.size("ep") > 1 else None
    ep_info = apply_expert_parallel(model, ep_group, mesh.group("tp") if mesh.size("tp") > 1 else None)
    if not meta and device is not None:
        model.to(device)
    apply_remat(model, remat)
    if compile_layers:
        from parallel.compile import apply_compile

        apply_compile(model)
    fsdp = shard_over_dp(model, plan, mesh, dp_sharding, autocast_dtype)
    if meta:
        tp_size, tp_rank = (tp_info.tp_size, tp_info.tp_rank) if tp_info is not None else (1, 0)
        materialize(model, device or torch.device("cpu"), fill, tp_size, tp_rank)
    return ParallelModel(
        model,
        plan,
        mesh,
        loss_fn,
        autocast_dtype=autocast_dtype,
        tp_info=tp_info,
        dp_sharding=dp_sharding,
        remat_stage=remat == "stage",
        saved_tensor_meter=saved_tensor_meter,
        eval_dtype=eval_dtype,
        fsdp=fsdp,
        ep_info=ep_info,
        seed=seed if seed is not None else torch.initial_seed(),
    )
