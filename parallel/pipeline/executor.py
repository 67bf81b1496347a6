"""The pipeline executor: walks one rank's action list, never deciding the order itself.

    for action in schedule[rank]:           (built by parallel.pipeline.schedule, checked by parallel.pipeline.validate)
        F  s.mb   forward stage s on micro-batch mb; the last stage also computes the loss
        B  s.mb   backward through stage s (input and weight grads)
        I  s.mb   input grads only; linear weight grads are deferred (zero bubble)
        W  s.mb   run the deferred weight grads of (s, mb)
        SF/RF/SB/RB  boundary transfers; each run of consecutive ones is one batch_isend_irecv
        GR        gradients of this flush are final: reduce (dp, tied embedding) on the last flush

Loss scaling: the last stage backpropagates `loss_sum(mb) * loss_scale`, where the
trainer passes `loss_scale = 1 / tokens(global batch)`; summed over micro-batches,
flushes and dp replicas this is exactly the gradient of the mean token loss of the
unsplit global batch. With fp16 it is `S / tokens`, a device scalar holding the
dynamic loss scale S (parallel/loss_scale.py), so S never visits the host.

The hot path never waits on the device: shapes come from the micro-batch every
rank holds (host lengths), token counts are host numbers, and the loss sum stays
a device tensor. A timed flush marks the clock (`parallel.pipeline.timing`: CUDA events on
a GPU) after every action; `FlushResult` resolves the marks into busy time, wall
time and the per-action timeline only when asked, at a logged step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from models.m2m100 import BlockSpec, Seq2SeqBatch, State
from parallel.grads import StepGradients
from parallel.pipeline import p2p
from parallel.pipeline.actions import Action, ActionType, Placement
from parallel.pipeline.memory import ActivationMeter
from parallel.pipeline.stage import PipelineStage, boundary_keys, boundary_shapes
from parallel.pipeline.timing import Clock, HostClock
from parallel.pipeline.zero_bubble import WeightGradStore

LossFn = Callable[[Tensor, Seq2SeqBatch], Tensor]  # (logits, micro-batch) -> sum of token losses


@dataclass
class FlushResult:
    """One flush on this rank: its loss (device), token count (host) and, if timed, its timeline.

    `spans` are (action, start mark, end mark, is_compute); the times below resolve
    the clock marks on first access (on CUDA this waits for the flush's last event).
    """

    loss_sum: Tensor | None = None  # sum of token losses over this rank's micro-batches (last stage)
    num_tokens: int = 0
    peak_activation_bytes: int = 0
    clock: Clock = field(default_factory=HostClock, repr=False)
    marks: list[Any] = field(default_factory=list, repr=False)
    spans: list[tuple[str, int, int, bool]] = field(default_factory=list)
    gr_mark: int | None = None  # the mark where GR starts: the end of the pipeline's span
    _seconds: list[float] | None = field(default=None, repr=False)

    def _times(self) -> list[float]:
        if self._seconds is None:
            self._seconds = self.clock.seconds(self.marks) if self.marks else []
        return self._seconds

    @property
    def timeline(self) -> list[tuple[str, float, float]]:
        """(action, start, end) in seconds from the flush start."""
        t = self._times()
        return [(name, t[a], t[b]) for name, a, b, _ in self.spans]

    @property
    def busy_s(self) -> float:
        """Time in compute actions (device time on CUDA)."""
        t = self._times()
        return sum(t[b] - t[a] for _, a, b, compute in self.spans if compute)

    @property
    def wall_s(self) -> float:
        """Flush start to the end of its last action."""
        t = self._times()
        return t[-1] if t else 0.0

    @property
    def pipeline_s(self) -> float:
        """Flush start to the start of GR: the span the bubble is measured over."""
        t = self._times()
        return t[self.gr_mark] if t and self.gr_mark is not None else self.wall_s


@dataclass
class PipelineTopology:
    """Where the stages are: all stages' blocks, their placement on the pp ranks, and the
    global rank of each pp rank in this rank's (dp, tp) column (the p2p peers)."""

    stage_blocks: list[list[BlockSpec]]
    placement: Placement
    pp_rank: int
    pp_peers: list[int]  # pp_peers[q]: global rank of pp rank q with this rank's (dp, tp)

    @property
    def n_stages(self) -> int:
        return len(self.stage_blocks)

    def is_local(self, stage: int) -> bool:
        """Whether ``stage`` is one of this rank's (a hand-off in memory, no p2p)."""
        return self.placement.rank_of(stage) == self.pp_rank

    def peer(self, stage: int) -> int:
        """Global rank holding ``stage`` (the other end of a message to or from it)."""
        return self.pp_peers[self.placement.rank_of(stage)]


class PipelineExecutor:
    """Runs one rank's schedule over a flush of micro-batches.

    Args:
        stages: this rank's stages keyed by global stage index.
        actions: this rank's action list (from `parallel.pipeline.schedule.build_schedule`).
        topo: stage placement and neighbours.
        loss_fn: (logits, micro-batch) -> sum of token losses (a scalar tensor); it reads the
            labels, and a distillation loss the teacher's states of the micro-batch's slot.
        meter: the activation-memory meter (`parallel.pipeline.memory.meter_for`).
        clock: host timestamps or CUDA events (`parallel.pipeline.timing.clock_for`).
        grads: the step's gradient work: armed before each stage's final backward
            and run at GR, on the step's last flush; None for evaluation.
        autocast_dtype: e.g. torch.bfloat16 to run forwards under autocast.
        wgrad_store: the store deferred linear weight grads go to (zero bubble).
        boundary_dtype: dtype of the hidden states between stages; default the parameters'
            (fp32 masters: autocast keeps the residual stream fp32). Evaluation with every
            weight cast (`bf16_full_eval`) passes the cast dtype.
    """

    def __init__(
        self,
        stages: dict[int, PipelineStage],
        actions: Sequence[Action],
        topo: PipelineTopology,
        loss_fn: LossFn,
        meter: ActivationMeter,
        clock: Clock,
        grads: StepGradients | None = None,
        autocast_dtype: torch.dtype | None = None,
        wgrad_store: WeightGradStore | None = None,
        boundary_dtype: torch.dtype | None = None,
    ) -> None:
        self.stages, self.actions, self.topo = stages, list(actions), topo
        self.loss_fn, self.meter, self.clock, self.grads = loss_fn, meter, clock, grads
        self.autocast_dtype = autocast_dtype
        self.wgrad_store = (
            wgrad_store if wgrad_store is not None else WeightGradStore()
        )  # an empty store is falsy
        any_stage = next(iter(stages.values()))
        self.model = any_stage.model
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, boundary_dtype or param.dtype
        self.d_model = self.model.config.d_model
        # An action list without backward (evaluation) keeps nothing for autograd.
        self.forward_only = not any(
            a.type in (ActionType.BACKWARD, ActionType.BACKWARD_INPUT) for a in self.actions
        )
        # Each stage's last full backward, by action index: on the step's last flush the dp
        # reduce of that stage's gradients may start during it (see parallel.grads).
        last = {a.stage: i for i, a in enumerate(self.actions) if a.type is ActionType.BACKWARD}
        slot = {s: k for k, s in enumerate(sorted(stages))}
        self.final_backward = {i: slot[s] for s, i in last.items()}
        # Runs of consecutive comm actions: each is posted as one batch.
        self.segments: list[tuple[int, int]] = []
        i = 0
        while i < len(self.actions):
            j = i + 1
            if self.actions[i].type.is_comm:
                while j < len(self.actions) and self.actions[j].type.is_comm:
                    j += 1
            self.segments.append((i, j))
            i = j

    # ------------------------------------------------------------------ driver

    def run_flush(
        self,
        microbatches: Sequence[Seq2SeqBatch],
        loss_scale: float | Tensor,
        last_flush: bool = True,
        timed: bool = False,
        dropout_keys: Sequence[int] | None = None,
    ) -> FlushResult:
        """Execute the whole action list once over `microbatches` (m of them).

        Args:
            microbatches: this replica's micro-batches of the flush, on the device.
            loss_scale: 1 / tokens(global batch), or S / tokens as a 0-d device tensor (fp16).
            last_flush: the step's last flush: arm the dp overlap and run GR's reduce.
            timed: mark the clock after every action (for the bubble and the timeline) and
                meter activation memory (the saved-tensor meter's hooks cost host work, so
                untimed flushes, the steps between log points, run without them).
            dropout_keys: one key per micro-batch for its dropout masks (`parallel.rng`);
                None: the global generators.
        """
        if dropout_keys is not None and len(dropout_keys) != len(microbatches):
            raise ValueError(f"{len(dropout_keys)} dropout keys for {len(microbatches)} micro-batches")
        st = _FlushState(microbatches, loss_scale, timed, dropout_keys)
        res = FlushResult(clock=self.clock)
        mark = self.clock.mark if timed else None
        if mark is not None:
            res.marks.append(mark())
        for i, j in self.segments:
            a = self.actions[i]
            if a.type.is_comm:
                st.sends = p2p.wait_sends(st.sends, only_completed=True)
                st.sends += p2p.exchange([self._transfer(x, st) for x in self.actions[i:j]])
            elif a.type is ActionType.GRAD_REDUCE:
                res.gr_mark = len(res.marks) - 1 if mark is not None else None
                if last_flush and self.grads is not None:
                    self.grads.reduce()
            else:
                if last_flush and self.grads is not None and i in self.final_backward:
                    self.grads.arm(self.final_backward[i])
                self._compute(a, st)
            if mark is not None:
                name = " ".join(str(x) for x in self.actions[i:j])
                res.spans.append((name, len(res.marks) - 1, len(res.marks), a.type.is_compute))
                res.marks.append(mark())
        st.sends = p2p.wait_sends(st.sends)
        res.loss_sum, res.num_tokens = st.loss_sum, st.num_tokens
        res.peak_activation_bytes = self.meter.peak
        self.meter.reset()
        if st.inputs or st.outputs or st.pending_grads:
            raise RuntimeError(
                f"schedule left state behind: inputs {sorted(st.inputs)}, outputs {sorted(st.outputs)}"
            )
        return res

    # ------------------------------------------------------------------ compute

    def _compute(self, a: Action, st: _FlushState) -> None:
        if a.type is ActionType.FORWARD:
            self._forward(a.stage, a.microbatch, st)
        elif a.type in (ActionType.BACKWARD, ActionType.BACKWARD_INPUT):
            self._backward(a.stage, a.microbatch, st, defer_wgrad=a.type is ActionType.BACKWARD_INPUT)
        elif a.type is ActionType.BACKWARD_WEIGHT:
            self.wgrad_store.flush((a.stage, a.microbatch))
            self.meter.release((a.stage, a.microbatch))
        else:
            raise ValueError(f"unexpected action {a}")

    def _forward(self, s: int, mb: int, st: _FlushState) -> None:
        stage, batch = self.stages[s], st.batches[mb]
        if s == 0:
            inputs: State = {}
        elif (s - 1, mb) in st.local_handoff:  # previous stage on this rank (p == 1, ZB-V's turn)
            inputs = {
                k: v.detach().requires_grad_(True) for k, v in st.local_handoff.pop((s - 1, mb)).items()
            }
        else:
            inputs = st.received.pop((s, mb))
            for t in inputs.values():
                t.requires_grad_(not self.forward_only)
        autocast = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else nullcontext()
        )
        meter = self.meter.record((s, mb), inputs) if st.timed else nullcontext()
        with meter, autocast:
            out = stage.forward(inputs, batch, None if st.keys is None else st.keys[mb])
            if stage.is_last:
                loss_sum = self.loss_fn(out["logits"], batch)
        if stage.is_last:
            detached = loss_sum.detach()
            st.loss_sum = detached if st.loss_sum is None else st.loss_sum + detached
            st.num_tokens += batch.num_tokens()
        if self.forward_only:
            if not stage.is_last:  # held only until SF / the next local stage takes it
                st.outputs[(s, mb)] = out
                if self.topo.is_local(s + 1):
                    st.local_handoff[(s, mb)] = st.outputs.pop((s, mb))
            return
        st.inputs[(s, mb)] = inputs
        if stage.is_last:
            st.outputs[(s, mb)] = {"loss": loss_sum * st.loss_scale}
        else:
            st.outputs[(s, mb)] = out
            if self.topo.is_local(s + 1):
                st.local_handoff[(s, mb)] = out

    def _backward(self, s: int, mb: int, st: _FlushState, defer_wgrad: bool) -> None:
        stage = self.stages[s]
        outputs = st.outputs.pop((s, mb))
        if stage.is_last:
            tensors: list[Tensor] = [outputs["loss"]]
            grads: list[Tensor | None] = [None]
        else:
            keys = boundary_keys(stage.blocks[-1])
            got = st.pending_grads.pop((s, mb))
            pairs = [(outputs[k], g) for k, g in zip(keys, got) if outputs[k].requires_grad]
            tensors, grads = [t for t, _ in pairs], [g for _, g in pairs]  # type: ignore[misc]
        ctx = self.wgrad_store.deferring((s, mb)) if defer_wgrad else nullcontext()
        with ctx:
            torch.autograd.backward(tensors, grad_tensors=grads)  # type: ignore[arg-type]
        inputs = st.inputs.pop((s, mb))
        if not defer_wgrad:
            self.meter.release((s, mb))
        if s > 0:
            prev = self.topo.stage_blocks[s - 1][-1]
            in_grads: list[Tensor] = [_grad_or_zeros(inputs[k]) for k in boundary_keys(prev)]
            if self.topo.is_local(s - 1):
                st.pending_grads[(s - 1, mb)] = in_grads
            else:
                st.grads_to_send[(s, mb)] = in_grads

    # ------------------------------------------------------------------ comm

    def _transfer(self, a: Action, st: _FlushState) -> p2p.Transfer:
        m = len(st.batches)
        s, mb = a.stage, a.microbatch
        batch = st.batches[mb]
        blocks = self.topo.stage_blocks
        if a.type is ActionType.SEND_FORWARD:
            out = st.outputs.pop((s, mb)) if self.forward_only else st.outputs[(s, mb)]
            tensors = [out[k].detach() for k in boundary_keys(blocks[s][-1])]
            return p2p.Transfer(True, self.topo.peer(s + 1), tensors, p2p.message_tag(0, s + 1, mb, m), a)
        if a.type is ActionType.RECV_FORWARD:
            prev = blocks[s - 1][-1]
            bufs = p2p.empty_buffers(boundary_shapes(prev, batch, self.d_model), self.dtype, self.device)
            st.received[(s, mb)] = dict(zip(boundary_keys(prev), bufs))
            return p2p.Transfer(False, self.topo.peer(s - 1), bufs, p2p.message_tag(0, s, mb, m), a)
        if a.type is ActionType.SEND_BACKWARD:
            grads = st.grads_to_send.pop((s, mb))
            return p2p.Transfer(True, self.topo.peer(s - 1), grads, p2p.message_tag(1, s - 1, mb, m), a)
        assert a.type is ActionType.RECV_BACKWARD
        last = blocks[s][-1]
        bufs = p2p.empty_buffers(boundary_shapes(last, batch, self.d_model), self.dtype, self.device)
        st.pending_grads[(s, mb)] = bufs
        return p2p.Transfer(False, self.topo.peer(s + 1), bufs, p2p.message_tag(1, s, mb, m), a)


def _grad_or_zeros(t: Tensor) -> Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


class _FlushState:
    """Tensors in flight during one flush, keyed by (stage, micro-batch)."""

    def __init__(
        self,
        batches: Sequence[Seq2SeqBatch],
        loss_scale: float | Tensor,
        timed: bool,
        keys: Sequence[int] | None = None,
    ) -> None:
        self.batches, self.loss_scale, self.timed = list(batches), loss_scale, timed
        self.keys = None if keys is None else list(keys)  # dropout key per micro-batch
        self.inputs: dict[tuple[int, int], State] = {}
        self.outputs: dict[tuple[int, int], dict[str, Any]] = {}
        self.received: dict[tuple[int, int], State] = {}
        self.pending_grads: dict[tuple[int, int], list[Tensor]] = {}
        self.grads_to_send: dict[tuple[int, int], list[Tensor]] = {}
        self.local_handoff: dict[tuple[int, int], State] = {}
        self.sends: list[p2p.PendingSend] = []  # posted, not yet known to be complete
        self.loss_sum: Tensor | None = None  # stays on the device
        self.num_tokens = 0
