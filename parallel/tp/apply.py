"""Applying tensor parallelism (tp) to the single-device model from outside, and the
per-step work it leaves to the trainer.

Owns `apply_tensor_parallel`, which swaps the layers of `parallel.tp.layers` in by
name (parameter names unchanged) and returns a `TensorParallelInfo`;
`enable_sequence_parallel`, its hooks and `sequence_parallel_suspended`; and
`gather_full_state_dict`. What a
step does with the gradients of a tp model (the sequence-parallel sum, the norm
over tp) lives with the rest of a step's gradient work in `parallel.grads`.

Legend: p = tp size, r = tp rank, B batch, T sequence, H d_model, V real
vocabulary, V' = V padded to a multiple of p.

Conventions the trainer relies on (besides the `tp_sharded` marks and the vocab
padding of `parallel.tp.layers`):

* with sequence parallelism, replicated parameters used on sequence-split
  activations (in-layer norms, row-parallel biases) carry `sequence_parallel=True`
  and get partial gradients: `parallel.grads.sync_sequence_parallel_grads` sums them
  after the backward passes of a step (Megatron's `allreduce_sequence_parallel_grads`);
* the grad norm (`parallel.grads.grad_sq_over_tp`) sums sharded parameters over tp and
  counts replicated ones once.

RNG / dropout: `apply_tensor_parallel` points the dropout sites whose activations it
splits (attention probabilities of the local heads, the FFN hidden of the local columns,
and with sequence parallelism the residual branches) at a per-tp-rank stream
(`parallel.tp.rng`); replicated activations keep the stream every tp rank shares, so every
tp rank must be seeded identically (same `torch.manual_seed`, or the keyed block streams
of `parallel.rng`). With dropout off, parity with the single-device model is exact up to
float summation order.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from models.config import ModelConfig
from models.m2m100 import Attention, DecoderLayer, EncoderLayer, LMHead, M2M100Translation
from models.moe import SparseFFN
from parallel.mesh import ParallelMesh, check_tp_divides_model
from parallel.tp.comm import (
    SEQ_DIM,
    _all_gather,
    _rank,
    _size,
    gather_from_sequence_parallel,
    gather_sequence_parallel_to_replicated,
    scatter_to_sequence_parallel,
)
from parallel.tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    _mark,
    is_tp_sharded,
    vocab_partition,
)
from parallel.tp.loss import gather_logits, vocab_parallel_cross_entropy
from parallel.tp.rng import install_tensor_parallel_rng

# ----------------------------------------------------------------------------- applying tp


@dataclass
class TensorParallelInfo:
    """What the trainer needs after `apply_tensor_parallel`.

    Attributes:
        group: the tp process group.
        tp_size, tp_rank: size of and position in it.
        vocab_size: real vocabulary V.
        padded_vocab_size: V' (multiple of tp).
        vocab_start, vocab_end: this rank's slice [start, end) of the padded vocabulary.
        sequence_parallel: whether sequence parallelism is on.
    """

    group: ProcessGroup
    tp_size: int
    tp_rank: int
    vocab_size: int
    padded_vocab_size: int
    vocab_start: int
    vocab_end: int
    sequence_parallel: bool = False

    def loss(self, local_logits: Tensor, labels: Tensor, label_smoothing: float = 0.0) -> Tensor:
        """`vocab_parallel_cross_entropy` with this rank's vocab slice: the loss sum."""
        return vocab_parallel_cross_entropy(
            local_logits, labels, self.group, self.vocab_start, self.vocab_size, label_smoothing
        )

    def gather_logits(self, local_logits: Tensor) -> Tensor:
        """Full (B, T, V) logits, padding dropped."""
        return gather_logits(local_logits, self.group, self.vocab_size)


def _resolve_group(tp: ProcessGroup | ParallelMesh | DeviceMesh) -> ProcessGroup:
    if isinstance(tp, ParallelMesh):
        return tp.group("tp")
    if isinstance(tp, DeviceMesh):
        return tp.get_group("tp") if tp.mesh_dim_names and "tp" in tp.mesh_dim_names else tp.get_group()
    return tp


def _swap_linear(owner: nn.Module, name: str, parallel: Any, group: ProcessGroup, **kwargs: Any) -> None:
    # Only plain nn.Linear is swapped, so applying tp twice never re-slices a shard.
    linear = getattr(owner, name)
    if isinstance(linear, nn.Linear):
        setattr(owner, name, parallel(linear, group, **kwargs))


def _parallelize_attention(attn: Attention, group: ProcessGroup, sp: bool) -> None:
    # Heads are contiguous row groups of the fused projections (q_h k_h v_h per head), so
    # a column split hands rank r heads [r h/p, (r+1) h/p) with their q, k and v;
    # out_proj's matching input columns are a row split. Each attention input feeds one
    # projection (x -> qkv, or x -> q and encoder output -> kv), so each gets its own f.
    # Under sequence parallelism the attention input is all-gathered along T once, by a
    # pre-hook (`enable_sequence_parallel`), because `Attention.forward` reads T from
    # its input; qkv (or cross q) then take it as is. Cross-attention kv reads the
    # replicated encoder output: plain f there.
    if attn.cross:
        _swap_linear(attn, "q_proj", ColumnParallelLinear, group, communicate_input=not sp)
        _swap_linear(attn, "kv_proj", ColumnParallelLinear, group)
    else:
        _swap_linear(attn, "qkv_proj", ColumnParallelLinear, group, communicate_input=not sp)
    _swap_linear(attn, "out_proj", RowParallelLinear, group, sequence_parallel=sp)


def _parallelize_ffn(layer: EncoderLayer | DecoderLayer, group: ProcessGroup, sp: bool) -> None:
    # FFN: Y = act(X W_1) W_2 with W_1 column-split and W_2 row-split (one all-reduce).
    # A sparse layer's experts are split by parallel.expert.apply (each expert's F), its router
    # stays replicated.
    if layer.is_sparse:
        return
    _swap_linear(layer, "fc1", ColumnParallelLinear, group, sequence_parallel=sp)
    _swap_linear(layer, "fc2", RowParallelLinear, group, sequence_parallel=sp)


def apply_tensor_parallel(
    model: M2M100Translation,
    tp: ProcessGroup | ParallelMesh | DeviceMesh,
    sequence_parallel: bool = False,
) -> TensorParallelInfo:
    """Shard a (possibly pipeline-pruned) model in place, Megatron-style.

    In every attention q/k/v become column-parallel and out_proj row-parallel; in
    every layer fc1 column-, fc2 row-parallel; `shared` becomes a
    VocabParallelEmbedding and `lm_head` a VocabParallelLMHead, which returns
    (B, T, V/p) logit shards (use `info.loss`). Parameter names are unchanged.
    Dropout on the activations it splits draws per tp rank (`parallel.tp.rng`).
    Every rank of the tp group must hold the same single-device weights (seed
    identically) and call this; it makes no collective itself.

    Args:
        model: the model, after `keep_only` for a pipeline stage if any.
        tp: the tp process group, or a ParallelMesh / DeviceMesh with a "tp" axis.
        sequence_parallel: split layer norms and dropout along T between layers
            (see `enable_sequence_parallel`).

    Returns:
        TensorParallelInfo (padded vocab, this rank's vocab slice, the group).

    Raises:
        ValueError: if tp does not divide heads, FFN widths or d_model.
    """
    group = _resolve_group(tp)
    p, r = _size(group), _rank(group)
    config: ModelConfig = model.config
    check_tp_divides_model(config, p)
    padded, start, end = vocab_partition(config.vocab_size, p, r)
    for module in list(model.modules()):
        if isinstance(module, EncoderLayer | DecoderLayer):
            _parallelize_attention(module.self_attn, group, sequence_parallel)
            if isinstance(module, DecoderLayer):
                _parallelize_attention(module.encoder_attn, group, sequence_parallel)
            _parallelize_ffn(module, group, sequence_parallel)
    if isinstance(model.shared, nn.Embedding):
        model.shared = VocabParallelEmbedding(model.shared, group)
    if isinstance(model.lm_head, LMHead):
        # The final norm's output is replicated (sequence parallelism ends with the last
        # layer, see `enable_sequence_parallel`), so the head takes plain f.
        model.lm_head = VocabParallelLMHead(group, config.vocab_size, start)
    for param in model.parameters():
        if not hasattr(param, "tp_sharded"):
            _mark(param, False)
    if sequence_parallel:
        enable_sequence_parallel(model, group)
    install_tensor_parallel_rng(model, r, sequence_parallel)
    return TensorParallelInfo(group, p, r, config.vocab_size, padded, start, end, sequence_parallel)


# ----------------------------------------------------------------------------- sequence parallelism


def enable_sequence_parallel(model: M2M100Translation, group: ProcessGroup) -> None:
    """Keep the residual stream split along T inside each run of consecutive layers.

    Hooks (no renamed parameters) on the layers of every encoder/decoder stack:
    the first layer of a run of consecutive indices splits its input `x` along T
    (`scatter_to_sequence_parallel`), the last all-gathers its output
    (`gather_sequence_parallel_to_replicated`). In between, layer norms, residual
    adds and dropout work on (B, T/p, H); column-parallel layers all-gather T
    before their matmul and row-parallel layers reduce-scatter T after it.
    Everything outside the layers (embeddings, final norms, the head, the encoder
    output fed to cross-attention) stays replicated, as without sequence parallelism.

    Called by `apply_tensor_parallel(sequence_parallel=True)` after the linear layers
    were made sequence-parallel. Marks in-layer layer-norm parameters and
    row-parallel biases `sequence_parallel=True`: their gradients are partial sums
    over the sequence slices; `parallel.grads.sync_sequence_parallel_grads` completes them.

    A sparse layer's FFN (`models.moe.SparseFFN`) sees the whole routing group: its input is
    all-gathered along T (backward: the rank's slice of the replicated gradient) and its
    output split back (backward: all-gather), so the router, the capacity and the aux loss see
    the unsplit micro-batch and the experts compute as without sequence parallelism. (Padding
    the batch to a multiple of tp adds token slots, which enlarges a capacity computed from
    B * T; dropless routing is unaffected.)

    Requires T (and S) divisible by tp: pad batches to a multiple of tp.
    """
    for stack in (model.encoder, model.decoder):
        keys = sorted(int(k) for k in stack.layers.keys())
        for i in keys:
            layer = stack.layers[str(i)]
            for sub in layer.modules():
                if isinstance(sub, nn.LayerNorm):
                    for param in sub.parameters():
                        param.sequence_parallel = True  # type: ignore[attr-defined]
                if isinstance(sub, Attention):
                    sub.register_forward_pre_hook(_make_attention_gather_hook(group))
                if isinstance(sub, SparseFFN):
                    sub.register_forward_pre_hook(_make_replicated_gather_hook(group))
                    sub.register_forward_hook(_make_split_hook(group))
            if i - 1 not in keys:
                layer.register_forward_pre_hook(_make_scatter_hook(group))
            if i + 1 not in keys:
                layer.register_forward_hook(_make_gather_hook(group))


# Set on layers and attentions by `sequence_parallel_suspended`: their hooks then pass inputs through.
_SUSPENDED = "_sequence_parallel_suspended"


def _make_scatter_hook(group: ProcessGroup) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if getattr(module, _SUSPENDED, False):
            return args
        x = args[0]
        p = _size(group)
        if x.shape[SEQ_DIM] % p != 0:
            raise ValueError(
                f"sequence_parallel needs the sequence length ({x.shape[SEQ_DIM]}) divisible by tp({p}); "
                f"pad batches to a multiple of {p}"
            )
        return (scatter_to_sequence_parallel(x, group), *args[1:])

    return hook


def _make_attention_gather_hook(group: ProcessGroup) -> Any:
    # (B, T/p, H) -> (B, T, H) for q (and self-attention k, v); backward reduce-scatters.
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if getattr(module, _SUSPENDED, False):
            return args
        return (gather_from_sequence_parallel(args[0], group), *args[1:])

    return hook


def _make_replicated_gather_hook(group: ProcessGroup) -> Any:
    # (B, T/p, H) -> (B, T, H), every tp rank computing on it alike; backward keeps the rank's slice.
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if getattr(module, _SUSPENDED, False):
            return args
        return (gather_sequence_parallel_to_replicated(args[0], group), *args[1:])

    return hook


def _make_split_hook(group: ProcessGroup) -> Any:
    # (B, T, H) replicated -> the rank's (B, T/p, H); backward all-gathers.
    def hook(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
        if getattr(module, _SUSPENDED, False):
            return output
        return scatter_to_sequence_parallel(output, group)

    return hook


def _make_gather_hook(group: ProcessGroup) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
        if getattr(module, _SUSPENDED, False):
            return output
        return gather_sequence_parallel_to_replicated(output, group)

    return hook


@contextmanager
def sequence_parallel_suspended(model: nn.Module) -> Iterator[None]:
    """Run a sequence-parallel model's forward as without sequence parallelism, inside the block.

    For decoding, which feeds one token per step: T = 1 cannot be split over tp. The
    residual stream stays replicated (the hooks of `enable_sequence_parallel` pass
    through) and row-parallel layers all-reduce instead of reduce-scattering along T;
    column-parallel layers then take a replicated input, whose forward operator (f)
    is the identity. The forward values are those of the model built without
    sequence parallelism. Forward only: gradients of the in-layer norms would no
    longer be partial sums. Restores everything on exit.
    """
    modules = list(model.modules())
    linears = [
        m for m in modules if isinstance(m, ColumnParallelLinear | RowParallelLinear) and m.sequence_parallel
    ]
    hooked = [m for m in modules if isinstance(m, EncoderLayer | DecoderLayer | Attention | SparseFFN)]
    try:
        for linear in linears:
            linear.sequence_parallel = False
        for module in hooked:
            setattr(module, _SUSPENDED, True)
        yield
    finally:
        for linear in linears:
            linear.sequence_parallel = True
        for module in hooked:
            setattr(module, _SUSPENDED, False)


# ----------------------------------------------------------------------------- export


def _named_tensors(model: nn.Module, grads: bool) -> Iterator[tuple[str, Tensor, nn.Parameter | None]]:
    if grads:
        for name, param in model.named_parameters():
            if param.grad is not None:
                yield name, param.grad, param
        return
    params = dict(model.named_parameters())
    for name, tensor in model.state_dict().items():
        yield name, tensor, params.get(name)


def gather_full_state_dict(
    model: nn.Module, tp_group: ProcessGroup, grads: bool = False
) -> dict[str, Tensor]:
    """The single-device state dict (or gradients) of a tp-sharded model (collective over tp).

    Names are the single-device ones; the vocabulary is cut back to V rows.
    Every tp rank gets the full tensors (on the parameters' device).

    Args:
        model: a model after `apply_tensor_parallel`.
        tp_group: its tp group.
        grads: gather `param.grad` (parameters with a gradient) instead of the state dict.

    Returns:
        name -> full tensor (detached copies).
    """
    vocab_size: int | None = getattr(getattr(model, "config", None), "vocab_size", None)
    out: dict[str, Tensor] = {}
    for name, tensor, param in _named_tensors(model, grads):
        full = tensor.detach()
        if param is not None and is_tp_sharded(param):
            full = _all_gather(full, int(param.tp_shard_dim), tp_group)  # type: ignore[attr-defined]
            if name.split(".")[0] == "shared" and vocab_size is not None:
                full = full[:vocab_size]
        out[name] = full.clone()
    return out
