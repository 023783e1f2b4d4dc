"""Worker-side ulacache store: byte-row device and host pools of sparse-MLA rows, one mapping
table per layer group, and the worker contract the sparse-MLA backend runs.

A layer group is the layers sharing one top-k (a layer with an indexer plus the layers that
reuse its selection); it owns one `TieredMapping`, and a token's rows of every layer in the
group share one device slot (or host slot). Pools hold byte rows (`uint8 [rows, row_bytes]`,
viewed in the KV dtype by attention), so every move copies rows verbatim whatever their format.

The worker contract, stated once (`tests/test_worker_store.py` checks each clause):

* **Outside the forward** (`begin_step`, called from the connector's pre-forward hook), all the
  work that needs the host, in this order:
  1. *frees*: the logical blocks the scheduler released leave the tables;
  2. *settle*: the addresses each group's attention selected in the previous step are made
     device-resident (`ensure_resident`: hits are touched in the round they were read in,
     host rows read in ``settings.promote_after`` steps in a row are promoted, victims
     demoted; the other host rows stay where they are, read there again if selected again);
     if that working set exceeds the device pool, a prefix is promoted and the rest stays on
     the host, staged again when read;
  3. *round*: the LRU rings advance;
  4. *writes*: this step's new rows get device slots (`assign`, demoting victims) and the
     translated write rows are fixed for the forward.
  Under mapped placement, a group with both a selection to settle and rows to write does 2-4 as
  one move plan (`TieredMapping.settle_and_assign`: one victim selection, one set of copies;
  ``counters.merged_plans``), and one by one where that plan does not apply.
  Every move follows `TieredMapping.apply`'s rule: copy the bytes, then commit the mapping.
* **Inside the forward**, per layer group, fixed-shape tensor work only (no host reads, no
  moves, no data-dependent shapes): *resolve* maps each selected logical address through the
  committed table to a device row or a host row (one gather) and logs the selection for
  *settle*; *stage* gathers the host rows' bytes beside the device rows (attention's gather
  reads `[staging | device pool]`); *attend*. Writes go to the rows fixed in step 4; padding
  writes go to a trash row past the pool. Where both pools live in the same memory (the CPU
  build: ``host_in_view``), one tensor holds them, attention's view spans both, and resolve
  reads a host row as row ``host_base + host slot`` of that view: nothing is staged.
* Exception: a layer whose write slots were not in the pre-forward context (an MTP draft layer
  writes in the drafter's own forward) assigns them on first use, inside that forward.
* A failed copy (`moves.TierMoves.apply`) never kills the engine and is never read: the
  move's entries are dropped from the tables, their logical blocks are reported to the
  scheduler as KV load errors (the connector's `get_block_ids_with_load_errors`), and vLLM
  ends the requests that own them with an error. This step's new entries hold no data yet and
  are assigned again. Tests inject such failures and stalls through `faults.MoveFaults` (off
  by default).

TP shard mode (``exchange`` given, P > 1): this rank owns the logical addresses ``a % P ==
rank`` and maps them at local address ``a // P``; the group's other selected rows come from
their owners (`sharded_rows.ShardedRows.read`, `.rows`) through a buffer directory every rank
keeps alike. While every live address fits one rank's device pool, every rank keeps replicas
instead (``replicas``: rows and keys at their logical addresses, no exchange).

Fast path (identity placement): while every written logical address is below the device pool
size and nothing has ever been demoted, logical slot == device slot and nothing is translated.
The first step writing beyond the device range adopts the live addresses into the mapping
tables (in place, nothing moves) and the store stays mapped until every entry is freed again.

Parts (composed, each given what it reads through its constructor; none calls another's
private methods): `state` (the records they share: `LayerGroup`, `StoreState`), `rows` (the
pools), `moves` (copies between tiers, failed copies), `residency` (settle, writes, the mode
switches a write triggers), `sharded_rows` (TP shard mode's rows and live map), `translator`
(the forward half). `UlaWorkerStore` builds them, runs the pre-forward half (`begin_step`:
frees, then the parts in order) and reports pools and counters.
"""
from __future__ import annotations

import torch

from ulacache_vllm.core.mapping import TieredMapping
from ulacache_vllm.core.remote_buffer import RemoteRowBuffer

from ..config import UlaSettings
from .counters import StoreCounters, Timer
from .layout import DsaLayout
from .moves import TierMoves
from .residency import Residency
from .rows import RowPools
from .sharded_rows import ShardedRows
from .state import LayerGroup, StoreState
from .tp_shard import IndexerShard, TokenShard, TPExchange
from .trace import StepTrace
from .translator import GroupTranslator


class UlaWorkerStore:
    def __init__(self, layout: DsaLayout, settings: UlaSettings, layers: dict,
                 device: torch.device, trace_file: str | None = None,
                 exchange: TPExchange | None = None, host_in_view: bool | None = None):
        self.layout = layout
        self.settings = settings
        self.device = device
        bs = layout.block_size
        # TP shard mode: this rank owns logical addresses a % P == rank, at local a // P.
        self.exchange = exchange if exchange is not None and exchange.shard.world > 1 else None
        self.shard: TokenShard | None = self.exchange.shard if self.exchange else None
        P = self.shard.world if self.shard else 1
        self.num_local = layout.num_blocks * bs // P
        self.pools = pools = RowPools(layout, device,
                                      layout.remote_slots if self.shard else 0, host_in_view)
        for name in layout.mla_layers:
            # Attention and writes see the pool(s) in vLLM's [blocks, block, head] shape.
            layers[name].kv_cache = pools.kv_views[name]
        self.host_in_view, self.host_base = pools.host_in_view, pools.host_base
        self.host_rows = pools.host_rows
        self.fast_path = settings.fast_path
        # TP shard mode starts replicated (while every live address is below the replica
        # limit, every rank keeps every token's row and key at its logical address: no
        # exchange at all, as stock vLLM); the first write past the limit turns the rows into
        # shards on every rank at the same step, and freeing everything turns them back.
        # Trace: truncated, one file holds one run (two runs' steps would merge on replay).
        self.state = state = StoreState(
            self.num_local, device, StepTrace.open(trace_file, layout.num_blocks * bs),
            identity=settings.fast_path, replicas=bool(self.shard) and settings.fast_path)
        self.sharded: ShardedRows | None = None
        if self.shard:
            self.sharded = ShardedRows(layout, state, pools, self.exchange)
            for i, (name, t) in enumerate(self.sharded.indexer_caches.items()):
                layers[name].kv_cache = t  # (vLLM allocated a placeholder)
                layers[name].token_shard = IndexerShard(self.shard, self.exchange, i,
                                                        replicas=self.sharded.replica_view)
        self.moves = TierMoves(layout, pools, state, self.shard)
        self.groups: list[LayerGroup] = []
        self.group_of: dict[str, LayerGroup] = {}
        current: list[str] = []
        for name in layout.mla_layers:
            if name in layout.leaders and current:
                self._add_group(current)
                current = []
            current.append(name)
        self._add_group(current)
        self.residency = Residency(layout, state, pools, self.moves, self.groups, self.sharded)
        self._taken = StoreCounters()  # counters already reported (see totals)
        self._last_report = 0
        self.translators: dict[str, GroupTranslator] = {}
        for g in self.groups:
            t = GroupTranslator(g, state, pools, self.residency, self.sharded)
            for name in g.layers:
                self.translators[name] = t
                # The corridor: each sparse-MLA impl gets its layer's translator explicitly.
                layers[name].impl.translator = t
                layers[name].impl.layer_name = name

    def _add_group(self, names: list[str]) -> None:
        lay = self.layout
        m = TieredMapping(self.num_local, lay.device_slots, lay.host_slots,
                          device=self.device, lru=self.settings.lru,
                          promote_after=self.settings.promote_after)
        g = LayerGroup(len(self.groups), list(names), m,
                       sum(lay.mla_row_bytes[n] for n in names))
        if self.shard:
            g.remote = RemoteRowBuffer(lay.num_blocks * lay.block_size, lay.remote_slots,
                                       rank=self.shard.rank, world_size=self.shard.world,
                                       device=self.device, lru=self.settings.lru,
                                       replicated=True,
                                       min_hit_rate=self.settings.remote_buffer_min_hit_rate)
        self.groups.append(g)
        for n in names:
            self.group_of[n] = g

    # ------------------------------------------------- the state, read through the store
    @property
    def step(self) -> int:
        return self.state.step

    @property
    def identity(self) -> bool:
        return self.state.identity

    @property
    def replicas(self) -> bool:
        return self.state.replicas

    @property
    def replica_limit(self) -> int:
        return self.sharded.replica_limit if self.sharded is not None else 0

    @property
    def counters(self) -> StoreCounters:
        return self.state.counters

    @property
    def time_s(self) -> dict[str, float]:
        return self.state.time_s

    @property
    def trace(self) -> StepTrace:
        return self.state.trace

    @property
    def faults(self):
        """Test-only fault injection of the moves (`faults.MoveFaults`; None by default)."""
        return self.moves.faults

    @faults.setter
    def faults(self, value) -> None:
        self.moves.faults = value

    @property
    def lost_entries(self) -> int:
        return self.moves.lost_entries

    def take_lost_blocks(self) -> set[int]:
        return self.moves.take_lost_blocks()

    def timed(self, key: str) -> Timer:
        """Adds the wall time of a ``with`` block to ``time_s[key]`` (`StoreState.timed`)."""
        return self.state.timed(key)

    # ------------------------------------------------------- outside the forward
    def begin_step(self, freed_blocks: list[int], slot_mappings: dict | None = None) -> None:
        """The pre-forward half of the contract: frees, settle, round, writes (module doc).
        ``slot_mappings``: this step's write slots per layer name (vLLM's forward context)."""
        st = self.state
        with st.timed("begin"):
            st.step += 1
            if self.exchange is not None:
                self.exchange.step = st.step
            freed = self._free(freed_blocks)
            writes = slot_mappings or {}
            deferred: dict[int, torch.Tensor] = {}  # settled with the writes, one plan
            for g in self.groups:
                sel = torch.cat([x.reshape(-1) for x in g.selected]) if g.selected else None
                if g.remote is not None:
                    if sel is not None:
                        if g.remote.fill_due():
                            self.sharded.settle(g, sel, freed)
                        else:  # reads seldom hit the buffer: keep it as it is
                            st.counters.remote_fill_skips += 1
                    g.remote.advance_round()
                    g.fetch_addrs = g.fetch_index = g.serve = None
                    g.width = 0
                    g.fetched.clear()
                if not st.identity:
                    if sel is not None:
                        if writes.get(g.layers[0]) is not None:
                            deferred[g.gid] = sel
                            continue
                        self.residency.settle(g, self.shard.local(sel) if self.shard else sel)
                    g.mapping.advance_round()
            for g in self.groups:
                g.selected.clear()
                g.read_step, g.read = -1, None
                g.write_key = g.write_rows = None
            if self.sharded is not None:  # every rank tracks every live address, once a step
                sms = [sm for g in self.groups if (sm := writes.get(g.layers[0])) is not None]
                if sms:
                    self.sharded.note_writes(sms[0])
            self.residency.write_step(writes, deferred)
            for g in self.groups:
                g.host_live = not st.identity and g.mapping.host_used > 0

    def _free(self, freed_blocks: list[int]) -> torch.Tensor | None:
        """Frees the blocks' entries; returns their logical addresses."""
        if not freed_blocks:
            return None
        st = self.state
        bs = self.layout.block_size
        blocks = torch.tensor(freed_blocks, dtype=torch.int64, device=self.device)
        addrs = (blocks.unsqueeze(1) * bs + torch.arange(bs, device=self.device)).reshape(-1)
        st.usage_changed = True
        for g in self.groups:
            st.trace.record(st.step, g.gid, "free", addrs)
            if g.remote is not None:
                g.remote.invalidate(addrs)  # a reused address must never read stale rows
        if self.sharded is not None:
            self.sharded.note_frees(addrs)
            if st.replicas:
                return addrs
        local = addrs if self.shard is None else (addrs[self.shard.owned(addrs)] // self.shard.world)
        if st.identity:
            st.live.index_fill_(0, local, False)
        else:
            for g in self.groups:
                g.mapping.free(local)
            if self.fast_path and all(
                    g.mapping.device_used == 0 and g.mapping.host_used == 0 for g in self.groups):
                st.identity = True  # everything freed: identity placement is valid again
                st.live.zero_()
                for g in self.groups:
                    g.selected.clear()
        if (self.sharded is not None and self.fast_path and self.sharded.glive_count == 0
                and st.identity):
            self._start_replicas()  # nothing live on any rank (every rank sees the same frees)
        return addrs

    def _start_replicas(self) -> None:
        """Everything freed on every rank: back to replicated rows."""
        st = self.state
        st.replicas = True
        st.identity = True
        st.live.zero_()
        for g in self.groups:
            g.selected.clear()

    # ------------------------------------------------------- pools and counters
    def usage(self) -> dict[str, int]:
        st, n = self.state, len(self.groups)
        out = {"device_capacity": self.layout.device_slots * n,
               "host_capacity": self.layout.host_slots * n}
        if st.replicas:
            out.update(device_used=self.sharded.glive_count * n, host_used=0)
        elif st.identity:
            out.update(device_used=int(st.live.sum()) * n, host_used=0)
        else:
            out.update(device_used=sum(g.mapping.device_used for g in self.groups),
                       host_used=sum(g.mapping.host_used for g in self.groups))
        if self.shard is not None:
            out.update(remote_used=sum(g.remote.used for g in self.groups),
                       remote_capacity=sum(g.remote.num_slots for g in self.groups))
        return out

    def stats_due(self, every: int) -> bool:
        st = self.state
        c = st.counters
        changed = c.promotions or c.demotions or st.usage_changed
        return bool(changed) or st.step - self._last_report >= every

    def take_counters(self) -> StoreCounters:
        st = self.state
        out, st.counters = st.counters, StoreCounters()
        self._last_report, st.usage_changed = st.step, False
        for k in out.__dataclass_fields__:
            setattr(self._taken, k, getattr(self._taken, k) + getattr(out, k))
        return out

    def totals(self) -> dict[str, int]:
        """Every counter since startup (reported or not yet)."""
        c = self.state.counters
        return {k: getattr(self._taken, k) + getattr(c, k) for k in c.__dataclass_fields__}
