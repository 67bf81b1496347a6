"""The planner's cost terms for sparse (NLLB-MoE) layers and expert parallelism (ep).

Legend: E experts per sparse layer, ep the expert-parallel size (E / ep experts per rank), N
tokens of a routing group (one micro-batch's b x s source or b x t target tokens), H d_model,
F the FFN dim, A kept assignments (top-2: 2 N, less what capacity drops).

    FLOPs         a sparse layer replaces one FFN (2 x 2 N H F) by the router (2 N H E) and
                  two experts per token (2 x 2 x 2 N H F): top-2 doubles the FFN's FLOPs
                  (`sparse_layer_flops`); the compute per rank does not depend on ep (each rank's
                  E / ep experts take ep groups' tokens)
    all-to-all    per sparse layer and micro-batch, each rank sends the rows of its assignments
                  routed to other ranks' experts, A (ep - 1) / ep with uniform routing, and
                  gets as many back, in the working dtype (bf16 under autocast: the rows are
                  cast after the router), forward and backward, again when remat
                  recomputes the layer (`a2a_bytes`). tp ranks each run their own all-to-all
                  over their ep group (the same tokens), so tp does not divide it. Time: the
                  bytes over the rank's link, intra-node when the ep group (ep x tp consecutive
                  ranks) fits a node (`LinkModel.all_to_all`)
    memory        expert parameters / ep per rank (`parallel.expert`), their gradients and
                  AdamW state too; ZeRO-1 and FSDP shard them over edp = dp / ep; their
                  gradients reduce over edp (`trainer.planner.memory`, `trainer.planner.cost`)
    start-up      a rank materialises only its experts: the largest tensor is the stacked
                  (E / ep, F / tp, H) expert weight

The bytes formula is what `scripts/bench_moe_ep.py` checks against the dispatcher's own count
(`parallel.expert.dispatch.A2AStats`), with A read from the routing counts.
"""

from __future__ import annotations

from models.config import ModelConfig


def a2a_rows(assignments: float, ep: int) -> float:
    """Rows a rank sends to other ranks for `assignments` kept assignments, routing uniform over experts."""
    return assignments * (ep - 1) / ep if ep > 1 else 0.0


def a2a_bytes(
    assignments: float, ep: int, d_model: int, in_bytes: int = 4, out_bytes: int = 4, recompute: bool = False
) -> float:
    """Bytes one rank sends in one sparse layer's all-to-alls for one micro-batch, forward and backward.

    Args:
        assignments: kept assignments of the rank's routing group (top-2: 2 N less the drops).
        ep: expert-parallel size.
        d_model: H.
        in_bytes, out_bytes: element size of the dispatched and of the combined rows (the
            working dtype: 4 in fp32, 2 under bf16 autocast); each gradient goes back in its
            row's dtype.
        recompute: remat recomputes the layer's forward in the backward (full or stage).
    """
    rows = a2a_rows(assignments, ep) * d_model
    passes = 3 if recompute else 2  # forward, backward (and the recomputed forward)
    return rows * (in_bytes + out_bytes) * passes


def sparse_layer_flops(n_tokens: int, d_model: int, ffn_dim: int, num_experts: int) -> float:
    """Forward FLOPs of a sparse FFN on `n_tokens` (router + two experts per token) less the
    dense FFN's: what a sparse layer adds to a dense one."""
    dense = 2 * n_tokens * 2 * d_model * ffn_dim
    return 2 * n_tokens * d_model * num_experts + 2 * dense - dense


def expert_params(mc: ModelConfig, ffn_dim: int, tp: int = 1, ep: int = 1) -> int:
    """Parameters of one sparse layer's experts on one (tp, ep) rank: E / ep stacked FFNs, F split over tp."""
    return (mc.num_experts // ep) * (2 * mc.d_model * ffn_dim // tp + ffn_dim // tp + mc.d_model)


def router_params(mc: ModelConfig) -> int:
    """The router's classifier (replicated on every rank)."""
    return mc.d_model * mc.num_experts + (mc.num_experts if mc.router_bias else 0)


def ep_inter_node(ep: int, tp: int, gpus_per_node: int) -> bool:
    """Whether an ep group (ep x tp consecutive global ranks, tp innermost) spans nodes."""
    return ep * tp > max(1, gpus_per_node)
