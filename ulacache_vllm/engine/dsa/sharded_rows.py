"""TP shard mode's half of the DSA worker store (`ShardedRows`, a part the store owns when
``exchange`` spans P > 1 ranks): this rank's share of the indexer keys, the map of every live
logical address (the same on every rank), the remote-row buffer's settle, a group's read of
remote rows (buffer lookups, the step's miss plan, the row all-gather; the translator reads
through it), and the replicated rows' view and exit (while every live address fits one rank's
pool, every rank keeps every row and key at its logical address: `StoreState.replicas`).

Shard mode runs on CPU tensors only (the CUDA glue refuses it): the lookups and the miss plan
are one compiled pass over numpy views (`kernels.shard_cpu`).
"""
from __future__ import annotations

import numpy as np
import torch

from .layout import DsaLayout
from .rows import RowPools, wide
from .state import LayerGroup, StoreState
from .tp_shard import TPExchange


class ShardedRows:
    def __init__(self, layout: DsaLayout, state: StoreState, pools: RowPools,
                 exchange: TPExchange):
        from ulacache_vllm.kernels import shard_cpu

        shard_cpu.warm_up()  # compiled (or loaded from numba's cache) before a forward
        self.read_plan = shard_cpu.shard_read_plan
        self.layout, self.state, self.pools, self.exchange = layout, state, pools, exchange
        self.shard = sh = exchange.shard
        device = pools.device
        bs, P = layout.block_size, sh.world
        self.layer_index = {n: i for i, n in enumerate(layout.mla_layers)}  # lockstep tags
        # The rank's share of the indexer keys, in vLLM's per-block layout with
        # block_size / P rows per block (the store installs them in place of vLLM's).
        self.indexer_caches: dict[str, torch.Tensor] = {
            name: torch.zeros(layout.num_blocks, bs // P, width, dtype=torch.uint8,
                              device=device)
            for name, width in layout.indexer_layers.items()}
        rblocks = layout.num_blocks * (bs // P) // bs  # blocks of bs rows in a local cache
        # Replicas are kept while every live address is below this limit.
        self.replica_limit = min(layout.device_slots, rblocks * bs) // bs * bs
        # Every live logical address, on every rank alike (each rank sees every write and free).
        self.glive = torch.zeros(layout.num_blocks * bs, dtype=torch.bool, device=device)
        self.glive_count = 0

    # ------------------------------------------------------------ live addresses
    def note_writes(self, slot_mapping: torch.Tensor) -> None:
        """This step's written logical addresses are live (once a step, any group's)."""
        valid = slot_mapping.reshape(-1).long()
        valid = valid[valid >= 0]
        self.glive_count += int((~self.glive.index_select(0, valid)).sum())
        self.glive.index_fill_(0, valid, True)

    def note_frees(self, addrs: torch.Tensor) -> None:
        self.glive_count -= int(self.glive.index_select(0, addrs).sum())
        self.glive.index_fill_(0, addrs, False)

    # ------------------------------------------------------------ remote rows
    def settle(self, g: LayerGroup, sel: torch.Tensor, freed: torch.Tensor | None) -> None:
        """The previous step's reads of ``g`` update the buffer directory the same way on every
        rank (hits touched, fetched rows kept unless freed since); this rank copies in the kept
        rows it does not own. The read's misses and their places in the gathered rows are the
        ones `read` recorded (no second lookup decides them)."""
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
                rows = slots + self.pools.remote_base
                with self.state.timed("copy"):
                    for name in g.layers:  # as whole words (`wide`), ~6x uint8's speed on CPU
                        wide(self.pools.device_bytes[name]).index_copy_(
                            0, rows, wide(g.fetched[name]).index_select(0, pos))

    def read(self, g: LayerGroup, logical: torch.Tensor, dev: torch.Tensor):
        """Resolve's TP half (`GroupTranslator.resolve`): remote rows in the buffer read as
        device rows; the others are this step's misses, which every rank knows alike (same
        selection, same directory): each owner sends its own in one all-gather per layer
        (`rows`). Returns (device rows, ids into the gathered rows)."""
        sh, ex, st = self.shard, self.exchange, self.state
        with ex.timed("x_lookup"), st.timed("exchange"):
            shape = logical.shape
            lg = np.ascontiguousarray(logical.numpy().reshape(-1), dtype=np.int64)
            dv = np.ascontiguousarray(dev.numpy().reshape(-1), dtype=np.int64)
            (dev_out, ids, u, index, mine, n_valid, n_held, nhit, nmiss,
             width) = self.read_plan(lg, g.remote.table.numpy(), dv, sh.rank, sh.world,
                                      self.pools.remote_base)
            # The fill control's figures are the same on every rank (own entries included).
            g.remote.note_read(n_valid, n_held)
            st.counters.remote_lookups += nhit + nmiss
            st.counters.remote_hits += nhit
            mine = torch.from_numpy(mine)
            if st.identity:
                serve = (mine, None)
            else:
                d, h = g.mapping.locate(mine)
                serve = (d, h if bool((h >= 0).any()) else None)
        g.fetch_addrs, g.fetch_index = torch.from_numpy(u), torch.from_numpy(index)
        g.serve, g.width = serve, int(width)
        return torch.from_numpy(dev_out).view(shape), torch.from_numpy(ids).view(shape)

    def rows(self, g: LayerGroup, layer_name: str) -> torch.Tensor:
        """This layer's rows of the group's misses (`GroupTranslator.staged_rows`): every
        owner contributes its own, padded to the widest share, in one all-gather (skipped on
        every rank when nothing missed)."""
        lay, pools, st = self.layout, self.pools, self.state
        head = lay.mla_head_size
        if g.width == 0:
            return torch.empty(0, head, dtype=pools.dtype, device=pools.device)
        d, h = g.serve
        rb = lay.mla_row_bytes[layer_name]
        with st.timed("exchange"):
            mine = torch.empty(g.width, rb, dtype=torch.uint8, device=pools.device)
            n = d.numel()
            if n < g.width:
                mine[n:].zero_()  # padding: defined bytes
            if n:
                # Rows as whole words (`wide`), gathered straight into the send buffer.
                w = wide(mine)[:n]
                torch.index_select(wide(pools.device_bytes[layer_name]), 0,
                                   d.clamp(min=0), out=w)
                if h is not None:
                    on_host = h >= 0
                    hb = wide(pools.host_bytes[layer_name]).index_select(
                        0, h.masked_select(on_host)).to(w.device)
                    w[on_host] = hb
            got = self.exchange.all_gather(mine, "rows", self.layer_index[layer_name])
        got = got.view(-1, rb)
        g.fetched[layer_name] = got
        others = g.fetch_addrs.numel() - n
        st.counters.remote_rows_fetched += others
        st.counters.remote_bytes_fetched += others * rb
        return got.view(pools.dtype).view(got.shape[0], head)

    # ------------------------------------------------------------ replicas
    def replica_view(self, name: str) -> torch.Tensor | None:
        """While replicated: indexer layer ``name``'s cache viewed with whole blocks
        ([blocks, block_size, width], logical address = row), else None."""
        if not self.state.replicas:
            return None
        t = self.indexer_caches[name]
        bs, width = self.layout.block_size, t.shape[-1]
        n = self.replica_limit // bs * bs
        return t.view(-1)[: n * width].view(-1, bs, width)

    def localize(self) -> torch.Tensor:
        """The rows' half of the exit from replicas (`Residency`, on every rank at the same
        step, while still replicated): this rank's live tokens move to their local addresses
        (device row and indexer key); the others' rows are left behind. Returns the local
        addresses of the moved tokens."""
        from .cpu_indexer import cache_views

        sh, bs = self.shard, self.layout.block_size
        live = torch.nonzero(self.glive).flatten()
        # (This step's new addresses are already marked live; those past the limit have no
        # row yet and are placed by the step's writes.)
        own = live[sh.owned(live) & (live < self.replica_limit)]
        local = own // sh.world
        with self.state.timed("copy"):
            for name in self.layout.mla_layers:
                d = wide(self.pools.device_bytes[name])
                d.index_copy_(0, local, d.index_select(0, own))
            for name in self.indexer_caches:
                rv, rs = cache_views(self.replica_view(name))
                lv, ls = cache_views(self.indexer_caches[name])
                vals = rv[own // bs, own % bs].clone()
                scales = rs[own // bs, own % bs].clone()
                lbs = bs // sh.world
                lv[local // lbs, local % lbs] = vals
                ls[local // lbs, local % lbs] = scales
        return local
