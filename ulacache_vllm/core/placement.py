"""Token placement under TP shard mode: logical address ``a`` lives on rank ``a % P`` only,
at local address ``a // P`` (the one implementation of the rule; the engine's store, indexer
and exchange all use it). -1 (padding) is never owned.

With ``block_size % P == 0`` the rank of a token is its position mod P and a block holds
``block_size / P`` local rows per rank, so one block table serves every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenShard:
    rank: int
    world: int

    def __post_init__(self):
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} outside a world of {self.world}")

    def owned(self, addrs: torch.Tensor) -> torch.Tensor:
        return (addrs >= 0) & (addrs % self.world == self.rank)

    def local(self, addrs: torch.Tensor) -> torch.Tensor:
        """Local address of owned entries, -1 elsewhere."""
        return torch.where(self.owned(addrs), addrs // self.world, torch.full_like(addrs, -1))

    def local_count(self, n: int) -> int:
        """How many of positions 0..n-1 this rank owns."""
        return max(0, (n - self.rank + self.world - 1) // self.world)
