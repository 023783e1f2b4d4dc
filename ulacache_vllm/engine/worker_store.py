"""Worker-side ulacache store: device and host pools of sparse-MLA rows, one mapping table per
layer group, and the translators the sparse-MLA backend calls.

Each layer group (layers sharing one top-k: a layer with an indexer plus the layers that reuse
its selection) owns one `TieredMapping`; a token's rows of every layer in the group share one
device slot (or host slot), and moves copy the rows of all the group's layers. The first layer
of a group that runs in a step does the lookup, dedup and moves; the others reuse the result.
Moves follow the ordering rule through `TieredMapping.apply`: copy, then commit the mapping,
then signal the fence; attention reads only slots returned after that.

Fast path (identity placement): while every written logical address is below the device
pool size and nothing has ever been demoted, logical slot == device slot, so writes and reads
need no translation at all (one `index_fill_` per step marks live addresses). The first write
beyond the device range adopts the live addresses into the mapping tables (in place, nothing
moves) and the store switches to mapped mode until every entry has been freed again.
"""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ulacache_vllm.core.mapping import DEVICE, HOST, STAGING, TieredMapping
from ulacache_vllm.core.pools import CapacityError

from .config import UlaSettings
from .kv_translation import KVTranslator, set_translator
from .sizing import UlaLayout


@dataclass
class StoreCounters:
    lookups: int = 0
    hits: int = 0
    promotions: int = 0
    demotions: int = 0
    bytes_moved: int = 0
    fallback_chunks: int = 0
    fast_path_exits: int = 0


@dataclass
class _Group:
    gid: int
    layers: list[str]
    mapping: TieredMapping
    row_bytes: int  # bytes of one entry over all the group's layers
    step_write: tuple[int, torch.Tensor, torch.Tensor] | None = None
    step_read: tuple[int, torch.Tensor, torch.Tensor] | None = None
    staging: dict[str, torch.Tensor] = field(default_factory=dict)


class UlaWorkerStore:
    def __init__(self, layout: UlaLayout, settings: UlaSettings, layers: dict, device: torch.device,
                 trace_file: str | None = None):
        self.layout = layout
        self.settings = settings
        self.device = device
        bs = layout.block_size
        dtype = getattr(torch, layout.mla_dtype)
        head = layout.mla_head_size
        pin = device.type == "cuda"
        self.device_pool: dict[str, torch.Tensor] = {}
        self.host_pool: dict[str, torch.Tensor] = {}
        for name in layout.mla_layers:
            self.device_pool[name] = torch.zeros(
                layout.device_slots // bs, bs, head, dtype=dtype, device=device)
            self.host_pool[name] = torch.zeros(
                layout.host_slots, head, dtype=dtype, device="cpu", pin_memory=pin)
            layer = layers[name]
            layer.kv_cache = self.device_pool[name]  # attention reads the device pool
            layer.impl.layer_name = name
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
        self._id_step, self._id_slots = -1, None
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
                set_translator(name, t)

    def _add_group(self, names: list[str]) -> None:
        lay = self.layout
        m = TieredMapping(lay.num_blocks * lay.block_size, lay.device_slots, lay.host_slots,
                          device=self.device, lru=self.settings.lru)
        g = _Group(len(self.groups), list(names), m, sum(lay.mla_row_bytes[n] for n in names))
        self.groups.append(g)
        for n in names:
            self.group_of[n] = g

    # ------------------------------------------------------------------ per step
    @contextlib.contextmanager
    def timed(self, key: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.time_s[key] += time.perf_counter() - t0

    def begin_step(self, freed_blocks: list[int]) -> None:
        """Start of a scheduling round: release dead logical blocks, advance the LRU rings."""
        with self.timed("begin"):
            self._begin(freed_blocks)

    def _begin(self, freed_blocks: list[int]) -> None:
        self.step += 1
        if freed_blocks:
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
                return
        if not self.identity:
            for g in self.groups:
                g.mapping.advance_round()

    def identity_write(self, slot_mapping: torch.Tensor) -> bool:
        """Fast-path write: True if the rows can go to device slot == logical slot."""
        if self._id_step == self.step and torch.equal(self._id_slots, slot_mapping):
            return True
        valid = slot_mapping.masked_select(slot_mapping >= 0)
        if valid.numel() and int(valid.max()) >= self.layout.device_slots:
            self._leave_identity()
            return False
        self.live.index_fill_(0, valid, True)
        self._id_step, self._id_slots = self.step, slot_mapping.clone()
        return True

    def _leave_identity(self) -> None:
        addrs = torch.nonzero(self.live).flatten()
        for g in self.groups:
            g.mapping.adopt(addrs, addrs)
            g.mapping.advance_round()
        self.identity = False
        self.counters.fast_path_exits += 1

    def copy_fn(self, g: _Group):
        def copy(src_tier, src, dst_tier, dst):
            # Staging rows are indices 0..n-1; size the buffer once, not per layer.
            need = src.numel() if STAGING in (src_tier, dst_tier) else 0
            for name in g.layers:
                s = self._rows(g, name, src_tier, need)
                d = self._rows(g, name, dst_tier, need)
                rows = s.index_select(0, src.to(s.device))
                d.index_copy_(0, dst.to(d.device), rows.to(d.device, non_blocking=True))
            if src_tier != dst_tier and STAGING not in (src_tier, dst_tier):
                self.counters.bytes_moved += int(src.numel()) * g.row_bytes
            return None
        return copy

    def _rows(self, g: _Group, name: str, tier: int, need: int) -> torch.Tensor:
        if tier == DEVICE:
            t = self.device_pool[name]
            return t.view(-1, t.shape[-1])
        if tier == HOST:
            return self.host_pool[name]
        buf = g.staging.get(name)
        if buf is None or buf.shape[0] < need:
            head = self.layout.mla_head_size
            buf = torch.empty(max(need, 64), head, dtype=self.device_pool[name].dtype,
                              device=self.device)
            g.staging[name] = buf
        return buf

    def _apply(self, g: _Group, plan) -> None:
        if not plan.empty:
            with self.timed("copy"):
                self.counters.promotions += int(plan.promote_src_host.numel())
                self.counters.demotions += int(plan.demote_src_device.numel())
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
    """Logical slots -> device slots for one layer group (see `kv_translation.py`)."""

    def __init__(self, store: UlaWorkerStore, group: _Group):
        self.store = store
        self.g = group

    def write_slots(self, layer_name: str, slot_mapping: torch.Tensor) -> torch.Tensor:
        if self.store._trace is not None and layer_name == self.g.layers[0]:
            # Every layer of a group writes (and reads) the same addresses: trace them once.
            self.store._record(self.g.gid, "append", slot_mapping)
        with self.store.timed("write"):
            return self._write(slot_mapping)

    def _write(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        if self.store.identity and self.store.identity_write(slot_mapping):
            return slot_mapping
        g, step = self.g, self.store.step
        if g.step_write is not None and g.step_write[0] == step and torch.equal(
                g.step_write[1], slot_mapping):
            return g.step_write[2]
        slots, plan = g.mapping.assign(slot_mapping)
        self.store._apply(g, plan)
        g.step_write = (step, slot_mapping.clone(), slots)
        return slots

    def read_rows(self, layer_name: str, rows: torch.Tensor) -> torch.Tensor:
        chunks = list(self.read_chunks(layer_name, rows, None))
        assert len(chunks) == 1, "use read_chunks when the working set may exceed the pool"
        return chunks[0][2]

    def read_chunks(self, layer_name: str, logical: torch.Tensor,
                    req_of_token: torch.Tensor | None) -> Iterator[tuple[int, int, torch.Tensor]]:
        g, step, st = self.g, self.store.step, self.store
        T = logical.shape[0]
        if st._trace is not None and layer_name == g.layers[0]:  # before a round that may
            st._record(g.gid, "select", logical.reshape(-1),   # overflow into chunks
                       None if req_of_token is None else
                       req_of_token.long().unsqueeze(1).expand_as(logical)[logical >= 0])
        if st.identity:
            yield 0, T, logical
            return
        if g.step_read is not None and g.step_read[0] == step and torch.equal(
                g.step_read[1], logical):
            yield 0, T, g.step_read[2]
            return
        try:
            slots = self._resolve(logical)
            g.step_read = (step, logical.clone(), slots)
            yield 0, T, slots
            return
        except CapacityError:
            if req_of_token is None:
                raise
        # The step's selections do not fit the device pool at once: attend in chunks of
        # requests (then of tokens), letting earlier chunks' rows be evicted in between.
        bounds = torch.nonzero(torch.diff(req_of_token.long(), prepend=req_of_token[:1].long() - 1)
                               ).flatten().tolist() + [T]
        for s, e in zip(bounds[:-1], bounds[1:]):
            step_tokens = max(1, (st.layout.device_slots // 2) // max(1, logical.shape[1]))
            for cs in range(s, e, step_tokens):
                ce = min(e, cs + step_tokens)
                g.mapping.advance_round()
                st.counters.fallback_chunks += 1
                yield cs, ce, self._resolve(logical[cs:ce])

    def _resolve(self, logical: torch.Tensor) -> torch.Tensor:
        with self.store.timed("read"):
            return self._resolve_inner(logical)

    def _resolve_inner(self, logical: torch.Tensor) -> torch.Tensor:
        g, st = self.g, self.store
        flat = logical.reshape(-1)

        before_l, before_h = g.mapping.stats.lookups, g.mapping.stats.hits
        slots, plan = g.mapping.ensure_resident(flat)
        st._apply(g, plan)
        st.counters.lookups += g.mapping.stats.lookups - before_l
        st.counters.hits += g.mapping.stats.hits - before_h
        return slots.view_as(logical)
