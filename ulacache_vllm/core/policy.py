"""Eviction-policy interface shared by PB-LRU and the exact-LRU baselines.

A policy tracks the *occupied* device slots (free slots live in the pool's free stack and are
always used first). The mapping calls it with unique slots only.
"""

from __future__ import annotations

import torch

from ulacache_vllm.kernels.reference import split_hits

__all__ = ["EvictionPolicy", "split_hits"]


class EvictionPolicy:
    name = "base"

    def hit_touch(self, loc_vals: torch.Tensor):
        """Hit detection + touch over internal table values of unique entries (-1: unmapped);
        returns the hit mask (device entries)."""
        hit, hs = split_hits(loc_vals)
        if hs.numel():
            self.touch(hs)
        return hit

    def touch(self, slots: torch.Tensor) -> None:
        """Mark unique occupied ``slots`` as used in the current round."""
        raise NotImplementedError

    def select_victims(self, k: int) -> torch.Tensor:
        """Remove and return the ``k`` least recently used occupied slots, none used this round
        (PB-LRU's queue and ``ListLRU`` return them least recent first; the timestamp scan's
        top-k returns the same set in no particular order: a sort would cost it O(k log k))."""
        raise NotImplementedError

    def release(self, slots: torch.Tensor) -> None:
        """Stop tracking unique ``slots`` (their entries were freed)."""
        raise NotImplementedError

    def advance_round(self) -> None:
        raise NotImplementedError
