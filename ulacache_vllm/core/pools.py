"""Slot pool of one tier (device or host): a stack of free slots plus the reverse map slot -> entry.

Allocation pops the top of the free stack and release pushes onto it: one slice each, so the
cost does not grow with the pool (a first-k search over a packed free bitmap with summary
levels cost ~50 tensor ops per allocation, the largest part of a mapping step). ``owner`` is
the authoritative free map (-1 = free). The reverse map turns a victim slot back into the
logical entry whose mapping must change.
"""

from __future__ import annotations

import torch

from ulacache_vllm.kernels.reference import const


class SlotPool:
    def __init__(self, num_slots: int, device: torch.device):
        self.num_slots = num_slots
        self.device = device
        # Free slots live in stack[:num_free]; the top is popped first. Reversed so that a
        # fresh pool hands out slots 0, 1, 2, ... in order.
        self.stack = torch.arange(num_slots - 1, -1, -1, dtype=torch.int64, device=device)
        self.owner = torch.full((num_slots,), -1, dtype=torch.int64, device=device)
        self.num_free = num_slots

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
        top = self.num_free
        slots = self.stack[top - n:top].flip(0)  # a copy: the stack region is reused later
        self.owner.scatter_(0, slots, entries)
        self.num_free = top - n
        return slots

    def claim(self, slots: torch.Tensor, entries: torch.Tensor) -> None:
        """Take the given free ``slots`` (unique) for ``entries``; raises if any is in use.

        O(free slots): the stack is compacted around them (rare: identity-placement exit).
        """
        n = slots.numel()
        if n == 0:
            return
        if bool((self.owner.index_select(0, slots) >= 0).any()):
            raise CapacityError("claim: some slots are already in use")
        self.owner.scatter_(0, slots, entries)
        free = self.stack[:self.num_free]
        keep = free.masked_select(self.owner.index_select(0, free) < 0)
        self.num_free = keep.numel()
        self.stack[:self.num_free] = keep

    def take(self, slots: torch.Tensor, entries: torch.Tensor) -> None:
        """Re-own already-used ``slots`` (victims handed to new entries)."""
        self.owner.scatter_(0, slots, entries)

    def release(self, slots: torch.Tensor) -> None:
        """Return unique used ``slots`` to the free stack."""
        n = slots.numel()
        if n:
            self.owner.scatter_(0, slots, const(-1, n, self.device))
            top = self.num_free
            self.stack[top:top + n] = slots
            self.num_free = top + n


class CapacityError(RuntimeError):
    """A request cannot be satisfied by the pools (working set larger than capacity)."""
