"""Exact LRU on an O(1)-per-slot doubly linked list (CPython's ``OrderedDict``, a C linked
list + hash: vLLM's free-block queue done in C), with the PB-LRU interface: a benchmark
baseline. Refuses to evict slots used in the current round, like PB-LRU."""
from __future__ import annotations

from collections import OrderedDict

import torch

from ulacache_vllm.core.policy import EvictionPolicy
from ulacache_vllm.core.pools import CapacityError


class ListLRU(EvictionPolicy):
    name = "exact_list"

    def __init__(self, num_slots: int, device: torch.device):
        self.device = device
        self.od: OrderedDict[int, int] = OrderedDict()  # slot -> round of last use, LRU first
        self.round = 0

    def touch(self, slots):
        od, r = self.od, self.round
        mte = od.move_to_end
        for s in slots.tolist():
            od[s] = r
            mte(s)

    def select_victims(self, k: int) -> torch.Tensor:
        od, out = self.od, []
        popitem = od.popitem
        try:
            for _ in range(k):
                s, r = popitem(last=False)
                out.append((s, r))
                if r == self.round:
                    raise CapacityError(f"need {k} device victims outside the current round")
        except (KeyError, CapacityError) as e:
            for s, r in reversed(out):  # restore the queue before failing
                od[s] = r
                od.move_to_end(s, last=False)
            if isinstance(e, KeyError):
                raise CapacityError(f"need {k} victims, only {len(out)} tracked") from None
            raise
        return torch.tensor([s for s, _ in out], dtype=torch.int64, device=self.device)

    def release(self, slots):
        pop = self.od.pop
        for s in slots.tolist():
            pop(s, None)

    def advance_round(self) -> None:
        self.round += 1
