"""The planner's memory model: the bytes one rank holds at its peak in training and at start-up.

With P the rank's parameters (its pp stages on its tp shard), dp the data-parallel size and
`data_parallel_sharding` s (`trainer.config.checks.SHARDING_CHOICES`):

    parameters       4 P                     fp32 master weights; fsdp: 4 P / dp
    gradients        4 P                     fp32, freed after the step; fsdp: 4 P / dp (the shard)
    optimizer        8 P                     AdamW's two moments; zero1 and fsdp: 8 P / dp
    working_weights  2 P                     bf16 copies cast once per step (bf16, m g > 1, not fsdp)
    fsdp_gathered    fsdp only               unsharded (working-dtype) parameters and fp32 grads
                                             (`parallel.dp.fsdp`): lean (pp = 1, full backward): the
                                             root unit (tied table, norms: gathered from its
                                             forward to its backward) and two layer units (the one
                                             computing, the one prefetched / reduce-scattering);
                                             deferred (pp > 1 or a split backward): the whole
                                             stage, gathered once per flush, its grads kept
                                             unsharded until the reduce-scatter at GR
    activations      the simulated peak of the executor's meter on this rank
    step_transients  what the end of the step adds over the activations (they are freed by then):
                     dp gradient buckets: `GradReducer` keeps at most `MAX_BUCKETS_IN_FLIGHT` (2)
                         buckets' flat copies alive (dp > 1, s != fsdp): 2 x max(25 MiB, the
                         largest parameter), at most 4 P
                     ZeRO-1 broadcast: `ZeroOneSharding.broadcast_updated` sends the updated
                         parameters in buckets, at most 2 in flight: the same bound (s = zero1)
                     (AdamW is fused on CPU and CUDA, `trainer.run.step.build_optimizer`: no
                     temporaries; foreach's sqrt(v) copies, 4 P on CPU, are gone)
    baseline         host runs only: the interpreter, torch, the data and tokenizer (`HOST_BASELINE_BYTES`)

These are live bytes. A host CPU's glibc keeps freed chunks below its mmap threshold (which
rises to 32 MiB after the first large free) resident in the heap, so a run's peak RSS can exceed
them where such chunks churn: measured on scripts/bench_memory.py's 50M model, dp=4 zero1 1088 MiB
(1049 with MALLOC_MMAP_THRESHOLD_=1 MiB, predicted 1010: the dp buckets stay resident under the
broadcast) and dp=4 fsdp 1278 MiB (779 with the threshold fixed, predicted 789: the per-layer
gathers). The bench reports both allocators (benchmarks/memory_cpu_small.md).

Experts (NLLB-MoE under expert parallelism ep): of P, the X expert parameters (E / ep experts of
each sparse layer on the rank) are sharded by ZeRO-1 and FSDP over edp = dp / ep instead of dp.

Start-up (stage-local construction, `parallel.parallelize.build_parallel_model`): a rank builds
on meta and materialises only its pp / tp shard, one parameter at a time: baseline + 4 P + the
largest single parameter. Under fsdp the meta model is dp-sharded first, so only the dp shard
gets memory: baseline + 4 ((P - X) / dp + X / edp) + the largest parameter (its tp part, read or
drawn whole before its dp chunk is kept).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.config import ModelConfig
from models.m2m100 import BlockKind, block_specs
from parallel.dp.reduce import DEFAULT_BUCKET_BYTES, MAX_BUCKETS_IN_FLIGHT

# Peak RSS of a one-process trainer.train run of a d_model 64 model on the built-in corpus
# (bench_memory's data: 3000 examples, SentencePiece trained on them), measured on this
# 2-core x86-64 host with torch 2.13 CPU: `import torch, transformers` alone is 245 MiB, the
# trainer's imports 308 MiB; data, tokenizer and gloo bring the run to this.
HOST_BASELINE_BYTES = 500 * 2**20
# Of which the first step loads (autograd's engine, the optimizer's kernels): that run's start-up
# peak was 478 MiB, its training peak 502 MiB
FIRST_STEP_LOAD_BYTES = 24 * 2**20


@dataclass(frozen=True)
class RankShape:
    """What the memory model needs of one pp rank: its parameters and their largest pieces."""

    params: int  # on this rank (its stages, its tp shard)
    largest_param: int  # the largest single tensor (start-up holds one extra)
    largest_layer: int  # the largest encoder / decoder layer (an fsdp unit)
    root: int  # what its layers leave (the tied table, embeddings' and final norms): fsdp's root unit
    experts: int = 0  # of `params`, the experts' (E / ep per sparse layer): sharded over edp


def rank_shape(mc: ModelConfig, blocks: list[int], params_block: list[int], table: int,
               uses_table: bool, tp: int, experts_block: list[int] | None = None,
               ep: int = 1) -> RankShape:  # fmt: skip
    """The `RankShape` of a pp rank holding `blocks` (and the tied table if `uses_table`) on one
    (tp, ep) rank; `experts_block`: the expert parameters of each block (`block_expert_counts`)."""
    specs = block_specs(mc)
    kinds = {specs[i].kind for i in blocks}
    d = mc.d_model
    largest = 0
    if BlockKind.ENC_LAYER in kinds:
        largest = max(largest, d * mc.encoder_ffn_dim // tp, d * d // tp)
    if BlockKind.DEC_LAYER in kinds:
        largest = max(largest, d * mc.decoder_ffn_dim // tp, d * d // tp)
    if uses_table:
        largest = max(largest, table)
    experts = sum(experts_block[i] for i in blocks) if experts_block else 0
    if experts:  # the stacked expert weight (E / ep, F / tp, H)
        largest = max(largest, (mc.num_experts // ep) * d * max(mc.encoder_ffn_dim, mc.decoder_ffn_dim) // tp)
    layers = [params_block[i] for i in blocks if specs[i].kind in (BlockKind.ENC_LAYER, BlockKind.DEC_LAYER)]
    params = sum(params_block[i] for i in blocks) + (table if uses_table else 0)
    return RankShape(params, largest, max(layers, default=0), params - sum(layers), experts)


@dataclass(frozen=True)
class MemorySettings:
    """The memory model's knobs besides the layout (from the planner's options and device)."""

    bf16: bool
    host_baseline_bytes: float = 0.0  # the process's own bytes: runs on this host's CPU only
    host_cpu: bool = False  # costed for this host's CPU: the start-up baseline


def rank_memory(
    rank: RankShape, activations: float, sharding: str, dp: int, steps_in_flush: int, deferred: bool,
    settings: MemorySettings, ep: int = 1,
) -> tuple[dict[str, float], dict[str, float]]:  # fmt: skip
    """(the peak's terms, which sum to it; the step transients by cause) of one rank (module docstring).

    steps_in_flush: m x g, micro-batches per optimizer step (bf16 working copies pay off above 1).
    deferred: fsdp gathers the stage once per flush (pp > 1 or a split backward), else per layer.
    ep: expert-parallel size (the experts' states shard over dp / ep).
    """
    p = float(rank.params)
    fsdp = sharding == "fsdp" and dp > 1
    edp = dp // ep
    x = float(rank.experts)
    # the divisors of the parameters' bytes (dense part over dp, experts over edp), as one effective factor
    shard = p / ((p - x) / (dp if fsdp else 1) + x / (edp if fsdp else 1)) if p else 1.0
    sharded = sharding in ("zero1", "fsdp")
    moments = p / ((p - x) / (dp if sharded else 1) + x / (edp if sharded else 1)) if p else 1.0
    e = 2.0 if settings.bf16 else 4.0
    gathered_params = gathered_grads = 0.0
    if fsdp:
        unsharded = p if deferred else min(p, rank.root + 2.0 * rank.largest_layer)
        gathered_params, gathered_grads = e * unsharded, 4.0 * unsharded
    in_flight = min(4.0 * p, MAX_BUCKETS_IN_FLIGHT * max(DEFAULT_BUCKET_BYTES, 4.0 * rank.largest_param))
    buckets = in_flight if dp > 1 and not fsdp else 0.0
    broadcast = in_flight if dp > 1 and sharding == "zero1" else 0.0
    transients = {
        "grad_buckets": buckets,
        "zero1_broadcast": broadcast,
    }
    during_backward = activations + gathered_grads
    terms = {
        "parameters": 4.0 * p / shard,
        "gradients": 4.0 * p / shard,
        "optimizer": 8.0 * p / moments,
        "working_weights": 2.0 * p if settings.bf16 and steps_in_flush > 1 and not fsdp else 0.0,
        "fsdp_gathered": gathered_params + gathered_grads,
        "activations": activations,
        "step_transients": max(0.0, max(transients.values()) - during_backward),
        "baseline": settings.host_baseline_bytes,
    }
    return terms, transients


def startup_memory(
    rank: RankShape, settings: MemorySettings, sharding: str = "none", dp: int = 1, ep: int = 1
) -> float:
    """Bytes one rank peaks at while its model is built: baseline + its fp32 shard (fsdp: its dp
    shard, the experts' over edp = dp / ep) + one parameter."""
    baseline = settings.host_baseline_bytes
    if settings.host_cpu:
        baseline = max(0.0, baseline - FIRST_STEP_LOAD_BYTES)
    held = float(rank.params)
    if sharding == "fsdp" and dp > 1:
        held = (rank.params - rank.experts) / dp + rank.experts / (dp // ep)
    return baseline + 4.0 * (held + rank.largest_param)
