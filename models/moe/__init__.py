"""The NLLB-MoE sparse feed-forward layer: top-2 router, stacked experts, local dispatch.

Every `sparse_step`-th FFN of an NLLB-MoE model is `SparseFFN` (`ffn` in the layer), made of
three separate objects, so that a dropless or an all-to-all dispatcher replaces one piece:

    x (N, H) --router--> Routing: expert_index, gate, slot (N, 2); aux_loss; counts
             --dispatcher.dispatch--> buffer (E_l, C, H)  tokens gathered per expert slot
             --experts--> (E_l, C, H)                      one batched matmul per projection
             --dispatcher.combine--> (N, H)                sum over the 2 choices of gate * y

Routing follows fairseq's NLLB top-2 gate (`fairseq/modules/moe/top2gate.py`, branch nllb):
fp32 router; the first expert is the argmax; the second the argmax of the others, after
Gumbel noise for `second_expert_policy: sampling`, kept with probability min(1, 2 g_2) for
`random`; padding takes no slot; each expert takes at most C assignments, first choices
before second ones (token order, or by max probability with `batch_prioritized_routing`);
the two gates renormalised to sum to 1 (before or after dropping). Capacity of a routing
group of N token slots (one micro-batch's B * T): C = ceil(f * 2 * ceil(N / E)) in training
(f = `moe_capacity_factor`, 1 in fairseq), ceil(`moe_eval_capacity_token_fraction` * N) in
evaluation (1.0: nothing dropped), none at all with `moe_dropless`.

Load-balancing loss (GShard; fairseq's l_aux), pre-capacity, over the group's real tokens:

    aux = E^2 * mean_e(me_e * ce_e),  me_e = mean_t p_te,  ce_e = mean_t [top-1(t) = e]

It reaches the gradients where it is computed: `AuxLossScaler` is the identity on the
layer's output and adds d(scale * aux) in backward (Megatron's MoEAuxLossAutoScaler), with
scale = coef * ntokens(micro-batch) * loss_scale / n_sparse_layers, which is fairseq's
criterion loss = CE + coef * ntokens * mean_layers(aux) divided by the global batch's
tokens (`MoERun.loss_scale`, set per step from outside).

Expert output masking (`moe_token_dropout` p, fairseq's EOM): in training each (token,
expert) output is zeroed with probability p (whole rows, no rescaling); in evaluation
outputs are scaled by 1 - p.

Randomness (Gumbel noise, the `random` policy, EOM) comes from generators keyed by
(seed, step, micro-batch slot, layer) (`MoERun`, `MoECall`), so a recomputation under
remat, or another mesh, draws the same values.

Experts run together, one call per projection (`models.moe.experts`): on the group's rows
sorted by expert with `torch._grouped_mm` where it runs (CPUs; CUDA sm90+ in bf16), else on a
(E, C, H) capacity buffer with `torch.baddbmm`. Host reads: none, except the buffer layout
without a capacity (dropless routing, or an evaluation capacity >= N that cannot drop): it
sizes the buffer by the largest expert count, one read per layer call.

Legend: N tokens of the routing group, H d_model, F ffn dim, E experts (global), E_l
local experts, C capacity (slots per expert), k in {0, 1} the first / second choice.
"""

from models.moe.experts import (
    Experts,
    GroupedLinear,
    GroupedRows,
    LocalDispatcher,
    batched_linear,
    grouped_mm_runs,
)
from models.moe.layer import (
    AuxLossScaler,
    LayerStats,
    MoECall,
    MoERun,
    SparseFFN,
    SparseSettings,
    build_sparse_ffn,
)
from models.moe.names import (
    EXPERT_PARAMS,
    expert_param_name,
    is_expert_param,
    keyed_expert_init,
    split_expert_name,
)
from models.moe.router import Routing, Top2Router, keyed_generator

__all__ = [
    "EXPERT_PARAMS",
    "AuxLossScaler",
    "Experts",
    "GroupedLinear",
    "GroupedRows",
    "LayerStats",
    "LocalDispatcher",
    "MoECall",
    "MoERun",
    "Routing",
    "SparseFFN",
    "SparseSettings",
    "Top2Router",
    "batched_linear",
    "build_sparse_ffn",
    "expert_param_name",
    "grouped_mm_runs",
    "is_expert_param",
    "keyed_expert_init",
    "keyed_generator",
    "split_expert_name",
]
