"""Generation through the 3D model without gathering it: per-stage KV caches, tp layers as trained.

`pipeline_generate` decodes one batch on this rank's pp x tp slice of the mesh
(one dp replica); the search itself (`models.generate.search`: forced BOS, beams,
finished hypotheses) runs unchanged on the last stage and drives a
`PipelineDecoderStep`, which the other stages follow. Legend: p pipeline ranks,
n = p v stages (stage s on pp rank `plan.placement.rank_of(s)`), B rows, K beams, N = B K decoder rows,
S source length, H d_model, V vocabulary.

    encoder   stage by stage as in training: hidden (B, S, H) sent p2p to the next
              stage's rank; the stage with the encoder norm broadcasts encoder_out
              (B, S, H) over the pp axis once; each decoder stage repeats it K times
              and projects its layers' cross-attention k/v once (`IncrementalDecoder`)
    per token the last stage (the leader) broadcasts [command, ids (N), rows (N)] over
              the pp axis: every rank reorders its self-attention caches by `rows`
              (the previous step's surviving beams) and the decoder stages run the new
              token in stage order, hidden (N, 1, H) sent p2p; the head's logit
              shards are all-gathered over tp (exact: every tp rank of the last stage
              then runs the same search on the same logits and decides the same)
    stop      the leader broadcasts the stop command: every rank has run the same
              number of steps, so all tp and p2p traffic matched

Tensor-parallel layers run as trained (heads split, row-parallel all-reduce); the
KV caches hold this rank's heads only. Decoding runs in the run's precision
(`ParallelModel.evaluating`: autocast as in training, or every weight cast with
`bf16_full_eval`), so an fsdp run's gathered bf16 working weights meet bf16 activations;
the hidden states between stages keep the residual stream's dtype. Sequence parallelism is suspended while
decoding (`parallel.tp.apply.sequence_parallel_suspended`): one token per step
cannot be split along T, and the forward values do not depend on it. Nothing per token reads the device except
what the search needs (its finished check on the leader, the command on the others).

Expert parallelism (ep > 1): the ep peers of a replica decode the same batch together,
as tp ranks do: each runs its own experts on their share of every token and the ep
group sums the outputs (`parallel.expert.apply.replicated_tokens`), so every peer gets
the same logits and takes the same number of steps (no all-to-all to keep in lockstep
across replicas decoding different batches; the callers hand ep peers the same batches).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import Tensor

from models.generate import (
    DECODER_KINDS,
    IncrementalDecoder,
    SearchSettings,
    Special,
    search,
    special_tokens,
)
from models.m2m100 import BlockSpec, Seq2SeqBatch, State
from parallel.expert.apply import replicated_tokens
from parallel.parallelize import ParallelModel
from parallel.pipeline.p2p import PendingSend, Transfer, exchange, wait_sends
from parallel.tp.apply import sequence_parallel_suspended

STOP, STEP, REORDER_AND_STEP = 0, 1, 2  # leader -> followers commands (element 0 of the message)


def _stage_runs(
    stage_blocks: Sequence[Sequence[BlockSpec]], decoder: bool
) -> list[tuple[int, list[BlockSpec]]]:
    """(stage, its encoder-side or decoder-side blocks) for the stages that have any, in order."""
    runs = []
    for s, blocks in enumerate(stage_blocks):
        mine = [b for b in blocks if (b.kind in DECODER_KINDS) == decoder]
        if mine:
            runs.append((s, mine))
    return runs


def _hop(
    pm: ParallelModel, x: Tensor | None, src: int, dst: int, shape: tuple[int, ...], tag: int
) -> tuple[Tensor | None, list[PendingSend]]:
    """Move `x` from pp rank `src` to pp rank `dst` (both or neither this rank: no-op)."""
    me = pm.mesh.pp_rank
    if src == dst or me not in (src, dst):
        return x, []
    if me == src:
        assert x is not None
        return None, exchange([Transfer(True, pm.mesh.pp_peer(dst), [x], tag)])
    buf = torch.empty(shape, dtype=pm.activation_dtype, device=pm.device)
    exchange([Transfer(False, pm.mesh.pp_peer(src), [buf], tag)])
    return buf, []


def encode(pm: ParallelModel, batch: Seq2SeqBatch) -> Tensor:
    """Run the encoder blocks stage by stage; returns encoder_out (B, S, H) on every pp rank.

    Collective over the pp axis (p2p between consecutive encoder stages, one broadcast).
    """
    me, p, rank_of = pm.mesh.pp_rank, pm.plan.p, pm.plan.placement.rank_of
    b, s = batch.input_ids.shape
    shape = (b, s, pm.model.config.d_model)
    runs = _stage_runs(pm.plan.stage_blocks, decoder=False)
    state: State = {}
    pending: list[PendingSend] = []
    for i, (stage, blocks) in enumerate(runs):
        if i > 0:
            hidden, sends = _hop(
                pm, state.get("hidden"), rank_of(runs[i - 1][0]), rank_of(stage), shape, stage
            )
            pending += sends
            state = {} if hidden is None else {"hidden": hidden}
        if rank_of(stage) == me:
            state = pm.model.run_blocks(state, batch, blocks)
    wait_sends(pending)
    owner = rank_of(runs[-1][0])  # the stage with the encoder norm
    out = (
        state["encoder_out"]
        if owner == me
        else torch.empty(shape, dtype=pm.activation_dtype, device=pm.device)
    )
    if p > 1:
        dist.broadcast(out, src=pm.mesh.pp_peer(owner), group=pm.mesh.group("pp"))
    return out


class PipelineDecoderStep:
    """`models.generate.DecoderStep` over the decoder stages of a pp x tp slice.

    On the leader (the last stage's rank) the search calls `step` and `reorder`;
    every other pp rank calls `follow`, which mirrors each step until the leader's
    `finish`. Only the leader's `step` returns logits.

    Args:
        pm: this rank's parallel model.
        encoder_out: (N, S, H) the encoder output, one row per decoder row.
        src_mask: (N, S) bool.
    """

    def __init__(self, pm: ParallelModel, encoder_out: Tensor, src_mask: Tensor) -> None:
        self.pm, self.device = pm, pm.device
        self.p, self.me, self.rank_of = pm.plan.p, pm.mesh.pp_rank, pm.plan.placement.rank_of
        self.leader = pm.plan.last_stage_rank
        self.runs = _stage_runs(pm.plan.stage_blocks, decoder=True)
        self.decoders = {
            stage: IncrementalDecoder(pm.model, blocks, encoder_out, src_mask)
            for stage, blocks in self.runs
            if self.rank_of(stage) == self.me
        }
        self.n = int(encoder_out.shape[0])
        self.rows: Tensor | None = None  # reorder requested by the search, sent with the next step

    @property
    def is_leader(self) -> bool:
        return self.me == self.leader

    def step(self, ids: Tensor) -> Tensor:  # (N, 1) -> (N, V) float32 logits (leader only)
        """Broadcast the step, run it through the stages, return the gathered logits."""
        rows = (
            self.rows if self.rows is not None else torch.zeros(self.n, dtype=torch.long, device=self.device)
        )
        command = STEP if self.rows is None else REORDER_AND_STEP  # a host value: no device read
        cmd = torch.tensor([command], dtype=torch.long, device=self.device)
        message = torch.cat([cmd, ids.reshape(-1).long(), rows.long()])  # (1 + 2N,)
        self.rows = None
        logits = self._run(self._broadcast(message), command)
        assert logits is not None
        return logits

    def reorder(self, rows: Tensor) -> None:
        """Recorded; every stage applies it at the next step (it rides on that step's message)."""
        self.rows = rows

    def finish(self) -> None:
        """Leader: tell the followers the search is over."""
        self._broadcast(torch.full((1 + 2 * self.n,), STOP, dtype=torch.long, device=self.device))

    def follow(self) -> None:
        """Non-leader pp ranks: run every step the leader broadcasts, until it stops."""
        while True:
            message = self._broadcast(torch.empty(1 + 2 * self.n, dtype=torch.long, device=self.device))
            command = int(message[0])  # the one read per token: the leader's finished check, relayed
            if command == STOP:
                return
            self._run(message, command)

    def _broadcast(self, message: Tensor) -> Tensor:
        if self.p > 1:
            dist.broadcast(message, src=self.pm.mesh.pp_peer(self.leader), group=self.pm.mesh.group("pp"))
        return message

    def _run(self, message: Tensor, command: int) -> Tensor | None:
        """Reorder the caches if asked, then the new token through the decoder stages in order."""
        n = self.n
        ids, rows = message[1 : 1 + n].view(n, 1), message[1 + n :]
        if command == REORDER_AND_STEP:
            for decoder in self.decoders.values():
                decoder.reorder(rows)
        shape = (n, 1, self.pm.model.config.d_model)
        x: Tensor | None = ids
        pending: list[PendingSend] = []
        for i, (stage, _) in enumerate(self.runs):
            if i > 0:
                x, sends = _hop(
                    self.pm, x, self.rank_of(self.runs[i - 1][0]), self.rank_of(stage), shape, stage
                )
                pending += sends
            if stage in self.decoders:
                assert x is not None
                x = self.decoders[stage].forward(x)
        wait_sends(pending)
        if not self.is_leader:
            return None
        assert x is not None
        tp = self.pm.tp_info
        logits = tp.gather_logits(x) if tp is not None else x  # (N, 1, V/p) -> (N, 1, V)
        return logits[:, -1].float()


@torch.no_grad()
def pipeline_generate(
    pm: ParallelModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    forced_bos_token_id: int | Sequence[int] | Tensor | None,
    settings: SearchSettings,
) -> Tensor | None:
    """`models.generate.generate` on the 3D model: the same tokens, no weights gathered.

    Collective over this rank's pp x tp slice (one dp replica): every rank of it calls
    with the same batch. Dropout is whatever mode `pm.model` is in (eval for decoding).

    Args:
        pm: this rank's parallel model, decoding in evaluation's precision (`pm.evaluating`:
            autocast to the run's working dtype, or every weight cast with `bf16_full_eval`;
            FSDP parameters gathered, a collective over dp: every dp replica calls as often,
            or all calls sit in one outer `pm.evaluating()`; with ep > 1 the ep peers must pass
            the same batch). Sequence parallelism, if on, is suspended for the call: one token
            per step cannot be split along T.
        input_ids: (B, S) `__src__ tokens </s>` right-padded.
        attention_mask: (B, S) 1 on real tokens.
        forced_bos_token_id: one tag, one per row, or None (see `generate`).
        settings: num_beams, max_length, length_penalty, early_stopping.

    Returns:
        (B, T) token ids on the last stage's ranks (every tp rank), None on the others.

    Raises:
        ValueError: bad settings or tag list.
    """
    settings.validate()
    k, b = settings.num_beams, int(input_ids.shape[0])
    special = special_tokens(pm.model.config, forced_bos_token_id, b, k, pm.device)
    ids, mask = input_ids.to(pm.device), attention_mask.to(pm.device)
    sp = pm.tp_info is not None and pm.tp_info.sequence_parallel
    with (
        pm.evaluating(),
        sequence_parallel_suspended(pm.model) if sp else nullcontext(),
        replicated_tokens(pm.model),
    ):
        return _generate(pm, ids, mask, special, settings)


def _generate(
    pm: ParallelModel, ids: Tensor, mask: Tensor, special: Special, settings: SearchSettings
) -> Tensor | None:
    """Encode, then the leader searches while the other pp ranks follow (see the module docstring)."""
    k, b = settings.num_beams, int(ids.shape[0])
    empty = ids[:, :0]
    encoder_out = encode(pm, Seq2SeqBatch(ids, mask, empty, empty))  # (B, S, H)
    # Beams of a row sit next to each other, as in `generate`.
    state = PipelineDecoderStep(
        pm, encoder_out.repeat_interleave(k, dim=0), mask.bool().repeat_interleave(k, dim=0)
    )
    if not state.is_leader:
        state.follow()
        return None
    out = search(state, special, b, settings)
    state.finish()
    return out
