"""Slot pool of one tier (device or host): a free bitmap plus the reverse map slot -> entry.

Allocation takes the lowest free slots (first-k over the free bitmap); the reverse map lets
a victim slot be turned back into the logical entry whose mapping must change.
"""

from __future__ import annotations

import torch

from .bitmaps import HierBitmap


class SlotPool:
    def __init__(self, num_slots: int, device: torch.device):
        self.num_slots = num_slots
        self.free_bits = HierBitmap(1, num_slots, device)
        if num_slots:
            self.free_bits.add(0, torch.arange(num_slots, device=device))
        self.owner = torch.full((num_slots,), -1, dtype=torch.int64, device=device)
        self.num_free = num_slots
        self._row = torch.zeros(1, dtype=torch.int64, device=device)

    @property
    def num_used(self) -> int:
        return self.num_slots - self.num_free

    def alloc(self, entries: torch.Tensor) -> torch.Tensor:
        """Take one free slot per (unique) entry id; raises if not enough are free."""
        n = entries.numel()
        if n > self.num_free:
            raise CapacityError(f"pool of {self.num_slots} slots has {self.num_free} free, need {n}")
        if n == 0:
            return entries.new_empty(0)
        slots = self.free_bits.first_k(self._row, n)
        self.free_bits.remove(slots)
        self.owner.index_put_((slots,), entries)
        self.num_free -= n
        return slots

    def claim(self, slots: torch.Tensor, entries: torch.Tensor) -> None:
        """Take the given free ``slots`` (unique) for ``entries``; raises if any is in use."""
        if slots.numel() == 0:
            return
        if bool((self.owner.index_select(0, slots) >= 0).any()):
            raise CapacityError("claim: some slots are already in use")
        self.free_bits.remove(slots)
        self.owner.index_put_((slots,), entries)
        self.num_free -= slots.numel()

    def take(self, slots: torch.Tensor, entries: torch.Tensor) -> None:
        """Re-own already-used ``slots`` (victims handed to new entries)."""
        self.owner.index_put_((slots,), entries)

    def release(self, slots: torch.Tensor) -> None:
        """Return unique used ``slots`` to the free bitmap."""
        if slots.numel():
            self.owner.index_fill_(0, slots, -1)
            self.free_bits.add(0, slots)
            self.num_free += slots.numel()


class CapacityError(RuntimeError):
    """A request cannot be satisfied by the pools (working set larger than capacity)."""
