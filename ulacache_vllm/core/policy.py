"""Eviction-policy interface shared by PB-LRU and the exact-LRU baselines.

A policy tracks the *occupied* device slots (free slots live in the pool's free bitmap and are
always used first). The mapping calls it with unique slots only.
"""

from __future__ import annotations

import torch

from ulacache_vllm.kernels.reference import SLOT_BITS


class EvictionPolicy:
    name = "base"

    def hit_touch(self, loc_vals: torch.Tensor):
        """Hit detection + touch over internal table values of unique entries.

        Returns ``(hit_mask, slots)`` (slot -1 where not a device hit).
        """
        hit = (loc_vals >> SLOT_BITS) == 0  # -1 (unmapped) >> 32 is -1: no hit
        slots = torch.where(hit, loc_vals, -1)  # tier 0: the value is the slot
        hs = loc_vals.masked_select(hit)
        if hs.numel():
            self.touch(hs)
        return hit, slots

    def touch(self, slots: torch.Tensor) -> None:
        """Mark unique occupied ``slots`` as used in the current round."""
        raise NotImplementedError

    def select_victims(self, k: int) -> torch.Tensor:
        """Remove and return ``k`` occupied slots not used this round, least recent first."""
        raise NotImplementedError

    def release(self, slots: torch.Tensor) -> None:
        """Stop tracking unique ``slots`` (their entries were freed)."""
        raise NotImplementedError

    def advance_round(self) -> None:
        raise NotImplementedError
