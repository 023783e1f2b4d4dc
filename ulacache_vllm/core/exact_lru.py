"""Exact LRU with the PB-LRU interface (``lru="exact_ts"``) and PB-LRU's small-pool path.

``TimestampLRU``: one timestamp per slot, victims by a whole-pool scan (``topk`` smallest), as
the published PB-LRU design compares against; it refuses to evict slots used in the current
round, like PB-LRU. ``SmallPoolScan``: the same scan serving a PB-LRU's small pools.
"""

from __future__ import annotations

import torch

from ulacache_vllm.kernels import reference as K

from .policy import EvictionPolicy
from .pools import CapacityError

_UNTRACKED = torch.iinfo(torch.int64).max


class TimestampLRU(EvictionPolicy):
    name = "exact_ts"

    def __init__(self, num_slots: int, device: torch.device):
        self.device = device
        self.num_slots = num_slots
        # Stamp S is a dummy: the misses of a hit_touch write it, the scan never reads it.
        self._stamps = torch.full((num_slots + 1,), _UNTRACKED, dtype=torch.int64, device=device)
        self.last = self._stamps[:num_slots]
        self.iota = torch.arange(max(num_slots, 1024), dtype=torch.int64, device=device)
        self.tick = 0  # int64 stamps: no wrap-around in any realistic run
        self.round_start = 0

    def _ticks(self, n: int) -> torch.Tensor:
        """``n`` fresh stamps, in order."""
        if self.iota.numel() < n:
            self.iota = torch.arange(max(n, 2 * self.iota.numel()), device=self.iota.device)
        t = self.iota[:n] + self.tick
        self.tick += n
        return t

    def hit_touch(self, loc_vals):
        # No compaction of the hits: every entry gets a stamp, the misses on the dummy.
        hit, idx = K.hit_index(loc_vals, self.num_slots)
        if idx.numel():
            self._stamps.scatter_(0, idx, self._ticks(idx.numel()))
        return hit

    def touch(self, slots):
        n = slots.numel()
        if n:
            # One stamp per slot (exact order within the call, like the linked list); an add +
            # scatter_ from a tensor beats index_fill_ of a scalar stamp from ~1k slots on CPU.
            self.last.scatter_(0, slots, self._ticks(n))

    def select_victims(self, k: int) -> torch.Tensor:
        if k <= 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if k > self.last.numel():
            raise CapacityError(f"need {k} victims from a pool of {self.last.numel()}")
        vals, idx = torch.topk(self.last, k, largest=False, sorted=False)
        if bool((vals >= self.round_start).any()):
            got = int((vals < self.round_start).sum())
            raise CapacityError(
                f"need {k} device victims but only {got} slots are outside the current round "
                "(the round's working set exceeds the device pool)")
        K.fill_at(self.last, idx, _UNTRACKED)
        return idx

    def release(self, slots):
        K.fill_at(self.last, slots, _UNTRACKED)

    def advance_round(self) -> None:
        self.round_start = self.tick

    def bucket_of(self) -> torch.Tensor:
        """Per slot: 1 = used in the current round, 0 = earlier, -1 untracked (tests)."""
        last = self.last
        out = torch.full_like(last, -1)
        tracked = last != _UNTRACKED
        out[tracked] = (last[tracked] >= self.round_start).to(torch.int64)
        return out


class SmallPoolScan(TimestampLRU):
    """A PB-LRU's small-pool path (built by ``policies.make_policy``): the exact timestamp
    scan, one top-k per selection, cheaper than a PB-LRU search for small pools. It keeps the
    requested policy's name; ``victim_path`` says ``"scan"``."""

    victim_path = "scan"

    def __init__(self, num_slots: int, device: torch.device, name: str):
        super().__init__(num_slots, device)
        self.name = name
