"""TP `shard` mode: MLA rows and indexer keys sharded by token across tensor-parallel ranks.

Logical address ``a`` (vLLM's slot: ``block * block_size + offset``) lives on rank ``a % P``
only (`ulacache_vllm.core.placement.TokenShard`).

`TPExchange` is the only place ranks talk to each other, over the TP group vLLM built
(shared memory for small payloads, its gloo ``cpu_group`` otherwise). Every rank issues the
same collectives in the same order each step: per indexer layer one all-gather of top-k
candidates; per layer, when the step misses any row, one all-gather of the missed rows, each
owner contributing its own. Which rows are missed is known on every rank without asking: the
selection is identical on all ranks and the buffer of fetched rows is a directory every rank
keeps identically (`RemoteRowBuffer(replicated=True)`). What differs per rank (identity
placement, settle chunks, capacity errors) never changes that sequence. With
``lockstep_check`` every exchange first all-gathers a (step, op, layer) tag and raises on a
mismatch instead of hanging. The worker store's rows in shard mode: `sharded_rows.ShardedRows`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ulacache_vllm.core.placement import TokenShard  # (re-exported)
from .counters import Timer


class LockstepError(RuntimeError):
    pass


def _gather(out: torch.Tensor, t: torch.Tensor, group) -> None:
    """All-gather of a 1-D tensor into ``out`` (P times as long), rank order."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, t, group=group)


class TPExchange:
    """Collectives of one TP group: ``group`` (a torch.distributed process group: the TP
    group's gloo ``cpu_group`` on CPU) and optionally ``fast_gather(out, t)``, an all-gather
    of float32 tensors over shared memory (vLLM's CPU SHM communicator), used up to
    ``fast_max_bytes`` per rank."""

    OPS = {"candidates": 1, "rows": 3}

    def __init__(self, shard: TokenShard, group, lockstep_check: bool = False,
                 fast_gather=None, fast_max_bytes: int = 1 << 20):
        self.shard = shard
        self.group = group
        self.lockstep_check = lockstep_check
        self.fast_gather = fast_gather
        self.fast_max_bytes = fast_max_bytes
        self.step = 0
        self.gathers = 0
        # Wall seconds per part of the exchange, summed over steps (the worker's stats merge
        # them into the store's ``time_s``): the indexer's candidate all-gathers and the row
        # all-gathers (the collectives, waiting for the slowest rank included), each group
        # read's buffer lookups and miss plan, and the settle of the buffer.
        self.time_s = {"x_candidates": 0.0, "x_rows": 0.0, "x_lookup": 0.0, "x_settle": 0.0}

    def timed(self, key: str) -> Timer:
        return Timer(self.time_s, key)

    def _check(self, op: str, layer: int) -> None:
        if not self.lockstep_check:
            return
        tag = torch.tensor([self.step, self.OPS[op], layer], dtype=torch.int64)
        tags = torch.empty(self.shard.world * 3, dtype=torch.int64)
        _gather(tags, tag, self.group)
        tags = tags.view(self.shard.world, 3)
        if not bool((tags == tag).all()):
            raise LockstepError(
                f"ulacache TP shard: ranks diverged at rank {self.shard.rank} (step, op, layer) "
                f"= {tag.tolist()}, all ranks: {tags.tolist()} (op codes {self.OPS})")

    def all_gather(self, t: torch.Tensor, op: str = "candidates", layer: int = 0) -> torch.Tensor:
        """[P, *t.shape]: every rank's ``t`` (same shape and dtype on every rank). Bytes travel
        verbatim (a non-float32 payload is viewed as float32 words)."""
        self._check(op, layer)
        t = t.contiguous()
        flat = t.reshape(-1)
        words = flat.view(torch.float32) if flat.dtype != torch.float32 else flat
        out = torch.empty(self.shard.world * words.numel(), dtype=torch.float32,
                          device=t.device)
        with Timer(self.time_s, "x_rows" if op == "rows" else "x_candidates"):
            if self.fast_gather is not None and words.numel() * 4 <= self.fast_max_bytes:
                self.fast_gather(out, words)
            else:
                _gather(out, words, self.group)
        self.gathers += 1
        return out.view(t.dtype).view(self.shard.world, *t.shape)


@dataclass
class IndexerShard:
    """What a sharded indexer layer needs, handed to its cache module at registration."""
    shard: TokenShard
    exchange: TPExchange
    layer: int  # the layer's index among the indexer layers (lockstep tags)
    # replicas(layer name): while the store keeps replicas, this layer's cache viewed with
    # whole blocks (score every key locally, no exchange), else None.
    replicas: object = None
