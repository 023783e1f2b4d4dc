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
* A failed copy (`moves.TierMoves._apply`) never kills the engine and is never read: the move's entries are
  dropped from the tables, their logical blocks are reported to the scheduler as KV load
  errors (the connector's `get_block_ids_with_load_errors`), and vLLM ends the requests that
  own them with an error. This step's new entries hold no data yet and are assigned again.
  Tests inject such failures and stalls through `move_faults` (off by default).

TP shard mode (``exchange`` given, P > 1): this rank owns the logical addresses ``a % P ==
rank`` and maps them at local address ``a // P``; the group's other selected rows come from
their owners (`_remote`, `_fetch_rows`) through a buffer directory every rank keeps alike.
While every live address fits one rank's device pool, every rank keeps replicas instead
(``replicas``: rows and keys at their logical addresses, no exchange).

Fast path (identity placement): while every written logical address is below the device pool
size and nothing has ever been demoted, logical slot == device slot and nothing is translated.
The first step writing beyond the device range adopts the live addresses into the mapping
tables (in place, nothing moves) and the store stays mapped until every entry is freed again.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass, field

import torch

from ulacache_vllm.core.mapping import TieredMapping
from ulacache_vllm.core.pools import CapacityError
from ulacache_vllm.core.remote_buffer import RemoteRowBuffer

from ..config import UlaSettings
from ..faults import MoveFaults
from .moves import TierMoves
from .tp_shard import IndexerShard, ShardedRows, TokenShard, TPExchange
from .counters import StoreCounters, Timer
from .trace import StepTrace
from .translator import GroupTranslator

if TYPE_CHECKING:
    from .sizing import UlaLayout


@dataclass
class _Group:
    gid: int
    layers: list[str]
    mapping: TieredMapping
    row_bytes: int  # bytes of one entry over all the group's layers
    # This step's writes: (slot_mapping it was made for, rows to write); set by begin_step.
    write_key: torch.Tensor | None = None
    write_rows: torch.Tensor | None = None
    # This step's resolved read: (device rows, host rows or None), made by the first layer.
    read_step: int = -1
    read: tuple[torch.Tensor, torch.Tensor | None] | None = None
    selected: list[torch.Tensor] = field(default_factory=list)  # logged for settle
    host_live: bool = False  # any host row may be read this step (fixed by begin_step)
    read_host: bool = False  # this step's read stages host rows (fixed by resolve)
    # (With the host pool in attention's view, host rows are read in place, never staged.)
    staging: dict[str, torch.Tensor] = field(default_factory=dict)
    # TP shard mode: the remote-row buffer (a directory kept identically on every rank), this
    # step's misses (unique addresses, sorted, the same on every rank; where each lands in
    # the gathered rows), this rank's share to send (device row, host row), the per-rank
    # width of the gather, and the gathered rows per layer, kept for settle.
    remote: RemoteRowBuffer | None = None
    fetch_addrs: torch.Tensor | None = None
    fetch_index: torch.Tensor | None = None
    serve: tuple | None = None
    width: int = 0
    fetched: dict[str, torch.Tensor] = field(default_factory=dict)


class UlaWorkerStore(TierMoves, ShardedRows):
    def __init__(self, layout: UlaLayout, settings: UlaSettings, layers: dict, device: torch.device,
                 trace_file: str | None = None, exchange: TPExchange | None = None,
                 host_in_view: bool | None = None):
        self.layout = layout
        self.settings = settings
        self.device = device
        bs = layout.block_size
        self.dtype = getattr(torch, layout.mla_dtype)
        # TP shard mode: this rank owns logical addresses a % P == rank, at local a // P.
        self.exchange = exchange if exchange is not None and exchange.shard.world > 1 else None
        self.shard: TokenShard | None = self.exchange.shard if self.exchange else None
        if self.shard is not None:  # compiled (or loaded from numba's cache) before a forward
            from ulacache_vllm.kernels import shard_cpu

            shard_cpu.warm_up()
            self.read_plan = shard_cpu.shard_read_plan
        P = self.shard.world if self.shard else 1
        self.num_local = layout.num_blocks * bs // P
        self.trash_slot = layout.device_slots  # one extra block past the pool takes padding
        # Remote-row buffer rows sit past the trash block (attention reads them as device rows).
        self.remote_base = layout.device_slots + bs
        remote = layout.remote_slots if self.shard else 0
        rows = -(-(self.remote_base + remote) // bs) * bs
        pin = device.type == "cuda"
        # Host pool in attention's view (module doc): where device rows are host memory too.
        self.host_in_view = device.type == "cpu" if host_in_view is None else host_in_view
        if self.host_in_view and device.type != "cpu":
            raise ValueError("host_in_view needs the device pool in host memory (CPU)")
        self.host_base = rows if self.host_in_view else None
        hrows = -(-layout.host_slots // bs) * bs  # whole blocks in attention's view
        self.device_bytes: dict[str, torch.Tensor] = {}
        self.host_bytes: dict[str, torch.Tensor] = {}
        self.host_rows: dict[str, torch.Tensor] = {}  # host pools viewed in the KV dtype
        self.translators: dict[str, GroupTranslator] = {}
        self.layer_index = {n: i for i, n in enumerate(layout.mla_layers)}
        for name in layout.mla_layers:
            rb = layout.mla_row_bytes[name]
            if self.host_in_view:
                both = torch.zeros(rows + hrows, rb, dtype=torch.uint8, device=device)
                self.device_bytes[name] = both[:rows]
                self.host_bytes[name] = both[rows:rows + layout.host_slots]
                view = both
            else:
                self.device_bytes[name] = torch.zeros(rows, rb, dtype=torch.uint8,
                                                      device=device)
                self.host_bytes[name] = torch.zeros(layout.host_slots, rb, dtype=torch.uint8,
                                                    device="cpu", pin_memory=pin)
                view = self.device_bytes[name]
            self.host_rows[name] = self.host_bytes[name].view(self.dtype)
            # Attention and writes see the pool(s) in vLLM's [blocks, block, head] shape.
            layers[name].kv_cache = view.view(self.dtype).view(-1, bs, layout.mla_head_size)
        # Both pools of each layer as whole words, for the moves (`_bytes`).
        self._wide_rows = {n: (self._wide(self.device_bytes[n]), self._wide(self.host_bytes[n]))
                           for n in layout.mla_layers}
        self.indexer_caches: dict[str, torch.Tensor] = {}
        if self.shard:
            # The rank's share of the indexer keys, in vLLM's per-block layout with
            # block_size / P rows per block (vLLM allocated a placeholder).
            for i, (name, width) in enumerate(layout.indexer_layers.items()):
                t = torch.zeros(layout.num_blocks, bs // P, width, dtype=torch.uint8,
                                device=device)
                self.indexer_caches[name] = t
                layers[name].kv_cache = t
                layers[name].token_shard = IndexerShard(self.shard, self.exchange, i,
                                                        replicas=self.replica_view)
        # TP shard mode starts replicated (while every live address is below the replica
        # limit, every rank keeps every token's row and key at its logical address: no
        # exchange at all, as stock vLLM); the first write past the limit turns the rows into
        # shards on every rank at the same step, and freeing everything turns them back.
        self.replicas = bool(self.shard) and settings.fast_path
        self.replica_limit = 0
        self.glive = None
        if self.shard:
            rblocks = layout.num_blocks * (bs // P) // bs  # blocks of bs rows in a local cache
            self.replica_limit = min(layout.device_slots, rblocks * bs) // bs * bs
            self.glive = torch.zeros(layout.num_blocks * bs, dtype=torch.bool, device=device)
        self.glive_count = 0
        self.groups: list[_Group] = []
        self.group_of: dict[str, _Group] = {}
        current: list[str] = []
        for name in layout.mla_layers:
            if name in layout.leaders and current:
                self._add_group(current)
                current = []
            current.append(name)
        self._add_group(current)
        self.step = 0
        self.fast_path = settings.fast_path
        self.identity = settings.fast_path
        # (step, slot mapping, write rows) of the step's first group under identity placement.
        self._identity_writes: tuple | None = None
        self.live = torch.zeros(self.num_local, dtype=torch.bool, device=device)
        self.counters = StoreCounters()
        self._taken = StoreCounters()  # counters already reported (see totals)
        self.time_s = {"write": 0.0, "read": 0.0, "copy": 0.0, "begin": 0.0, "exchange": 0.0}
        # Failed moves (see `_apply`): logical blocks whose rows were lost, until the connector
        # reports them; and totals since startup.
        # (The failed copies themselves are a counter: `failed_copies`.)
        self.lost_blocks: set[int] = set()
        self.lost_entries = 0
        self.faults = MoveFaults.from_env()  # test-only fault injection; None by default
        self._last_report, self._usage_changed = 0, False
        # Truncated: one file holds one run (two runs' steps would merge on replay).
        self.trace = StepTrace.open(trace_file, layout.num_blocks * bs)
        for g in self.groups:
            t = GroupTranslator(self, g)
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
        g = _Group(len(self.groups), list(names), m, sum(lay.mla_row_bytes[n] for n in names))
        if self.shard:
            g.remote = RemoteRowBuffer(lay.num_blocks * lay.block_size, lay.remote_slots,
                                       rank=self.shard.rank, world_size=self.shard.world,
                                       device=self.device, lru=self.settings.lru,
                                       replicated=True,
                                       min_hit_rate=self.settings.remote_buffer_min_hit_rate)
        self.groups.append(g)
        for n in names:
            self.group_of[n] = g

    def timed(self, key: str) -> Timer:
        """Adds the wall time of a ``with`` block to ``time_s[key]`` (a plain class: a
        generator context manager costs a few microseconds more, ~18 blocks a step)."""
        return Timer(self.time_s, key)

    # ------------------------------------------------------- outside the forward
    def begin_step(self, freed_blocks: list[int], slot_mappings: dict | None = None) -> None:
        """The pre-forward half of the contract: frees, settle, round, writes (module doc).
        ``slot_mappings``: this step's write slots per layer name (vLLM's forward context)."""
        with self.timed("begin"):
            self.step += 1
            if self.faults is not None:
                self.faults.poll()
            if self.exchange is not None:
                self.exchange.step = self.step
            freed = self._free(freed_blocks)
            writes = slot_mappings or {}
            deferred: dict[int, torch.Tensor] = {}  # settled with the writes, one plan
            for g in self.groups:
                sel = torch.cat([x.reshape(-1) for x in g.selected]) if g.selected else None
                if g.remote is not None:
                    if sel is not None:
                        if g.remote.fill_due():
                            self._settle_remote(g, sel, freed)
                        else:  # reads seldom hit the buffer: keep it as it is
                            self.counters.remote_fill_skips += 1
                    g.remote.advance_round()
                    g.fetch_addrs = g.fetch_index = g.serve = None
                    g.width = 0
                    g.fetched.clear()
                if not self.identity:
                    if sel is not None:
                        if writes.get(g.layers[0]) is not None:
                            deferred[g.gid] = sel
                            continue
                        self._settle(g, self.shard.local(sel) if self.shard else sel)
                    g.mapping.advance_round()
            for g in self.groups:
                g.selected.clear()
                g.read_step, g.read = -1, None
                g.write_key = g.write_rows = None
            if self.shard is not None:  # every rank tracks every live address, once a step
                sms = [sm for g in self.groups if (sm := writes.get(g.layers[0])) is not None]
                if sms:
                    valid = sms[0].reshape(-1).long()
                    valid = valid[valid >= 0]
                    self.glive_count += int((~self.glive.index_select(0, valid)).sum())
                    self.glive.index_fill_(0, valid, True)
            self._identity_writes = (self.step, None, None)
            for g in self.groups:
                sm = writes.get(g.layers[0])
                if sm is None:
                    continue
                sel = deferred.get(g.gid)
                if sel is not None:
                    self._settle_and_write(g, sel, sm)
                else:
                    self._prepare_writes(g, sm)
            self._identity_writes = None  # shared by this loop only (not by in-forward writes)
            for g in self.groups:
                g.host_live = not self.identity and g.mapping.host_used > 0

    def _free(self, freed_blocks: list[int]) -> torch.Tensor | None:
        """Frees the blocks' entries; returns their logical addresses."""
        if not freed_blocks:
            return None
        bs = self.layout.block_size
        blocks = torch.tensor(freed_blocks, dtype=torch.int64, device=self.device)
        addrs = (blocks.unsqueeze(1) * bs + torch.arange(bs, device=self.device)).reshape(-1)
        self._usage_changed = True
        for g in self.groups:
            self.trace.record(self.step, g.gid, "free", addrs)
            if g.remote is not None:
                g.remote.invalidate(addrs)  # a reused address must never read stale rows
        if self.shard is not None:
            self.glive_count -= int(self.glive.index_select(0, addrs).sum())
            self.glive.index_fill_(0, addrs, False)
            if self.replicas:
                return addrs
        local = addrs if self.shard is None else (addrs[self.shard.owned(addrs)] // self.shard.world)
        if self.identity:
            self.live.index_fill_(0, local, False)
        else:
            for g in self.groups:
                g.mapping.free(local)
            if self.fast_path and all(
                    g.mapping.device_used == 0 and g.mapping.host_used == 0 for g in self.groups):
                self.identity = True  # everything freed: identity placement is valid again
                self.live.zero_()
                for g in self.groups:
                    g.selected.clear()
        if self.shard is not None and self.fast_path and self.glive_count == 0 and self.identity:
            self._start_replicas()  # nothing live on any rank (every rank sees the same frees)
        return addrs

    def _settle(self, g: _Group, sel: torch.Tensor) -> None:
        """Make the previous step's selections of ``g`` (local addresses, -1 = none)
        device-resident (hits touched in the round they were read in, host rows promoted as
        ``promote_after`` admits them)."""
        m = g.mapping
        # Padding, duplicates and entries freed since they were read are left to the mapping
        # (it dedups in O(n) and reads each entry's table value once: `drop_unmapped`).
        sel = sel.reshape(-1)
        n = sel.numel()
        while n:
            before = (m.stats.lookups, m.stats.hits, m.stats.deferred)
            try:
                _, plan = m.ensure_resident(sel[:n], drop_unmapped=True, want_slots=False)
            except CapacityError:
                # The step read more rows than the device pool holds: promote a prefix; the
                # rest stays on the host (staged again if read again).
                n //= 2
                self.counters.fallback_chunks += 1
                continue
            self._count_reads(m, before)
            self._apply(g, plan)
            return

    def _count_reads(self, m: TieredMapping, before: tuple[int, int, int]) -> None:
        """Adds a settle's lookups, hits and deferred promotions (``m.stats`` minus
        ``before``) to the store's counters."""
        self.counters.lookups += m.stats.lookups - before[0]
        self.counters.hits += m.stats.hits - before[1]
        self.counters.deferred += m.stats.deferred - before[2]

    def _settle_and_write(self, g: _Group, sel: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Settle, round and writes of ``g`` (mapped placement: not identity, not replicas) as
        ONE move plan (`TieredMapping.settle_and_assign`: one victim selection, one set of
        copies); one by one where the merged plan does not apply."""
        m = g.mapping
        local = self.shard.local(sel) if self.shard is not None else sel
        with self.timed("write"):
            sm = slot_mapping.reshape(-1).long()
            if g.remote is not None:
                # As in `_prepare_writes`: a written address's buffered copy is stale now.
                g.remote.invalidate(sm[sm >= 0])
            if self.shard is not None:
                sm = self.shard.local(sm)
            before = (m.stats.lookups, m.stats.hits, m.stats.deferred)
            out = m.settle_and_assign(local, sm)
            if out is not None:
                self.trace.record(self.step, g.gid, "append", slot_mapping)
                self._count_reads(m, before)
                self.counters.merged_plans += 1
                slots, plan = out
                if not self._apply(g, plan, fresh=sm):
                    # As in `_prepare_writes`: the new entries lost only their slots.
                    slots, plan = m.assign(sm)
                    self._apply(g, plan)
                g.write_key = slot_mapping
                g.write_rows = slots.masked_fill(slots < 0, self.trash_slot)
                return
        self._settle(g, local)
        m.advance_round()
        self._prepare_writes(g, slot_mapping)

    def _prepare_writes(self, g: _Group, slot_mapping: torch.Tensor) -> None:
        """Device rows for this step's new tokens of ``g`` (padding and, in TP shard mode,
        other ranks' tokens -> the trash row)."""
        self.trace.record(self.step, g.gid, "append", slot_mapping)
        with self.timed("write"):
            shared = self._identity_writes
            same = (self.identity and shared is not None and shared[0] == self.step
                    and shared[1] is slot_mapping)
            if same and g.remote is None:
                # Identity placement: every group's write rows are the same (one check of
                # the device range and one live mark per step, not one per group).
                g.write_key, g.write_rows = slot_mapping, shared[2]
                return
            sm = slot_mapping.reshape(-1).long()
            valid = sm.masked_select(sm >= 0)
            if g.remote is not None:
                # A written address's buffered copy is stale from now on (speculative decoding
                # rewrites rejected drafts' rows in place): every rank drops it alike.
                g.remote.invalidate(valid)
                if same:  # (the rest as above)
                    g.write_key, g.write_rows = slot_mapping, shared[2]
                    return
            if self.shard is not None:  # (valid: marked live in begin_step)
                if self.replicas:
                    if valid.numel() and int(valid.max()) >= self.replica_limit:
                        self._end_replicas()
                    else:  # every rank writes every row, at its logical address
                        g.write_key = slot_mapping
                        g.write_rows = torch.where(sm >= 0, sm,
                                                   torch.full_like(sm, self.trash_slot))
                        return
                sm = self.shard.local(sm)
                valid = sm.masked_select(sm >= 0)
            if self.identity:
                if valid.numel() and int(valid.max()) >= self.layout.device_slots:
                    self._leave_identity()
                else:
                    self.live.index_fill_(0, valid, True)
                    slots = sm
            if not self.identity:
                slots, plan = g.mapping.assign(sm)
                if not self._apply(g, plan, fresh=sm):
                    # This step's new entries lost only slots, no data (they are written in
                    # the forward): the failed plan freed the victims' slots, so assigning
                    # them again needs no move.
                    slots, plan = g.mapping.assign(sm)
                    self._apply(g, plan)
            g.write_key = slot_mapping
            g.write_rows = slots.masked_fill(slots < 0, self.trash_slot)
            if self.identity and self._identity_writes is not None:
                self._identity_writes = (self.step, slot_mapping, g.write_rows)  # (begin_step)

    def _leave_identity(self) -> None:
        addrs = torch.nonzero(self.live).flatten()
        for g in self.groups:
            g.mapping.adopt(addrs, addrs)
            g.mapping.advance_round()
            if g.write_key is not None:  # an earlier group's writes of this step: re-assign
                key = g.write_key
                g.write_key = None
                self._prepare_writes(g, key)
        self.identity = False
        self.counters.fast_path_exits += 1

    def usage(self) -> dict[str, int]:
        n = len(self.groups)
        out = {"device_capacity": self.layout.device_slots * n,
               "host_capacity": self.layout.host_slots * n}
        if self.replicas:
            out.update(device_used=self.glive_count * n, host_used=0)
        elif self.identity:
            out.update(device_used=int(self.live.sum()) * n, host_used=0)
        else:
            out.update(device_used=sum(g.mapping.device_used for g in self.groups),
                       host_used=sum(g.mapping.host_used for g in self.groups))
        if self.shard is not None:
            out.update(remote_used=sum(g.remote.used for g in self.groups),
                       remote_capacity=sum(g.remote.num_slots for g in self.groups))
        return out

    def stats_due(self, every: int) -> bool:
        c = self.counters
        changed = c.promotions or c.demotions or self._usage_changed
        return bool(changed) or self.step - self._last_report >= every

    def take_counters(self) -> StoreCounters:
        out, self.counters = self.counters, StoreCounters()
        self._last_report, self._usage_changed = self.step, False
        for k in out.__dataclass_fields__:
            setattr(self._taken, k, getattr(self._taken, k) + getattr(out, k))
        return out

    def totals(self) -> dict[str, int]:
        """Every counter since startup (reported or not yet)."""
        return {k: getattr(self._taken, k) + getattr(self.counters, k)
                for k in self.counters.__dataclass_fields__}
