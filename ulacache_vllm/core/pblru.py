"""PB-LRU: parallel bucketed LRU over the device pool of one layer group.

Rows of one ``HierBitmap``: row 0 is the cold bucket, rows 1..R the ring of recent buckets.
Every slot touched in a scheduling round goes into the current ring bucket; advancing the ring
folds the bucket about to be reused into cold (labels only). Victims come from cold, then the
ring oldest to newest, never the current bucket (free slots are taken before the policy is
asked). Hit detection + touch is one kernel; victim search walks the summary levels.
"""

from __future__ import annotations

import torch

from ulacache_vllm import kernels as K

from .bitmaps import HierBitmap
from .policy import EvictionPolicy
from .pools import CapacityError


class PBLRU(EvictionPolicy):
    name = "pblru"

    def __init__(self, num_slots: int, device: torch.device, ring_size: int = 8):
        if ring_size < 1:
            raise ValueError("ring_size must be >= 1")
        self.ring_size = ring_size
        self.device = device
        self.bm = HierBitmap(ring_size + 1, num_slots, device)
        self.cur = 1
        self._dirty = False  # summaries are rebuilt lazily, only when a victim search needs them
        self._set_order()

    def _set_order(self) -> None:
        R, c = self.ring_size, self.cur
        ring = [((c - 1 + i) % R) + 1 for i in range(1, R)]  # oldest .. newest, without current
        self.order = torch.tensor([0] + ring, dtype=torch.int64, device=self.device)

    def hit_touch(self, loc_vals):
        hit, slots = K.hit_touch(loc_vals, self.bm.levels[0], self.cur)
        self._dirty = True
        return hit, slots

    def touch(self, slots):
        if slots.numel():
            m = self.bm.mask(slots)
            w = self.bm.levels[0]
            w &= ~m
            w[self.cur] |= m
            self._dirty = True

    def select_victims(self, k: int) -> torch.Tensor:
        if k <= 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if self._dirty:
            self.bm.rebuild_summaries()
            self._dirty = False
        v = self.bm.first_k(self.order, k)
        if v.numel() < k:
            raise CapacityError(
                f"need {k} device victims but only {v.numel()} slots are outside the current "
                "round (the round's working set exceeds the device pool)")
        self.bm.levels[0] &= ~self.bm.mask(v)
        self._dirty = True
        return v

    def release(self, slots):
        if slots.numel():
            self.bm.levels[0] &= ~self.bm.mask(slots)
            self._dirty = True

    def advance_round(self) -> None:
        nxt = self.cur % self.ring_size + 1
        self.bm.move_all(nxt, 0)  # with ring_size 1, nxt is the current bucket itself
        self.cur = nxt
        self._set_order()

    # Introspection for tests.
    def bucket_of(self) -> torch.Tensor:
        """Row id per slot (-1 if in no bucket); O(S), tests only."""
        S = self.bm.num_slots
        shifts = torch.arange(64, device=self.device, dtype=torch.int64)
        bits = ((self.bm.levels[0][:, :, None] >> shifts) & 1).reshape(self.bm.rows, -1)[:, :S]
        if (bits.sum(0) > 1).any():
            raise AssertionError("slot in more than one bucket")
        has = bits.sum(0) > 0
        return torch.where(has, bits.argmax(0), torch.full((S,), -1, device=self.device))
