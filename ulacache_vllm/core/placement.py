"""Placement of logical addresses on ranks: DP (every entry local) or TP (``t`` on rank ``t % P``).

A rank's mapping table is indexed by the *local index* ``t // P`` of the entries it owns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_WORLD = 1 << 16  # public packed locations: tier << 48 | rank << 32 | slot


@dataclass(frozen=True)
class Placement:
    kind: str = "dp"  # "dp" | "tp"
    rank: int = 0
    world_size: int = 1

    def __post_init__(self):
        if self.kind not in ("dp", "tp"):
            raise ValueError(f"placement must be 'dp' or 'tp', got {self.kind!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")
        if self.world_size > MAX_WORLD:  # packed locations carry the rank in 16 bits
            raise ValueError(f"world_size {self.world_size} > {MAX_WORLD} ranks")

    @property
    def stride(self) -> int:
        """P in TP mode; 1 in DP mode (each DP rank owns its whole address space)."""
        return self.world_size if self.kind == "tp" else 1

    @property
    def owner_rank(self) -> int:
        return self.rank if self.kind == "tp" else 0

    def num_local(self, num_logical: int) -> int:
        P = self.stride
        return (num_logical - self.owner_rank + P - 1) // P if P > 1 else num_logical

    def owner(self, addrs: torch.Tensor) -> torch.Tensor:
        return addrs % self.stride if self.kind == "tp" else torch.full_like(addrs, self.rank)

    def local(self, addrs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(is_local_mask, local_index)``; -1 padding is never local."""
        P = self.stride
        valid = addrs >= 0
        if P == 1:
            return valid, addrs
        return valid & (addrs % P == self.rank), addrs // P
