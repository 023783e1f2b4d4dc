"""PB-LRU as published: a ring of per-round bucket bitmaps plus one cold bucket.

``lru="pblru_bitmap"``. The default ``lru="pblru"`` (pblru.py) keeps the same rules (victims
never from the current round, oldest rounds first) with one round label per slot instead of
a bitmap per bucket, and ``lru="pblru_queue"`` on a position-ordered queue of touches; this
variant exists to measure those choices against the design they replace
(``benchmarks/pblru_vs_lru.py`` replays all three).

State: one ``HierBitmap`` with ``ring_size`` recent rows and a cold row; row ``round %
ring_size`` is the current bucket. All of it tensor ops:

* touch = build the word mask of the touched slots (one ``index_add_``), clear those bits in
  every row, set them in the current row (a slot sits in exactly one bucket);
* advance_round = the next ring row, which holds slots untouched for ``ring_size`` rounds, is
  folded into cold (an OR of rows: labels only, no slot moves);
* victim selection = first ``k`` members over rows cold, then recent rows oldest to newest,
  never the current one, top-down through the summary levels so empty segments are skipped;
  the victims are then cleared from their rows.

Order inside a bucket is slot order, not touch order, so the hit rate can differ from exact
LRU (the queue variant matches it exactly; the round labels keep every round apart, where
this folds rounds older than the ring into one cold bucket). Summary levels are rebuilt lazily, once before each
search.
"""

from __future__ import annotations

import torch

from ulacache_vllm import kernels as K

from ulacache_vllm.core.bitmaps import HierBitmap
from ulacache_vllm.core.policy import EvictionPolicy
from ulacache_vllm.core.pools import CapacityError


class BitmapPBLRU(EvictionPolicy):
    name = "pblru_bitmap"

    def __init__(self, num_slots: int, device: torch.device, ring_size: int = 8):
        if ring_size < 1:
            raise ValueError("ring_size must be >= 1")
        self.device = torch.device(device)
        self.num_slots = num_slots
        self.ring_size = R = ring_size
        self.cold = R
        self.bm = HierBitmap(R + 1, num_slots, self.device)
        self.round = 0
        # Search order per current row: cold, then the other recent rows oldest to newest.
        self._orders = [torch.tensor([R] + [(c + i) % R for i in range(1, R)], dtype=torch.int64,
                                     device=self.device) for c in range(R)]
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)

    @property
    def current(self) -> int:
        return self.round % self.ring_size

    def touch(self, slots):
        self.bm.move_to(self.current, slots)

    def release(self, slots):
        self.bm.remove(slots)

    def select_victims(self, k: int) -> torch.Tensor:
        if k <= 0:
            return self._empty
        vic = self.bm.first_k(self._orders[self.current], k)
        if vic.numel() < k:
            raise CapacityError(
                f"need {k} device victims but only {vic.numel()} slots are outside the current "
                "round (the round's working set exceeds the device pool)")
        self.bm.remove(vic)
        return vic

    def advance_round(self) -> None:
        self.round += 1
        self.bm.move_all(self.current, self.cold)

    def bucket_of(self) -> torch.Tensor:
        """Per slot: 1 = current round's bucket, 0 = an older bucket, -1 untracked (O(S), tests)."""
        S = self.num_slots
        rows = [K.reference.unpack_bits(self.bm.words[r])[:S] for r in range(self.ring_size + 1)]
        count = torch.stack(rows).to(torch.int64).sum(0)
        if bool((count > 1).any()):
            raise AssertionError("a slot is in two buckets")
        out = torch.full((S,), -1, dtype=torch.int64, device=self.device)
        out[count > 0] = 0
        out[rows[self.current]] = 1
        return out
