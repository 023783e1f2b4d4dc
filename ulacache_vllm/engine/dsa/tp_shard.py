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
mismatch instead of hanging.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ulacache_vllm.core.placement import TokenShard
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


class ShardedRows:
    """The TP shard mode half of `store.UlaWorkerStore` (mixed into it; every attribute is
    the store's): the remote-row buffer's settle, a group's read of remote rows (buffer
    lookups, the step's miss plan, the row all-gather; the translator delegates here), and
    the switch between replicated rows (while every live address fits one rank's pool) and
    shards."""

    def _settle_remote(self, g: _Group, sel: torch.Tensor, freed: torch.Tensor | None) -> None:
        """TP shard mode: the previous step's reads of ``g`` update the buffer directory the
        same way on every rank (hits touched, fetched rows kept unless freed since); this rank
        copies in the kept rows it does not own. The read's misses and their places in the
        gathered rows are the ones `_remote_read` recorded (no second lookup decides them)."""
        with self.exchange.timed("x_settle"):
            sh = self.shard
            fetched, index = g.fetch_addrs, g.fetch_index
            if fetched is None:  # a read without a plan (nothing to insert)
                fetched = index = sel.new_empty(0)
            elif freed is not None and fetched.numel():
                # Freed since the read (this step's frees ran first): not live on any rank.
                live = self.glive.index_select(0, fetched)
                fetched, index = fetched.masked_select(live), index.masked_select(live)
            keep, slots = g.remote.settle_read(sel, fetched)
            n = keep.numel()
            if not n:
                return
            # keep is a prefix of fetched; index[:n] are its rows in the gathered payload.
            mine = keep.numpy() % sh.world != sh.rank
            slots = torch.from_numpy(slots.numpy()[mine])
            pos = torch.from_numpy(index.numpy()[:n][mine])
            if slots.numel():
                rows = slots + self.remote_base
                with self.timed("copy"):
                    for name in g.layers:  # as whole words (`_wide`), ~6x uint8's speed on CPU
                        self._wide(self.device_bytes[name]).index_copy_(
                            0, rows, self._wide(g.fetched[name]).index_select(0, pos))

    def _remote_read(self, g: _Group, logical: torch.Tensor, dev: torch.Tensor):
        """Resolve's TP half (`GroupTranslator._remote`): remote rows in the buffer read as
        device rows; the others are this step's misses, which every rank knows alike (same
        selection, same directory): each owner sends its own in one all-gather per layer
        (`_remote_rows`). Returns (device rows, ids into the gathered rows).

        Shard mode runs on CPU tensors only (the CUDA glue refuses it): the lookups and the
        plan are one compiled pass over numpy views (`kernels.shard_cpu`)."""
        sh, ex = self.shard, self.exchange
        with ex.timed("x_lookup"), self.timed("exchange"):
            shape = logical.shape
            lg = np.ascontiguousarray(logical.numpy().reshape(-1), dtype=np.int64)
            dv = np.ascontiguousarray(dev.numpy().reshape(-1), dtype=np.int64)
            (dev_out, ids, u, index, mine, n_valid, n_held, nhit, nmiss,
             width) = self.read_plan(lg, g.remote.table.numpy(), dv, sh.rank, sh.world,
                                      self.remote_base)
            # The fill control's figures are the same on every rank (own entries included).
            g.remote.note_read(n_valid, n_held)
            self.counters.remote_lookups += nhit + nmiss
            self.counters.remote_hits += nhit
            mine = torch.from_numpy(mine)
            if self.identity:
                serve = (mine, None)
            else:
                d, h = g.mapping.locate(mine)
                serve = (d, h if bool((h >= 0).any()) else None)
        g.fetch_addrs, g.fetch_index = torch.from_numpy(u), torch.from_numpy(index)
        g.serve, g.width = serve, int(width)
        return torch.from_numpy(dev_out).view(shape), torch.from_numpy(ids).view(shape)

    def _remote_rows(self, g: _Group, layer_name: str) -> torch.Tensor:
        """This layer's rows of the group's misses (`GroupTranslator._fetch_rows`): every
        owner contributes its own, padded to the widest share, in one all-gather (skipped on
        every rank when nothing missed)."""
        head = self.layout.mla_head_size
        if g.width == 0:
            return torch.empty(0, head, dtype=self.dtype, device=self.device)
        d, h = g.serve
        rb = self.layout.mla_row_bytes[layer_name]
        with self.timed("exchange"):
            mine = torch.empty(g.width, rb, dtype=torch.uint8, device=self.device)
            n = d.numel()
            if n < g.width:
                mine[n:].zero_()  # padding: defined bytes
            if n:
                # Rows as whole words (`_wide`), gathered straight into the send buffer.
                w = self._wide(mine)[:n]
                torch.index_select(self._wide(self.device_bytes[layer_name]), 0,
                                   d.clamp(min=0), out=w)
                if h is not None:
                    on_host = h >= 0
                    hb = self._wide(self.host_bytes[layer_name]).index_select(
                        0, h.masked_select(on_host)).to(w.device)
                    w[on_host] = hb
            got = self.exchange.all_gather(mine, "rows", self.layer_index[layer_name])
        got = got.view(-1, rb)
        g.fetched[layer_name] = got
        others = g.fetch_addrs.numel() - n
        self.counters.remote_rows_fetched += others
        self.counters.remote_bytes_fetched += others * rb
        return got.view(self.dtype).view(got.shape[0], head)

    def replica_view(self, name: str) -> torch.Tensor | None:
        """While replicated: indexer layer ``name``'s cache viewed with whole blocks
        ([blocks, block_size, width], logical address = row), else None."""
        if not self.replicas:
            return None
        t = self.indexer_caches[name]
        bs, width = self.layout.block_size, t.shape[-1]
        n = self.replica_limit // bs * bs
        return t.view(-1)[: n * width].view(-1, bs, width)

    def _end_replicas(self) -> None:
        """Replicated rows -> shards, on every rank at the same step: this rank's tokens move
        to their local addresses (device row and indexer key; local identity placement), the
        others' rows are dropped."""
        from .cpu_indexer import _cache_views

        sh, bs = self.shard, self.layout.block_size
        live = torch.nonzero(self.glive).flatten()
        # (This step's new addresses are already marked live; those past the limit have no
        # row yet and are placed by the step's writes.)
        own = live[sh.owned(live) & (live < self.replica_limit)]
        local = own // sh.world
        with self.timed("copy"):
            for name in self.layout.mla_layers:
                d = self._wide(self.device_bytes[name])
                d.index_copy_(0, local, d.index_select(0, own))
            for name in self.indexer_caches:
                rv, rs = _cache_views(self.replica_view(name))
                lv, ls = _cache_views(self.indexer_caches[name])
                vals = rv[own // bs, own % bs].clone()
                scales = rs[own // bs, own % bs].clone()
                lbs = bs // sh.world
                lv[local // lbs, local % lbs] = vals
                ls[local // lbs, local % lbs] = scales
        self.replicas = False
        self.identity = True
        self.live.zero_()
        self.live.index_fill_(0, local, True)
        self.counters.replica_exits += 1
        for g in self.groups:
            if g.write_key is not None:  # an earlier group's writes of this step: re-assign
                key = g.write_key
                g.write_key = None
                self._prepare_writes(g, key)

    def _start_replicas(self) -> None:
        """Everything freed on every rank: back to replicated rows."""
        self.replicas = True
        self.identity = True
        self.live.zero_()
        for g in self.groups:
            g.selected.clear()
