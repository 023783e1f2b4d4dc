"""The CUDA glue's rows and step contract (`CudaRows`), device-agnostic (the tests run it on CPU).

Layout (cuda-notes section 2): one uint8 buffer per device ``[staging S | layer 0 pool P |
layer 1 pool P | ...]`` of byte rows (bf16: 1152 B, fp8_ds_mla: 656 B). Layer ``l`` sees
``buf[:S + (l+1) P]`` in vLLM's ``[blocks, block_size, head]`` shape (`kv_view`), so staging
rows are shared and device slot ``s`` of layer ``l`` is row ``S + l P + s`` (``dev_base(l)``).
S and P are multiples of the block size (64 on CUDA: the fp8 kernel's pages).

Host pools: one per layer, ``uint8 [H, row_bytes]``, allocated at exactly that size and pinned
by ``pin`` (on CUDA ``cudaHostRegister`` of exactly those bytes; torch's caching host allocator
behind ``pin_memory=True`` rounds to a power of two); kernels read them through their device view
(`kernels.host_view`, UVA), so every copy from or to the host is a stream-ordered GPU op and no
CPU op reads a pinned buffer before a DMA into it has landed.

Inside the forward (`resolve_stage`, per sparse layer; fixed shapes, no host reads): the logical
slots stock's converter produced -> rows of ``[staging | pool]`` through the group's committed
table (`kernels.resolve_impl(...).resolve`), then the missed rows' bytes from the host pool into
staging (`stage`). Each group's leader logs its misses in its own `MissLog` (the one the
settle reads); the other layers share one (read only by their own stage). Staging never overflows
silently: a call whose shape could have more distinct host misses (min(T x K, host rows)) than
staging rows raises before any kernel runs, and an overflow the kernels counted anyway raises in
the next `begin_step` (`StagingOverflowError`).

Token chunks: staging is sized for a decode step (worker doc), so a larger layer call (prefill,
mixed) is split by the backend into query-token chunks of `chunk_tokens` tokens (chunk tokens x
K <= S, so no chunk can overflow), each resolved, staged and attended before the next one
re-uses staging. The split comes from shapes only (T, K, S, H). Sparse attention of a query
token reads only its own selections, so the split is exact. A chunk's resolve resets its log:
the group leader's earlier chunks' misses, overflow and unmapped counts are carried into a
per-group accumulator (``carry=True``, device ops, at most ``ACC_ROWS`` addresses; further
ones are not promoted, counted in ``unsettled``), which `begin_step` settles with the log.

Outside the forward (`begin_step`, from the connector's pre-forward hook, before any graph
replay): frees; settle (each group's first layer's logged misses promoted, as the mapping's
``promote_after`` admits them, through `TieredMapping.ensure_resident` + `apply`, copies as
GPU ops); round; writes (``assign`` of the
step's new logical slots; where a group has both, settle, round and assign are one plan,
`TieredMapping.settle_and_assign`, one victim selection and one set of copies, fewer launches),
then `write_translate` into the ulacache-owned static slot-mapping
buffer of every MLA layer, same address at capture and replay: the fused write kernel writes
exactly the bytes stock would, at translated rows). Padding writes go to staging row ``S - 1``
(scratch: a layer stages after its own write, so a staged row is always re-filled before read).

PB-LRU: the resolve touches device hits' round labels from a device round scalar
(``round_t``, refreshed after ``advance_round``), so a separate settle's victims are never rows
read this round (a merged plan picks its victims in the new round: those rows are the least
preferred, not excluded). The small-pool timestamp scan (pools <= 4096 slots) gets no touch from the forward.
Not done here: TP shard mode, MTP draft layers.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ulacache_vllm import kernels as K
from ulacache_vllm.core.mapping import DEVICE, HOST, STAGING, TieredMapping
from ulacache_vllm.core.pools import CapacityError
from ulacache_vllm.kernels.resolve_reference import MissLog, ResolveState

from . import ACC_ROWS


# The worker's rows while a ulacache engine runs in this process on CUDA (read by the
# slot-mapping hook in patches/cuda_sparse_backend.py; set by `worker.CudaDsaWorker.build`).
ACTIVE: dict = {"rows": None}


def pin_exact(t: torch.Tensor) -> torch.Tensor:
    """Pins ``t``'s bytes exactly (``cudaHostRegister``), as HiSparse's ``pin_tensor`` does."""
    nbytes = t.untyped_storage().nbytes()
    rt = torch.cuda.cudart()
    err = rt.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(getattr(err, "value", err)) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed ({err})")
    return t




class StagingOverflowError(RuntimeError):
    """A layer call could have, or had, more distinct host misses than staging rows."""


def _pblru_labels(policy):
    """The PB-LRU's label table (int16, dummy last entry), or None for other policies."""
    from ulacache_vllm.core.pblru import PBLRU

    return policy.labels if isinstance(policy, PBLRU) else None


class CudaRows:
    """Rows and step contract of the CUDA glue (module doc). ``groups``: layer names per layer
    group in model order (each group shares one `TieredMapping`); ``pin``: how host pools are
    pinned (default: `pin_exact` when ``device`` is CUDA, nothing on CPU)."""

    def __init__(self, groups: list[list[str]], *, row_bytes: int, head_size: int,
                 kv_dtype: torch.dtype, block_size: int, device_slots: int, host_slots: int,
                 staging_rows: int, num_logical: int, max_tokens: int, device,
                 lru: str = "pblru", pin: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 promote_after: int = 1):
        dev = torch.device(device)
        for what, n in (("staging rows", staging_rows), ("device slots", device_slots)):
            if n <= 0 or n % block_size:
                raise ValueError(f"{what} ({n}) must be a positive multiple of the block size "
                                 f"({block_size})")
        self.device, self.block_size, self.row_bytes = dev, block_size, row_bytes
        self.head_size, self.kv_dtype = head_size, kv_dtype
        self.S, self.P, self.H = staging_rows, device_slots, host_slots
        self.layers = [n for g in groups for n in g]
        self.index = {n: i for i, n in enumerate(self.layers)}
        L = len(self.layers)
        self.buf = torch.zeros(self.S + L * self.P, row_bytes, dtype=torch.uint8, device=dev)
        if pin is None and dev.type == "cuda":
            pin = pin_exact
        self.host: dict[str, torch.Tensor] = {}
        self.host_dev: dict[str, torch.Tensor] = {}  # device views (UVA) of the host pools
        for n in self.layers:
            h = torch.zeros(host_slots, row_bytes, dtype=torch.uint8)  # exact size, then pinned
            self.host[n] = pin(h) if pin is not None else h
            self.host_dev[n] = K.host_view(self.host[n], dev)
        self.mappings = [TieredMapping(num_logical, device_slots, host_slots, device=dev, lru=lru,
                                       promote_after=promote_after)
                         for _ in groups]
        self.group_of = {n: gi for gi, g in enumerate(groups) for n in g}
        self.groups = groups
        self.state = ResolveState(num_logical, staging_rows, dev)
        # Each group's leader logs the group's misses for the settle; the other layers' logs
        # are only read by their own stage, right after their resolve: one shared log.
        leaders = {g[0] for g in groups}
        shared = MissLog(staging_rows, dev) if len(leaders) < L else None
        self.logs = {n: MissLog(staging_rows, dev) if n in leaders else shared
                     for n in self.layers}
        # Earlier chunks' misses of a chunked call, per group (addresses, then a dump entry;
        # counts: appended, overflowed, unmapped), and the staging row index range.
        cap = min(staging_rows, ACC_ROWS)
        self.acc_addr = [torch.full((cap + 1,), -1, dtype=torch.int64, device=dev)
                         for _ in groups]
        self.acc_counts = [torch.zeros(3, dtype=torch.int64, device=dev) for _ in groups]
        self._ar = torch.arange(staging_rows, dtype=torch.int64, device=dev)
        self.identity = torch.zeros(1, dtype=torch.int32, device=dev)  # device flag (graphs)
        # The static slot-mapping buffers (int64, what vLLM's write kernels take) and the
        # logical slot mapping each was registered with this step.
        self.write_rows = {n: torch.full((max_tokens,), self.S - 1, dtype=torch.int64, device=dev)
                           for n in self.layers}
        self.logical_writes: dict[str, torch.Tensor] = {}
        # Cumulative, host ints updated in begin_step (no device read of their own).
        self.counters = {"promotions": 0, "demotions": 0, "bytes_moved": 0,
                         "fallback_chunks": 0, "staged": 0, "overflow": 0, "unmapped": 0,
                         "steps": 0, "chunked_calls": 0, "attention_chunks": 0,
                         "unsettled": 0, "merged_plans": 0, "deferred": 0}
        self.write_errors = torch.zeros(1, dtype=torch.int64, device=dev)
        # PB-LRU round labels touched by the forward's resolve (device hits get the current
        # round from a device scalar, refreshed in begin_step): eviction sees reads as the
        # CPU path's settle does. Other policies (the small-pool scan): no touch.
        self.labels = [_pblru_labels(m.policy) for m in self.mappings]
        self.round_t = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in groups]
        self._sync_rounds()

    def _sync_rounds(self) -> None:
        for gi, m in enumerate(self.mappings):
            if self.labels[gi] is not None:
                self.round_t[gi].fill_(m.policy.round)

    # ------------------------------------------------------------------ views
    def dev_base(self, layer: str) -> int:
        return self.S + self.index[layer] * self.P

    def kv_view(self, layer: str) -> torch.Tensor:
        """The layer's KV cache as vLLM shapes it: ``[blocks, block_size, head]`` over
        ``[staging | pools up to this layer's]`` (uint8 rows for fp8_ds_mla)."""
        rows = self.buf[: self.dev_base(layer) + self.P]
        t = rows if self.kv_dtype == torch.uint8 else rows.view(self.kv_dtype)
        return t.view(-1, self.block_size, t.shape[-1])

    def pool(self, layer: str) -> torch.Tensor:
        b = self.dev_base(layer)
        return self.buf[b: b + self.P]

    # ------------------------------------------------------- inside the forward
    def chunk_tokens(self, T: int, K: int) -> int:
        """Query tokens per chunk of a ``[T, K]`` layer call (module doc), from shapes only:
        T when staging covers the whole call, else S // K."""
        if min(T * K, self.H) <= self.S:
            return max(T, 1)
        c = self.S // K
        if c == 0:
            raise StagingOverflowError(
                f"ulacache (CUDA, experimental): staging holds {self.S} rows, fewer than one "
                f"token's {K} selections: no token chunk fits. Raise ULACACHE_CUDA_STAGING_ROWS "
                f"to at least {K} (or unset it).")
        return c

    def chunks(self, T: int, K: int) -> list[tuple[int, int]]:
        """The ``(t0, t1)`` token ranges of a ``[T, K]`` layer call (one unless it is larger
        than staging covers); counted in ``chunked_calls`` / ``attention_chunks`` (host ints,
        counted when the Python runs: eager calls and graph captures, not graph replays)."""
        c = self.chunk_tokens(T, K)
        out = [(t0, min(T, t0 + c)) for t0 in range(0, max(T, 1), c)]
        if len(out) > 1:
            self.counters["chunked_calls"] += 1
            self.counters["attention_chunks"] += len(out)
        return out

    def resolve_stage(self, layer: str, logical: torch.Tensor,
                      num_tokens: torch.Tensor | None = None, *,
                      carry: bool = False) -> torch.Tensor:
        """Logical slots ``[T, K]`` (-1 padded) -> int32 rows of ``kv_view(layer)``; host rows
        staged. Fixed-shape device work only. ``carry``: a later chunk of one layer call (the
        group leader's previous chunk's misses are kept for the settle first)."""
        need = min(logical.numel(), self.H)  # the most distinct host misses this call can have
        if need > self.S:  # shapes only (no device read): the same at capture and replay
            raise StagingOverflowError(
                f"ulacache (CUDA, experimental): layer {layer}'s call of {logical.shape[0]} "
                f"tokens x {logical.shape[1]} selections can miss {need} distinct host rows, "
                f"staging holds {self.S}: the overflow would read nothing (wrong attention). "
                "Split it (`chunks`), raise ULACACHE_CUDA_STAGING_ROWS (or unset it) or lower "
                "max_num_batched_tokens.")
        impl = K.resolve_impl(logical)
        log = self.logs[layer]
        table = self.mappings[self.group_of[layer]].visible
        gi = self.group_of[layer]
        if carry and self.groups[gi][0] == layer:
            self._carry(gi, log)
        labels = self.labels[gi]
        rows = impl.resolve(logical, table, labels, self.round_t[gi] if labels is not None
                            else None, num_tokens, self.identity, self.state,
                            dev_base=self.dev_base(layer), log=log)
        impl.stage(self.host_dev[layer], self.buf, log)
        return rows

    def _carry(self, gi: int, log: MissLog) -> None:
        """Appends ``log``'s misses and counts to group ``gi``'s accumulator (device ops,
        fixed shapes; addresses past its capacity go to the dump entry, counted)."""
        addr, cnt = self.acc_addr[gi], self.acc_counts[gi]
        cap = addr.numel() - 1
        c = log.counts.to(torch.int64)
        m = c[0].clamp(max=log.capacity)
        idx = cnt[0] + self._ar
        keep = (self._ar < m) & (idx < cap)
        addr.scatter_(0, torch.where(keep, idx, torch.full_like(idx, cap)), log.addr)
        cnt.add_(torch.stack([m, c[0] - m, c[1]]))

    # ------------------------------------------------------- outside the forward
    def register_writes(self, layer: str, logical_slots: torch.Tensor) -> torch.Tensor:
        """The slot mapping the layer's fused write kernel gets: a view of the layer's static
        buffer (same address every step) that `begin_step` fills with translated rows."""
        n = logical_slots.numel()
        buf = self.write_rows[layer]
        if n > buf.numel():
            raise ValueError(f"{n} write slots, the static buffer holds {buf.numel()} "
                             "(max_num_batched_tokens)")
        self.logical_writes[layer] = logical_slots
        return buf[:n].view(logical_slots.shape)

    def static_view(self, layer: str, logical_slots: torch.Tensor) -> torch.Tensor:
        """The static buffer as `register_writes` returns it, without registering the slots
        (graph capture's dummy batches: their slots must not be assigned)."""
        return self.write_rows[layer][: logical_slots.numel()].view(logical_slots.shape)

    def begin_step(self, freed_addrs: torch.Tensor | None = None) -> None:
        """Frees, settle, round, writes (module doc); every copy a device op, in stream order."""
        self.counters["steps"] += 1
        # Each group's leader logs the misses of the group's one top-k (the other layers
        # select the same addresses); read before anything changes.
        taken = self._take_all()
        overflow = sum(t[1] for t in taken)
        if overflow:
            self.counters["overflow"] += overflow
            raise StagingOverflowError(
                f"ulacache (CUDA, experimental): {overflow} host misses overflowed the staging "
                f"area ({self.S} rows) in the last step and were read as nothing: its attention "
                "was wrong, so the engine stops here. This is a bug (the staging bound and the "
                "per-call shape check should prevent it); please report it. Meanwhile raise "
                "ULACACHE_CUDA_STAGING_ROWS.")
        for gi, names in enumerate(self.groups):
            m = self.mappings[gi]
            if freed_addrs is not None and freed_addrs.numel():
                m.free(freed_addrs.to(self.device))
            addr, _, unmapped = taken[gi]
            self.counters["unmapped"] += unmapped
            self.counters["staged"] += int(addr.numel())
            addr = addr[m.loc.index_select(0, addr.clamp(min=0)) >= 0] if addr.numel() else addr
            n = int(addr.numel())
            sm = self.logical_writes.get(names[0])
            merged = None
            if n and sm is not None:
                # Settle, round and writes as one plan (one victim selection, one set of
                # copies: fewer launches); None where it does not apply (room, re-assignment).
                merged = m.settle_and_assign(addr, sm.reshape(-1).long())
            if merged is not None:
                self.counters["merged_plans"] += 1
                self._apply(gi, merged[1])
            else:
                while n:  # more misses than the pool takes in one round: promote a prefix
                    try:
                        _, plan = m.ensure_resident(addr[:n])
                    except CapacityError:
                        n //= 2
                        self.counters["fallback_chunks"] += 1
                        continue
                    self._apply(gi, plan)
                    break
                m.advance_round()
            if self.labels[gi] is not None:
                self.round_t[gi].fill_(m.policy.round)
            if merged is None and sm is not None:
                slots, plan = m.assign(sm.reshape(-1).long())
                self._apply(gi, plan)
            for n in names:
                sm = self.logical_writes.get(n)
                if sm is None:
                    continue
                out = self.write_rows[n][: sm.numel()]
                K.resolve_impl(out).write_translate(
                    sm.reshape(-1), m.visible, self.identity, dev_base=self.dev_base(n),
                    trash_row=self.S - 1, errors=self.write_errors, out=out)
        # Host rows read but left on the host (``promote_after``): the mappings' own count.
        self.counters["deferred"] = sum(m.stats.deferred for m in self.mappings)
        # Registered again by the next step's slot mappings (the runner builds them per step).
        self.logical_writes.clear()

    def _take_all(self) -> list[tuple[torch.Tensor, int, int]]:
        """Per group ``(addresses, overflow, unmapped)`` of the step's misses: its leader's log
        and the carried chunks' accumulator (then reset). One device read for every group."""
        logs = [self.logs[names[0]] for names in self.groups]
        vals = torch.cat([t for log, acc in zip(logs, self.acc_counts)
                          for t in (log.counts.to(torch.int64), acc)]).tolist()
        out = []
        for gi, log in enumerate(logs):
            claimed, unmapped, n, a_over, a_unm = vals[5 * gi: 5 * gi + 5]
            k = min(claimed, log.capacity)
            addr = log.addr[:k].clone()
            if n or a_over or a_unm:
                cap = self.acc_addr[gi].numel() - 1
                self.counters["unsettled"] += n - min(n, cap)
                addr = torch.cat([self.acc_addr[gi][:min(n, cap)].clone(), addr])
                self.acc_counts[gi].zero_()
            out.append((addr, claimed - k + a_over, unmapped + a_unm))
        return out

    def _apply(self, gi: int, plan) -> None:
        if plan.empty:
            return
        names = self.groups[gi]
        scratch: dict[str, torch.Tensor] = {}

        def tier_rows(name, tier, need):
            if tier == DEVICE:
                return self.pool(name)
            if tier == HOST:
                return self.host_dev[name]
            if name not in scratch or scratch[name].shape[0] < need:
                scratch[name] = torch.empty(max(need, 1), self.row_bytes, dtype=torch.uint8,
                                            device=self.device)
            return scratch[name]

        def copy(src_tier, src, dst_tier, dst):
            need = int(src.numel()) if STAGING in (src_tier, dst_tier) else 0
            for name in names:
                s, d = tier_rows(name, src_tier, need), tier_rows(name, dst_tier, need)
                # One gather and one scatter on the device (host rows through their UVA view).
                d.index_copy_(0, dst.to(self.device), s.index_select(0, src.to(self.device)))
            if src_tier != dst_tier and STAGING not in (src_tier, dst_tier):
                self.counters["bytes_moved"] += int(src.numel()) * self.row_bytes * len(names)

        self.mappings[gi].apply(plan, copy)
        self.counters["promotions"] += int(plan.promote_src_host.numel())
        self.counters["demotions"] += int(plan.demote_src_device.numel())

    def seed(self, group: int, logical_slots: torch.Tensor,
             rows: dict[str, torch.Tensor]) -> None:
        """Places byte rows of new logical slots of a group as a step's writes would (assign,
        then each layer's bytes at its translated rows); outside the forward (tests, tools)."""
        m = self.mappings[group]
        slots = logical_slots.reshape(-1).long().to(self.device)
        m.advance_round()  # one step per call
        _, plan = m.assign(slots)
        self._apply(group, plan)
        for name in self.groups[group]:
            out = K.resolve_impl(slots).write_translate(
                slots, m.visible, self.identity, dev_base=self.dev_base(name),
                trash_row=self.S - 1)
            self.buf.index_copy_(0, out, rows[name].to(self.device))
