"""How far the training loop got: ``(epoch, consumed)``, shared with DataLoader workers.

The cursor is counted in the training process (by ``HiddenStateDataset`` when it is
iterated there, by ``HiddenStateLoader`` when workers read) and mirrored into a small
shared-memory tensor, so worker processes, persistent ones too, start each pass from the
epoch and position the training process set (``set_epoch``, ``load_state_dict``).
"""

from __future__ import annotations

import torch


class Cursor:
    """An epoch and the positions of this rank's epoch order consumed in it."""

    def __init__(self) -> None:
        self.epoch = 0
        self.consumed = 0
        # [epoch, consumed]: what worker processes read when a pass starts.
        self._shared = torch.zeros(2, dtype=torch.int64).share_memory_()
        self.publish()

    def move_to(self, epoch: int, consumed: int) -> None:
        """Set the cursor and publish it to the workers."""
        self.epoch, self.consumed = int(epoch), int(consumed)
        self.publish()

    def next_epoch(self) -> None:
        """A complete pass: the next one starts the next epoch."""
        self.move_to(self.epoch + 1, 0)

    def publish(self) -> None:
        """Make the cursor what workers see when their next pass starts."""
        self._shared.copy_(torch.tensor([self.epoch, self.consumed], dtype=torch.int64))

    def published(self) -> tuple[int, int]:
        """``(epoch, consumed)`` as last published (what a worker process reads)."""
        epoch, consumed = (int(v) for v in self._shared.tolist())
        return epoch, consumed
