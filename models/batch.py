"""`Seq2SeqBatch`: a right-padded batch of translation pairs with its row lengths known on the host."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from models.loss import IGNORE_INDEX


@dataclass
class Seq2SeqBatch:
    """A batch of translation pairs, right-padded, with its row lengths known on the host.

    input_ids:          (B, S) `__src__ tokens </s>` then pad
    attention_mask:     (B, S) 1 on real source tokens, 0 on padding
    decoder_input_ids:  (B, T) `</s> __tgt__ tokens` then pad
    labels:             (B, T) `__tgt__ tokens </s>` then -100
    src_lengths:        real source tokens per row (host ints)
    tgt_lengths:        loss-carrying target tokens per row (host ints)
    slot:               the micro-batch's slot in its global batch (keys MoE routing randomness
                        and expert-load statistics; 0 outside training)

    The lengths are read from the tensors once, while they are still on the CPU
    (collation), and travel with the batch, so trimming, token counts, the choice
    of attention kernel and position-table sizes are decided on the host: nothing
    in a training step reads a device tensor back (`.item()`, `.tolist()`).
    """

    input_ids: Tensor
    attention_mask: Tensor
    decoder_input_ids: Tensor
    labels: Tensor
    src_lengths: tuple[int, ...] | None = None
    tgt_lengths: tuple[int, ...] | None = None
    slot: int = 0
    _key_mask: Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.attention_mask.device.type == "cpu":
            self.lengths()  # read them while it costs nothing: the tensors are on the host

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def lengths(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(source, target) lengths per row; a batch built on a device is read back once (a sync)."""
        if self.src_lengths is None:
            self.src_lengths = tuple(int(n) for n in self.attention_mask.sum(dim=1).tolist())
        if self.tgt_lengths is None:
            self.tgt_lengths = tuple(int(n) for n in (self.labels != IGNORE_INDEX).sum(dim=1).tolist())
        return self.src_lengths, self.tgt_lengths

    def num_tokens(self) -> int:
        """Number of target tokens that carry a loss."""
        return sum(self.lengths()[1])

    def num_src_tokens(self) -> int:
        """Number of real (non-pad) source tokens."""
        return sum(self.lengths()[0])

    @property
    def src_key_mask(self) -> Tensor | None:
        """(B, S) bool key mask for attention over the source, or None when no row is padded
        (then attention runs without a mask, which lets SDPA pick its fastest kernel).
        Built once per batch, on the batch's device."""
        return self.key_mask(always=False)

    def key_mask(self, always: bool) -> Tensor | None:
        """`src_key_mask`, or with `always` the mask even when no row is padded (all True): a
        compiled layer then meets one graph structure whatever the padding."""
        src = self.lengths()[0]
        if not always and (not src or min(src) == self.input_ids.shape[1]):
            return None
        if self._key_mask is None:
            self._key_mask = self.attention_mask.bool()
        return self._key_mask

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Seq2SeqBatch:
        """The batch on `device` (lengths kept). `non_blocking` from pinned memory overlaps the copy."""
        lengths = self.lengths()

        def move(t: Tensor) -> Tensor:
            if non_blocking and t.device.type == "cpu" and torch.device(device).type == "cuda":
                t = t.pin_memory()
            return t.to(device, non_blocking=non_blocking)

        return Seq2SeqBatch(
            move(self.input_ids),
            move(self.attention_mask),
            move(self.decoder_input_ids),
            move(self.labels),
            *lengths,
            slot=self.slot,
        )

    def select(self, rows: slice) -> Seq2SeqBatch:
        """Rows `rows`, trimmed to the longest source and target among them (no global padding)."""
        src_lens, tgt_lens = (lens[rows] for lens in self.lengths())
        s_len = max(max(src_lens, default=1), 1)
        t_len = max(max(tgt_lens, default=1), 1)
        return Seq2SeqBatch(
            self.input_ids[rows, :s_len],
            self.attention_mask[rows, :s_len],
            self.decoder_input_ids[rows, :t_len],
            self.labels[rows, :t_len],
            src_lens,
            tgt_lens,
            slot=self.slot,
        )

    def pad_to_multiple(self, k: int, pad_id: int) -> Seq2SeqBatch:
        """Right-pad S and T up to multiples of `k` (pads are masked keys and ignored labels)."""

        def pad(t: Tensor, value: int) -> Tensor:
            extra = -t.shape[1] % k
            return F.pad(t, (0, extra), value=value) if extra else t

        return Seq2SeqBatch(
            pad(self.input_ids, pad_id),
            pad(self.attention_mask, 0),
            pad(self.decoder_input_ids, pad_id),
            pad(self.labels, IGNORE_INDEX),
            *self.lengths(),
            slot=self.slot,
        )

    def split(self, n: int) -> list[Seq2SeqBatch]:
        """Cut into `n` equal micro-batches, each trimmed to its own longest sequence.

        Raises:
            ValueError: if `n` does not divide the batch size.
        """
        if n <= 0 or self.size % n != 0:
            raise ValueError(f"num_microbatches={n} must divide the batch size {self.size}")
        step = self.size // n
        parts = [self.select(slice(i * step, (i + 1) * step)) for i in range(n)]
        for i, part in enumerate(parts):
            part.slot = self.slot * n + i
        return parts
