"""Eviction-policy interface shared by PB-LRU and the exact-LRU baselines.

A policy tracks the *occupied* device slots (free slots live in the pool's free stack and are
always used first). The mapping calls it with unique slots only.
"""

from __future__ import annotations

import os

import torch

from ulacache_vllm.kernels.reference import split_hits

__all__ = ["EvictionPolicy", "split_hits", "small_pool_threshold"]

SMALL_POOL_ENV = "ULACACHE_PBLRU_SMALL_POOL_SLOTS"  # overrides a PB-LRU's default, read per policy


class EvictionPolicy:
    name = "base"

    @property
    def victim_path(self) -> str:
        """How victims are found (reported by the engine); a policy's name unless it has
        several paths."""
        return self.name

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
        (the queue PB-LRU and ``ListLRU`` return them least recent first; PB-LRU by round of
        last use, then slot, so within a round it may pick other slots than an exact LRU; the
        timestamp scan's top-k returns the exact LRU set in no particular order: a sort would
        cost it O(k log k))."""
        raise NotImplementedError

    def release(self, slots: torch.Tensor) -> None:
        """Stop tracking unique ``slots`` (their entries were freed)."""
        raise NotImplementedError

    def advance_round(self) -> None:
        raise NotImplementedError


def small_pool_threshold(default: int) -> int:
    """The small-pool threshold in force: ``$ULACACHE_PBLRU_SMALL_POOL_SLOTS`` (read when a
    policy is built, so a process may change it) or the policy's ``default``."""
    v = os.environ.get(SMALL_POOL_ENV)
    if v is None or v.strip() == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{SMALL_POOL_ENV} must be an integer number of slots, got {v!r}") from None
