"""A pipeline stage: a contiguous run of the model's blocks, and what crosses its boundaries.

The rank keeps one pruned model holding the blocks of all its stages (v of them
under interleaving), so a tied parameter is one `nn.Parameter` per rank; each
`PipelineStage` runs its own slice of blocks on that shared model.

Boundary tensors are named by the block kind on each side; their shapes follow
from the micro-batch, which every pipeline rank holds (all ranks read the same
global batch), so a receiver allocates exact buffers with no shape exchange and
sequence lengths can change between micro-batches and steps:

    after src_embed / encoder layer   hidden (B, S, H)
    after encoder norm                encoder_out (B, S, H)
    after tgt_embed / decoder layer   encoder_out (B, S, H), hidden (B, T, H)

Given the micro-batch's dropout key, each block runs on its own keyed stream
(`parallel.rng.keyed_block`), so its masks do not depend on the stage that holds it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from torch.utils.checkpoint import checkpoint

from models.m2m100 import BlockKind, BlockSpec, M2M100Translation, Seq2SeqBatch, State
from parallel.rng import keyed_block

_ENCODER_SIDE = (BlockKind.SRC_EMBED, BlockKind.ENC_LAYER)


def boundary_keys(last_block_before: BlockSpec) -> tuple[str, ...]:
    """Names of the tensors crossing the boundary after `last_block_before`, in a fixed order."""
    if last_block_before.kind in _ENCODER_SIDE:
        return ("hidden",)
    if last_block_before.kind is BlockKind.ENC_NORM:
        return ("encoder_out",)
    if last_block_before.kind is BlockKind.HEAD:
        raise ValueError("nothing crosses a boundary after the head: it is the last block")
    return ("encoder_out", "hidden")


def boundary_shapes(last_block_before: BlockSpec, batch: Seq2SeqBatch, d_model: int) -> list[tuple[int, ...]]:
    """Shapes of the boundary tensors for this micro-batch."""
    b, s = batch.input_ids.shape
    t = batch.decoder_input_ids.shape[1]
    shape = {
        "encoder_out": (b, s, d_model),
        "hidden": (b, s, d_model) if last_block_before.kind in _ENCODER_SIDE else (b, t, d_model),
    }
    return [shape[k] for k in boundary_keys(last_block_before)]


class PipelineStage:
    """Stage `index` of `n_stages`: runs `blocks` of the rank's (pruned) model.

    Args:
        model: the rank's model, pruned to the blocks of all its stages.
        blocks: this stage's blocks, in order.
        index: global stage index; n_stages: total stages (p * v).
        remat_stage: GPipe-style rematerialisation: keep only the stage input and
            recompute the whole stage in backward.
    """

    def __init__(
        self,
        model: M2M100Translation,
        blocks: Sequence[BlockSpec],
        index: int,
        n_stages: int,
        remat_stage: bool = False,
    ) -> None:
        if not blocks:
            raise ValueError(f"stage {index} has no blocks")
        self.model, self.blocks = model, list(blocks)
        self.index, self.n_stages = index, n_stages
        self.remat_stage = remat_stage

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1

    def output_keys(self) -> tuple[str, ...]:
        return ("logits",) if self.is_last else boundary_keys(self.blocks[-1])

    def forward(self, inputs: State, batch: Seq2SeqBatch, rng_key: int | None = None) -> State:
        """The stage's output state; `rng_key` keys the micro-batch's dropout (`parallel.rng`)."""
        if not self.remat_stage:
            return self._run_blocks(inputs, batch, rng_key)
        keys = sorted(inputs)

        def run(*tensors: Tensor) -> tuple[Tensor, ...]:
            out = self._run_blocks(dict(zip(keys, tensors)), batch, rng_key)
            return tuple(out[k] for k in self.output_keys())

        outs = checkpoint(run, *(inputs[k] for k in keys), use_reentrant=False, preserve_rng_state=True)
        return dict(zip(self.output_keys(), outs))

    def _run_blocks(self, state: State, batch: Seq2SeqBatch, rng_key: int | None) -> State:
        if rng_key is None:
            return self.model.run_blocks(state, batch, self.blocks)
        for spec in self.blocks:
            with keyed_block(rng_key, spec):
                state = self.model.run_block(spec, state, batch)
        return state
