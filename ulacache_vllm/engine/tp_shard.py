"""TP `shard` mode: MLA rows and indexer keys sharded by token across tensor-parallel ranks.

Logical address ``a`` (vLLM's slot: ``block * block_size + offset``) lives on rank ``a % P``
only, at local address ``a // P``; with ``block_size % P == 0`` the rank of a token is its
position mod P and a block holds ``block_size / P`` local rows per rank, so one block table
serves every rank.

`TPExchange` is the only place ranks talk to each other, over the TP group vLLM built (its
``cpu_group``: gloo on CPU). Every rank issues the same collectives in the same order each
step: per indexer layer one all-gather of top-k candidates; per sparse layer group one
exchange of the remote addresses each rank misses; per layer one exchange of those rows. What
differs per rank (identity placement, settle chunks, capacity errors, buffer hits) never
changes that sequence. With ``lockstep_check`` every exchange first all-gathers a (step, op,
layer) tag and raises on a mismatch instead of hanging.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenShard:
    rank: int
    world: int

    def owned(self, addrs: torch.Tensor) -> torch.Tensor:
        return (addrs >= 0) & (addrs % self.world == self.rank)

    def local(self, addrs: torch.Tensor) -> torch.Tensor:
        """Local address of owned entries, -1 elsewhere."""
        return torch.where(self.owned(addrs), addrs // self.world, torch.full_like(addrs, -1))

    def local_count(self, n: int) -> int:
        """How many of positions 0..n-1 this rank owns."""
        return max(0, (n - self.rank + self.world - 1) // self.world)


class LockstepError(RuntimeError):
    pass


def _gather(out: torch.Tensor, t: torch.Tensor, group) -> None:
    """All-gather of a 1-D tensor into ``out`` (P times as long), rank order."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, t, group=group)


class TPExchange:
    """Collectives of one TP group (``group``: a torch.distributed process group)."""

    OPS = {"candidates": 1, "addresses": 2, "rows": 3}

    def __init__(self, shard: TokenShard, group, lockstep_check: bool = False):
        self.shard = shard
        self.group = group
        self.lockstep_check = lockstep_check
        self.step = 0
        self.rows_fetched = 0
        self.bytes_fetched = 0

    # --------------------------------------------------------------- primitives
    def _check(self, op: str, layer: int) -> None:
        if not self.lockstep_check:
            return
        import torch.distributed as dist

        tag = torch.tensor([self.step, self.OPS[op], layer], dtype=torch.int64)
        tags = torch.empty(self.shard.world * 3, dtype=torch.int64)
        _gather(tags, tag, self.group)
        tags = tags.view(self.shard.world, 3)
        if not bool((tags == tag).all()):
            raise LockstepError(
                f"ulacache TP shard: ranks diverged at rank {self.shard.rank} (step, op, layer) "
                f"= {tag.tolist()}, all ranks: {tags.tolist()} (op codes {self.OPS})")

    def all_gather(self, t: torch.Tensor, op: str = "candidates", layer: int = 0) -> torch.Tensor:
        """[P, *t.shape]: every rank's ``t`` (same shape on every rank)."""
        self._check(op, layer)
        t = t.contiguous()
        out = torch.empty(self.shard.world * t.numel(), dtype=t.dtype, device=t.device)
        _gather(out, t.reshape(-1), self.group)
        return out.view(self.shard.world, *t.shape)

    def _all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]):
        import torch.distributed as dist

        recv = torch.empty((sum(recv_counts), *send.shape[1:]), dtype=send.dtype,
                           device=send.device)
        dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts,
                               group=self.group)
        return recv

    # ---------------------------------------------------------------- exchanges
    def request(self, addrs: torch.Tensor, layer: int = 0):
        """Send each owner the unique remote addresses this rank needs (``addrs``: unique,
        remote, sorted by owner). Returns (addresses the other ranks want from this rank, in
        rank order, and the counts: (sent per owner, received per requester))."""
        P = self.shard.world
        self._check("addresses", layer)
        owners = addrs % P
        send_counts = torch.bincount(owners, minlength=P)
        recv_counts = self._all_to_all(send_counts, [1] * P, [1] * P)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        wanted = self._all_to_all(addrs, sc, rc)
        return wanted, (sc, rc)

    def rows(self, mine: torch.Tensor, counts, layer: int = 0) -> torch.Tensor:
        """Send the rows of the addresses others asked for (``mine``: [sum(rc), row] in the
        order `request` returned them); returns the rows this rank asked for, in its order."""
        sc, rc = counts
        self._check("rows", layer)
        got = self._all_to_all(mine, rc, sc)
        self.rows_fetched += got.shape[0]
        self.bytes_fetched += got.numel() * got.element_size()
        return got


@dataclass
class IndexerShard:
    """What a sharded indexer layer needs, handed to its cache module at registration."""
    shard: TokenShard
    exchange: TPExchange
    layer: int  # the layer's index among the indexer layers (lockstep tags)
