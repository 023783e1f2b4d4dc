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
     host rows are promoted, victims demoted); if that working set exceeds the device pool,
     a prefix is promoted and the rest stays on the host, staged again when read;
  3. *round*: the LRU rings advance;
  4. *writes*: this step's new rows get device slots (`assign`, demoting victims) and the
     translated write rows are fixed for the forward.
  Every move follows `TieredMapping.apply`'s rule: copy the bytes, then commit the mapping.
* **Inside the forward**, per layer group, fixed-shape tensor work only (no host reads, no
  moves, no data-dependent shapes): *resolve* maps each selected logical address through the
  committed table to a device row or a host row (one gather) and logs the selection for
  *settle*; *stage* gathers the host rows' bytes beside the device rows (attention's gather
  reads `[staging | device pool]`); *attend*. Writes go to the rows fixed in step 4; padding
  writes go to a trash row past the pool.
* Exception: a layer whose write slots were not in the pre-forward context (an MTP draft layer
  writes in the drafter's own forward) assigns them on first use, inside that forward.

Fast path (identity placement): while every written logical address is below the device pool
size and nothing has ever been demoted, logical slot == device slot and nothing is translated.
The first step writing beyond the device range adopts the live addresses into the mapping
tables (in place, nothing moves) and the store stays mapped until every entry is freed again.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field

import torch

from ulacache_vllm.core.mapping import DEVICE, HOST, STAGING, TieredMapping
from ulacache_vllm.core.pools import CapacityError
from ulacache_vllm.kernels.reference import SLOT_BITS, SLOT_MASK

from .config import UlaSettings
from .kv_translation import KVTranslator
from .sizing import UlaLayout


@dataclass
class StoreCounters:
    lookups: int = 0
    hits: int = 0
    promotions: int = 0
    demotions: int = 0
    bytes_moved: int = 0
    fallback_chunks: int = 0  # settles that promoted only part of a step's working set
    fast_path_exits: int = 0


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
    staging: dict[str, torch.Tensor] = field(default_factory=dict)


class UlaWorkerStore:
    def __init__(self, layout: UlaLayout, settings: UlaSettings, layers: dict, device: torch.device,
                 trace_file: str | None = None):
        self.layout = layout
        self.settings = settings
        self.device = device
        bs = layout.block_size
        self.dtype = getattr(torch, layout.mla_dtype)
        self.trash_slot = layout.device_slots  # one extra block past the pool takes padding
        pin = device.type == "cuda"
        self.device_bytes: dict[str, torch.Tensor] = {}
        self.host_bytes: dict[str, torch.Tensor] = {}
        self.host_rows: dict[str, torch.Tensor] = {}  # host pools viewed in the KV dtype
        self.translators: dict[str, GroupTranslator] = {}
        for name in layout.mla_layers:
            rb = layout.mla_row_bytes[name]
            self.device_bytes[name] = torch.zeros(layout.device_slots + bs, rb, dtype=torch.uint8,
                                                  device=device)
            self.host_bytes[name] = torch.zeros(layout.host_slots, rb, dtype=torch.uint8,
                                                device="cpu", pin_memory=pin)
            self.host_rows[name] = self.host_bytes[name].view(self.dtype)
            # Attention and writes see the device pool in vLLM's [blocks, block, head] shape.
            layers[name].kv_cache = self.device_bytes[name].view(self.dtype).view(
                -1, bs, layout.mla_head_size)
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
        self.live = torch.zeros(layout.num_blocks * bs, dtype=torch.bool, device=device)
        self.counters = StoreCounters()
        self.time_s = {"write": 0.0, "read": 0.0, "copy": 0.0, "begin": 0.0}
        self._last_report, self._usage_changed = 0, False
        # Truncated: one file holds one run (two runs' steps would merge on replay).
        self._trace = open(trace_file, "w") if trace_file else None
        if self._trace is not None:
            self._trace.write(json.dumps({"num_logical": layout.num_blocks * bs}) + "\n")
        for g in self.groups:
            t = GroupTranslator(self, g)
            for name in g.layers:
                self.translators[name] = t
                # The corridor: each sparse-MLA impl gets its layer's translator explicitly.
                layers[name].impl.translator = t
                layers[name].impl.layer_name = name

    def _add_group(self, names: list[str]) -> None:
        lay = self.layout
        m = TieredMapping(lay.num_blocks * lay.block_size, lay.device_slots, lay.host_slots,
                          device=self.device, lru=self.settings.lru)
        g = _Group(len(self.groups), list(names), m, sum(lay.mla_row_bytes[n] for n in names))
        self.groups.append(g)
        for n in names:
            self.group_of[n] = g

    @contextlib.contextmanager
    def timed(self, key: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.time_s[key] += time.perf_counter() - t0

    # ------------------------------------------------------- outside the forward
    def begin_step(self, freed_blocks: list[int], slot_mappings: dict | None = None) -> None:
        """The pre-forward half of the contract: frees, settle, round, writes (module doc).
        ``slot_mappings``: this step's write slots per layer name (vLLM's forward context)."""
        with self.timed("begin"):
            self.step += 1
            self._free(freed_blocks)
            if not self.identity:
                for g in self.groups:
                    self._settle(g)
                    g.mapping.advance_round()
            for g in self.groups:
                g.selected.clear()
                g.read_step, g.read = -1, None
                g.write_key = g.write_rows = None
            for g in self.groups:
                sm = (slot_mappings or {}).get(g.layers[0])
                if sm is not None:
                    self._prepare_writes(g, sm)
            for g in self.groups:
                g.host_live = not self.identity and g.mapping.host_used > 0

    def _free(self, freed_blocks: list[int]) -> None:
        if not freed_blocks:
            return
        bs = self.layout.block_size
        blocks = torch.tensor(freed_blocks, dtype=torch.int64, device=self.device)
        addrs = (blocks.unsqueeze(1) * bs + torch.arange(bs, device=self.device)).reshape(-1)
        self._usage_changed = True
        for g in self.groups:
            self._record(g.gid, "free", addrs)
        if self.identity:
            self.live.index_fill_(0, addrs, False)
            return
        for g in self.groups:
            g.mapping.free(addrs)
        if self.fast_path and all(
                g.mapping.device_used == 0 and g.mapping.host_used == 0 for g in self.groups):
            self.identity = True  # everything freed: identity placement is valid again
            self.live.zero_()
            for g in self.groups:
                g.selected.clear()

    def _settle(self, g: _Group) -> None:
        """Make the previous step's selections of ``g`` device-resident (hits touched in the
        round they were read in, host rows promoted)."""
        if not g.selected:
            return
        sel = torch.cat([s.reshape(-1) for s in g.selected])
        g.selected.clear()
        m = g.mapping
        # Drop padding and entries freed since they were read; duplicates stay (the mapping
        # dedups in O(n) itself).
        sel = sel.masked_select((sel >= 0) & (m.loc.index_select(0, sel.clamp(min=0)) >= 0))
        n = sel.numel()
        while n:
            before_l, before_h = m.stats.lookups, m.stats.hits
            try:
                _, plan = m.ensure_resident(sel[:n])
            except CapacityError:
                # The step read more rows than the device pool holds: promote a prefix; the
                # rest stays on the host (staged again if read again).
                n //= 2
                self.counters.fallback_chunks += 1
                continue
            self.counters.lookups += m.stats.lookups - before_l
            self.counters.hits += m.stats.hits - before_h
            self._apply(g, plan)
            return

    def _prepare_writes(self, g: _Group, slot_mapping: torch.Tensor) -> None:
        """Device rows for this step's new tokens of ``g`` (padding -> the trash row)."""
        if g.layers and self._trace is not None:
            self._record(g.gid, "append", slot_mapping)
        with self.timed("write"):
            sm = slot_mapping.reshape(-1).long()
            if self.identity:
                valid = sm[sm >= 0]
                if valid.numel() and int(valid.max()) >= self.layout.device_slots:
                    self._leave_identity()
                else:
                    self.live.index_fill_(0, valid, True)
                    slots = sm
            if not self.identity:
                slots, plan = g.mapping.assign(sm)
                self._apply(g, plan)
            g.write_key = slot_mapping
            g.write_rows = torch.where(slots >= 0, slots, torch.full_like(slots, self.trash_slot))

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

    def copy_fn(self, g: _Group):
        """Copies byte rows of every layer of ``g`` between tiers (device, host, staging)."""
        def copy(src_tier, src, dst_tier, dst):
            need = src.numel() if STAGING in (src_tier, dst_tier) else 0
            for name in g.layers:
                s = self._bytes(g, name, src_tier, need)
                d = self._bytes(g, name, dst_tier, need)
                # One op per copy, on the destination's device: the gather runs where the
                # source lives and lands before the scatter reads it (stream order on CUDA
                # needs a device-side view of the host pool; the CPU backend reads it directly).
                d.index_copy_(0, dst.to(d.device), s.index_select(0, src.to(s.device)).to(d.device))
            if src_tier != dst_tier and STAGING not in (src_tier, dst_tier):
                self.counters.bytes_moved += int(src.numel()) * g.row_bytes
            return None
        return copy

    def _bytes(self, g: _Group, name: str, tier: int, need: int) -> torch.Tensor:
        if tier == DEVICE:
            return self.device_bytes[name]
        if tier == HOST:
            return self.host_bytes[name]
        buf = g.staging.get(name)
        if buf is None or buf.shape[0] < need:
            buf = torch.empty(max(need, 64), self.layout.mla_row_bytes[name], dtype=torch.uint8,
                              device=self.device)
            g.staging[name] = buf
        return buf

    def _apply(self, g: _Group, plan) -> None:
        if not plan.empty:
            with self.timed("copy"):
                self.counters.promotions += int(plan.promote_src_host.numel())
                self.counters.demotions += int(plan.demote_src_device.numel())
                if plan.demote_src_device.numel():
                    g.host_live = True  # (a draft layer's in-forward writes may demote)
                g.mapping.apply(plan, self.copy_fn(g))

    def _record(self, gid: int, kind: str, addrs: torch.Tensor, reqs=None) -> None:
        if self._trace is None or addrs.numel() == 0:
            return
        a = addrs[addrs >= 0]
        rec = {"step": self.step, "group": gid, "kind": kind,
               "req": reqs.tolist() if reqs is not None else 0, "addr": a.tolist()}
        self._trace.write(json.dumps(rec) + "\n")
        self._trace.flush()

    # ---------------------------------------------------------------- reporting
    def usage(self) -> dict[str, int]:
        if self.identity:
            used = int(self.live.sum()) * len(self.groups)
            return {"device_used": used, "host_used": 0,
                    "device_capacity": self.layout.device_slots * len(self.groups),
                    "host_capacity": self.layout.host_slots * len(self.groups)}
        return {
            "device_used": sum(g.mapping.device_used for g in self.groups),
            "host_used": sum(g.mapping.host_used for g in self.groups),
            "device_capacity": self.layout.device_slots * len(self.groups),
            "host_capacity": self.layout.host_slots * len(self.groups),
        }

    def stats_due(self, every: int) -> bool:
        c = self.counters
        changed = c.promotions or c.demotions or self._usage_changed
        return bool(changed) or self.step - self._last_report >= every

    def take_counters(self) -> StoreCounters:
        out, self.counters = self.counters, StoreCounters()
        self._last_report, self._usage_changed = self.step, False
        return out


class GroupTranslator(KVTranslator):
    """The forward half of the contract for one layer group (see the module doc)."""

    def __init__(self, store: UlaWorkerStore, group: _Group):
        self.store = store
        self.g = group
        self.trash_slot = store.trash_slot

    def write_slots(self, layer_name: str, slot_mapping: torch.Tensor) -> torch.Tensor:
        g = self.g
        if g.write_key is not None and (
                g.write_key is slot_mapping or (
                    g.write_key.data_ptr() == slot_mapping.data_ptr()
                    and g.write_key.shape == slot_mapping.shape)):
            return g.write_rows
        # Not in the pre-forward context (an MTP draft layer), or another layer of the group
        # with a copy of the same slots: prepared here, inside the forward.
        if g.write_key is None or not torch.equal(g.write_key.reshape(-1).long(),
                                                  slot_mapping.reshape(-1).long()):
            self.store._prepare_writes(g, slot_mapping)
        return g.write_rows

    def resolve(self, layer_name: str, logical: torch.Tensor, req_of_token: torch.Tensor | None):
        g, st = self.g, self.store
        # The group's first layer resolves (each forward pass, so a drafter's repeated passes
        # in one step each resolve their own selection); the others reuse its result.
        if layer_name != g.layers[0] and g.read_step == st.step:
            return g.read
        if st._trace is not None:
            st._record(g.gid, "select", logical.reshape(-1),
                       None if req_of_token is None else
                       req_of_token.long().unsqueeze(1).expand_as(logical)[logical >= 0])
        with st.timed("read"):
            if st.identity:
                g.read = (logical, None)
            else:
                loc = g.mapping.visible.index_select(0, logical.reshape(-1).clamp(min=0))
                loc = loc.view_as(logical)
                valid = (logical >= 0) & (loc >= 0)
                tier = loc >> SLOT_BITS
                slot = loc & SLOT_MASK
                neg = torch.full_like(slot, -1)
                dev = torch.where(valid & (tier == DEVICE), slot, neg)
                host = torch.where(valid & (tier == HOST), slot, neg) if g.host_live else None
                g.selected.append(logical)
                g.read = (dev, host)
        g.read_step = st.step
        return g.read

    def host_rows(self, layer_name: str) -> torch.Tensor:
        return self.store.host_rows[layer_name]
