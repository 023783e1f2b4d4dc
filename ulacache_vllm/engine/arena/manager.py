"""Scheduler side of the arena: vLLM's KV cache manager over arena pages.

vLLM's per-type managers keep every rule of their kind (sliding-window frees, one state block
per request, admission caps, null slots) and their block tables; only the bytes change. Each
manager's block pool hands out *virtual page ids* (vids) that the arena placed, so a move
rewrites no block table: the worker translates vids to granules before every forward.

- ``allocate_slots`` counts each group's new pages exactly as vLLM's own allocation will take
  them, places them all at once through the arena's ladder (reuse -> compaction -> relayout,
  all-or-nothing across kinds), stages the vids and lets vLLM's managers take them. The
  admission gate of a new request is in bytes: the capped full-sequence demand of every kind
  must fit the arena's free bytes.
- Every change of placement (allocations, moves, the copy plan, pages to zero) is collected
  into the step's :class:`ArenaStepPlan`, shipped to the worker by the connector and applied
  before that step's forward.
- One ledger fence per engine step: the pages a step allocates or moves are registered with
  it; it passes when the scheduler has processed that step's output. Withheld bytes make the
  scheduler wait (``has_pending_block_frees``) instead of preempting.
- vid 0 is the null page: the null block of every manager, pinned, never freed.

Prefix caching (vLLM's own hashing, lookup and hit rules, per group as stock):
- One persistent ``KVCacheBlock`` per live vid; hashed pages are shared read-only by every
  request that hits them. A hashed page whose last holder frees it stays live, *free but
  cached*, in its pool's LRU: it keeps its vid and bytes (never zeroed: only new vids are),
  counts as free in usage and as reclaimable in the byte admission gate; a hit takes it back.
- Eviction is the arena's reclaim, and the only way a cached page's bytes go back: when a
  step's new pages need more than the free bytes, the coldest free-but-cached pages (every
  pool, LRU order; never the pages this request hits) are evicted until the free bytes
  suffice, *before* the ladder's compaction/relayout runs, and again if the ladder still
  finds the free bytes too scattered. ``evict_blocks`` (lost pages included) and
  ``reset_prefix_cache`` release them too.
- Placement stays invisible to vLLM: compaction and relayout move cached pages, held or not,
  like any unfenced page (the copy in the step plan, the vid and its hashes unchanged);
  fences keep pages a step in flight uses from moving or being reused.
- GDN/mamba state runs vLLM's "align" mode (state checkpoints at page boundaries, the
  checkpoint page is the state's natural size); ``sizing.prepare`` pins the state block to
  the attention page, so no hit ends inside a block (no copy-on-write), and the worker
  translates align-mode state copies (``patches/mamba_align_translate``).
"""
from __future__ import annotations

import copy
import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_events import AllBlocksCleared
from vllm.v1.core.block_pool import BlockHashToBlockMap, BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from ulacache_vllm.arena import Arena, Band, KindSpec, RowSpec

from ..line import LineManager, layout_of

logger = init_logger("vllm.ulacache.arena")

NULL_KIND = "null"


@dataclass
class ArenaStepPlan:
    """What the worker does before a step's forward, in this order: the copy steps (each a
    ``(k, 3)`` array of src, dst, nbytes; sources of a step read before any write), the v2g
    updates (``vids`` placed at ``granules``, pages of ``sizes`` bytes), then zero the new
    pages (byte offset, nbytes)."""

    copies: list = field(default_factory=list)
    vids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    granules: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    zero: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    stats: dict = field(default_factory=dict)
    seq: int = 0  # the engine step (its fence passes when the scheduler processed it)

    def __bool__(self) -> bool:
        return bool(self.copies) or bool(len(self.vids)) or bool(len(self.zero))


def arena_kinds(layout) -> list[KindSpec]:
    """The null kind (index 0) and one kind per KV cache group (index = group + 1)."""
    kinds = [KindSpec(NULL_KIND, Band.LOW, (RowSpec("page", (layout.null_page_bytes,), "uint8"),))]
    for g in layout.groups:
        rows = tuple(RowSpec(n, (g.layer_page_bytes,), "uint8") for n in g.layer_names)
        kinds.append(KindSpec(g.kind, Band(g.band), rows))
    return kinds


class _ArenaState:
    """The arena plus this step's staged vids and accumulated plan (shared by the pools)."""

    def __init__(self, layout) -> None:
        self.layout = layout
        self.arena = Arena(layout.total_bytes, arena_kinds(layout), alignment=layout.alignment)
        assert self.arena.alignment == layout.alignment, "page bytes must divide the alignment"
        res = self.arena.allocate({NULL_KIND: 1})
        vid = int(res.virtual_page_ids[NULL_KIND][0]) if res.ok else -1
        if vid != 0 or int(self.arena.v2p([0])[0]) != 0:
            raise RuntimeError("ulacache arena: the null page must be vid 0 at byte 0")
        # Pinned for good: never moved, never freed (the null block of every manager).
        self.arena.register_use([0], self.arena.fence("null page"))
        self.null_block = KVCacheBlock(0)
        self.null_block.is_null = True
        self.staged: dict[int, list[int]] = {}
        self.copies: list[np.ndarray] = []
        self.new: list[int] = []  # vids allocated since the last plan (zeroed by the worker)
        self._sent = np.full(0, -1, np.int64)  # the v2p table the worker has (vid 0 included)
        self.dirty = False  # pages freed since the last plan (the worker's figures are stale)
        self.min_page = min(self.arena.page_bytes[1:])
        # Prefix caching: every live vid's one KVCacheBlock, the kind pools (each with its LRU
        # of free-but-cached pages), the LRU clock, and whether vLLM's allocate_slots runs.
        self.live: dict[int, KVCacheBlock] = {}
        self.pools: list = []
        self.lru_stamp: dict[int, int] = {}
        self.clock = itertools.count()
        self.allocating = False
        self.cache_stats = {"cached_pages_moved": 0, "cache_evictions": 0}

    # A per-kind page demand this large means "not this step" (Mamba's same-step-hit sentinel).
    DEFER = 1 << 40

    def release(self, vids) -> None:
        for v in vids:
            self.live.pop(v, None)
        self.arena.release(np.asarray(vids, np.int64))
        self.dirty = True

    def cached_free_bytes(self) -> int:
        page = self.arena.page_bytes
        return sum(len(p.lru) * page[p._kind] for p in self.pools)

    def evict_for(self, need_bytes: int, keep: set[int]) -> int:
        """The arena's reclaim: evict the coldest free-but-cached pages (not in ``keep``: a
        request's own hits) until ``need_bytes`` are free; returns the pages evicted."""
        page = self.arena.page_bytes
        n = 0
        while self.arena.free_bytes < need_bytes:
            # Each pool's LRU is in stamp order: merge their cold ends lazily, take victims
            # worth the deficit (bytes a fence withholds come back later: loop).
            short = need_bytes - self.arena.free_bytes
            merged = heapq.merge(*(self._cold(p) for p in self.pools))
            victims = []
            for _, v, pool in merged:
                if v in keep:
                    continue
                victims.append((v, pool))
                short -= page[pool._kind]
                if short <= 0:
                    break
            if not victims:
                break
            for v, pool in victims:
                pool.evict_page(self.live[v])
                if v in pool.lru:  # never loop on a page that stayed cached
                    raise RuntimeError(f"ulacache arena: evicting cached page {v} left it "
                                       "in its pool's LRU (pool bookkeeping diverged)")
            n += len(victims)
        self.cache_stats["cache_evictions"] += n
        return n

    def _cold(self, pool):
        # One generator per pool (binds ``pool`` now: a nested generator expression would
        # late-bind the loop variable and name the last pool for every victim).
        stamp = self.lru_stamp
        return ((stamp[v], v, pool) for v in pool.lru)

    def staged_count(self) -> int:
        return sum(len(v) for v in self.staged.values())

    def changed_vids(self) -> np.ndarray:
        """Live vids whose placement changed since the last plan (allocated or moved): one
        vectorised comparison of the v2p table against the one the worker has."""
        v2p, _ = self.arena.placement()
        if len(self._sent) < len(v2p):
            self._sent = np.concatenate([self._sent, np.full(len(v2p) - len(self._sent), -1)])
        changed = np.flatnonzero(v2p != self._sent[:len(v2p)])
        return changed[v2p[changed] >= 0]

    def take_plan(self, changed: np.ndarray, stats: dict) -> ArenaStepPlan:
        v2p, kind = self.arena.placement()
        offs = v2p[changed]
        self._sent = v2p.copy()
        page_bytes = np.asarray(self.arena.page_bytes, np.int64)
        new = np.unique(np.asarray(self.new, np.int64))
        new = new[v2p[new] >= 0] if len(new) else new
        if self.live and len(changed):
            # Cached pages (held or free-but-cached) this plan moves: the copy is in the plan,
            # their vids (and hashes) stay.
            moved = np.setdiff1d(changed, new)
            self.cache_stats["cached_pages_moved"] += sum(
                1 for v in moved.tolist()
                if v in self.live and self.live[v].block_hash is not None)
        zero = np.zeros((0, 2), np.int64)
        if len(new):
            zero = np.stack([v2p[new], page_bytes[kind[new]]], axis=1)
        plan = ArenaStepPlan(self.copies, changed, offs // self.layout.alignment,
                             page_bytes[kind[changed]], zero, stats)
        self.copies, self.new = [], []
        return plan

    def record_moves(self, plan) -> None:
        self.copies.extend(plan.steps)


class ArenaBlockPool(BlockPool):
    """A vLLM block pool over arena pages of one kind (``kind`` None: the front pool the
    coordinator and scheduler see; it forwards frees and evictions to each block's own pool
    and reports bytes as usage).

    Prefix caching: one persistent ``KVCacheBlock`` per live vid (``_ArenaState.live``),
    hashed by vLLM's own ``cache_full_blocks``. A hashed page whose last holder frees it stays
    live in this pool's LRU (``lru``, coldest first) and is hittable; it goes back to the arena
    only when the arena's reclaim evicts it (``_ArenaState.evict_for``), through
    ``evict_blocks`` or ``reset_prefix_cache``. Unhashed pages go back at once."""

    def __init__(self, state: _ArenaState, kind: int | None, hash_block_size: int,
                 enable_caching: bool = False, enable_kv_cache_events: bool = False) -> None:
        super().__init__(1, enable_caching=enable_caching, hash_block_size=hash_block_size,
                         enable_kv_cache_events=enable_kv_cache_events)
        self._state = state
        self._kind = kind
        self.null_block = state.null_block
        self.blocks = []  # no per-block list: vids are created on allocation
        self.lru: OrderedDict[int, KVCacheBlock] = OrderedDict()  # free-but-cached pages
        if kind is not None:
            # Mamba's "hit made this step, retry next step" sentinel (num_gpu_blocks + 1)
            # must read as a demand no arena fits (``_ArenaState.DEFER``).
            self.num_gpu_blocks = _ArenaState.DEFER - 1
            state.pools.append(self)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        st = self._state
        staged = st.staged.get(self._kind, [])
        if num_blocks > len(staged):
            raise ValueError(f"ulacache arena: {num_blocks} pages of kind {self._kind} taken, "
                             f"{len(staged)} staged (the allocation count diverged)")
        vids, st.staged[self._kind] = staged[:num_blocks], staged[num_blocks:]
        out = []
        for v in vids:
            if v in st.live:
                raise RuntimeError(f"ulacache arena: vid {v} handed out while still live")
            blk = KVCacheBlock(v, pool=self)
            blk.ref_cnt = 1
            st.live[v] = blk
            out.append(blk)
        return out

    def free_blocks(self, ordered_blocks) -> None:
        dead, others = [], {}
        for blk in ordered_blocks:
            if blk.is_null:
                continue
            if blk.pool is not None and blk.pool is not self:
                others.setdefault(blk.pool, []).append(blk)
                continue
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                if self.enable_caching and blk.block_hash is not None:
                    self.lru[blk.block_id] = blk  # cold end last: evicted after older pages
                    self._state.lru_stamp[blk.block_id] = next(self._state.clock)
                else:
                    dead.append(blk.block_id)
        if dead:
            self._state.release(dead)
        for pool, blocks in others.items():
            pool.free_blocks(blocks)

    def touch(self, blocks) -> None:
        for blk in blocks:
            if blk.is_null:
                continue
            if blk.ref_cnt == 0:
                self.lru.pop(blk.block_id)
                self._state.lru_stamp.pop(blk.block_id, None)
            blk.ref_cnt += 1

    def get_num_free_blocks(self) -> int:
        st = self._state
        if st.allocating:  # inside allocate_slots: the arena already placed every page
            return 1 << 62
        return (st.arena.free_bytes + st.cached_free_bytes()) // st.min_page

    def get_usage(self) -> float:
        # Free-but-cached pages count as free, as in stock vLLM.
        st = self._state
        a = st.arena
        null = a.page_bytes[0]
        used = a.used_bytes - null - st.cached_free_bytes()
        return used / max(1, a.total_bytes - null)

    def evict_page(self, blk: KVCacheBlock) -> bool:
        """Drop ``blk``'s hashes; a page no request holds goes back to the arena."""
        evicted = self._maybe_evict_cached_block(blk)
        if blk.ref_cnt == 0 and self.lru.pop(blk.block_id, None) is not None:
            self._state.lru_stamp.pop(blk.block_id, None)
            self._state.release([blk.block_id])
        return evicted

    def evict_blocks(self, block_ids) -> None:
        live = self._state.live
        for vid in block_ids:
            blk = live.get(int(vid))
            if blk is not None:
                blk.pool.evict_page(blk)

    def reset_prefix_cache(self) -> bool:
        st = self._state
        held = len(st.live) - sum(len(p.lru) for p in st.pools)
        if held:
            if self._kind is None or self is st.pools[0]:  # (once per reset, not per pool)
                logger.warning("Failed to reset prefix cache because some pages (%d) are not "
                               "freed yet", held)
            return False
        if self._kind is None:
            pools = st.pools
        else:
            pools = [self]
        for pool in pools:
            vids = list(pool.lru)
            pool.lru.clear()
            for v in vids:
                st.lru_stamp.pop(v, None)
                st.live[v].reset_hash()
            if vids:
                st.release(vids)
            pool.cached_block_hash_to_block = BlockHashToBlockMap()
            pool.cached_block_hashes_by_block.clear()
            if pool.enable_kv_cache_events:
                pool.kv_event_queue.append(AllBlocksCleared())
        return True

    def take_events(self):
        if self._kind is not None:
            return super().take_events()
        out = []
        for pool in self._state.pools:
            out.extend(pool.take_events())
        return out


class ArenaKVCacheManager(LineManager, KVCacheManager):
    def __init__(self, kv_cache_config, *args, **kwargs):
        layout = layout_of(kv_cache_config)
        # vLLM's coordinator builds one block object per block: give it a one-block config
        # (only its null block), then swap every pool for an arena pool.
        small = copy.copy(kv_cache_config)
        small.num_blocks = 1
        super().__init__(small, *args, **kwargs)
        self.kv_cache_config = kv_cache_config
        self.layout = layout
        st = self._state = _ArenaState(layout)
        hbs = self.coordinator.block_pool.hash_block_size
        events = self.coordinator.block_pool.enable_kv_cache_events
        for i, mgr in enumerate(self.coordinator.single_type_managers):
            mgr.block_pool = ArenaBlockPool(st, i + 1, hbs, self.enable_caching, events)
            mgr._null_block = st.null_block
        front = ArenaBlockPool(st, None, hbs, self.enable_caching, events)
        self.coordinator.block_pool = front
        self.block_pool = front
        self.arena = st.arena
        self._watermark_bytes = int(kwargs.get("watermark", 0.0) * layout.total_bytes)
        self.step_seq = 0  # steps scheduled
        self.processed_seq = 0  # steps whose output the scheduler processed
        self.fences = {"opened": 0, "passed": 0}

    # -------------------------------------------------------------- allocation
    def _group_counts(self, request, num_tokens_need_slot: int, total_computed: int,
                      num_tokens_main_model: int, prefill_end: int, cap: bool,
                      hits=None) -> dict[int, int]:
        hits = self.empty_kv_cache_blocks.blocks if hits is None else hits
        out = {}
        for i, mgr in enumerate(self.coordinator.single_type_managers):
            n = mgr.get_num_blocks_to_allocate(
                request.request_id, num_tokens_need_slot, hits[i], total_computed,
                total_computed, num_tokens_main_model, apply_admission_cap=cap,
                prefill_end=prefill_end)
            if n:
                out[i + 1] = n
        return out

    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                       new_computed_blocks=None, num_lookahead_tokens=0,
                       num_external_computed_tokens=0, delay_cache_blocks=False,
                       num_encoder_tokens=0, full_sequence_must_fit=False, reserved_blocks=0,
                       has_scheduled_reqs=True, skip_zeroing_group_ids=()):
        if num_external_computed_tokens or num_encoder_tokens:
            raise NotImplementedError("ulacache arena: external KV and encoder tokens are not "
                                      "supported")
        hits = (new_computed_blocks.blocks if new_computed_blocks is not None
                else self.empty_kv_cache_blocks.blocks)
        # Free-but-cached pages this request hits: touched by vLLM below, so they are neither
        # reclaimable nor new bytes (their ref count is raised while the demand is counted).
        hit_free = [b for blks in hits for b in blks if not b.is_null and b.ref_cnt == 0]
        keep = {b.block_id for b in hit_free}
        page = self.arena.page_bytes
        hit_bytes = sum(page[b.pool._kind] for b in hit_free)
        st = self._state
        reclaimable = st.cached_free_bytes() - hit_bytes
        total_computed = min(request.num_computed_tokens + num_new_computed_tokens,
                             self.max_model_len)
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if self.coordinator.retention_interval != 0:
            prefill_end = 0
        waiting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        watermark = self._watermark_bytes if has_scheduled_reqs and waiting else 0
        for b in hit_free:
            b.ref_cnt += 1
        try:
            if full_sequence_must_fit or waiting:
                # The admission gate in bytes: the request's whole (capped) sequence, every
                # kind, against free bytes plus what evicting cold cached pages would free.
                full = min(request.num_tokens, self.max_model_len)
                need = self._group_counts(request, full, total_computed, full, prefill_end,
                                          True, hits)
                if any(n >= st.DEFER for n in need.values()):
                    return None
                if sum(n * page[k] for k, n in need.items()) + watermark > \
                        self.arena.free_bytes + reclaimable:
                    return None
            self.coordinator.remove_skipped_blocks(
                request.request_id, max(0, total_computed - request.num_in_flight_tokens),
                num_prompt_tokens=request.num_prompt_tokens)
            main = total_computed + num_new_tokens
            need_slot = min(main + num_lookahead_tokens, self.max_model_len)
            demands = self._group_counts(request, need_slot, total_computed, main, prefill_end,
                                         False, hits)
        finally:
            for b in hit_free:
                b.ref_cnt -= 1
        if any(n >= st.DEFER for n in demands.values()):
            return None
        if demands:
            need = sum(n * page[k] for k, n in demands.items()) + watermark
            reclaimable = st.cached_free_bytes() - hit_bytes  # (window frees may add pages)
            if need > self.arena.free_bytes + reclaimable:
                return None
            if need > self.arena.free_bytes:
                st.evict_for(need, keep)
            want = {self.arena.kinds[k].name: n for k, n in demands.items()}
            res = self.arena.allocate(want)
            while not res.ok and st.evict_for(
                    self.arena.free_bytes + max(res.shortfall_bytes, st.min_page), keep):
                res = self.arena.allocate(want)  # free bytes too scattered: reclaim more
            if not res.ok:
                return None
            st.record_moves(res.copy_plan)
            for name, vids in res.virtual_page_ids.items():
                k = self.arena.kind_index(name)
                st.staged[k] = vids.tolist()
                st.new.extend(st.staged[k])
        st.allocating = True
        try:
            return super().allocate_slots(
                request, num_new_tokens, num_new_computed_tokens=num_new_computed_tokens,
                new_computed_blocks=new_computed_blocks,
                num_lookahead_tokens=num_lookahead_tokens,
                delay_cache_blocks=delay_cache_blocks, has_scheduled_reqs=has_scheduled_reqs)
        finally:
            st.allocating = False
            left = st.staged_count()
            st.staged.clear()
            if left:
                raise RuntimeError(f"ulacache arena: {left} staged pages were not taken "
                                   "(the allocation count diverged from vLLM's)")

    def take_kv_cache_block_copies(self):
        copies = super().take_kv_cache_block_copies()
        if copies[0]:  # only partial-block hits (a Mamba block wider than the hash block)
            raise RuntimeError("ulacache arena: copy-on-write of a partially hit block is not "
                               "supported (the Mamba block must equal the attention block)")
        return copies

    def take_new_block_ids(self) -> list[int]:
        super().take_new_block_ids()  # drained: the step plan zeroes every new page itself
        return []

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    # ------------------------------------------------------------ step fences
    def new_step_starts(self) -> None:
        super().new_step_starts()
        self.step_seq += 1
        every = self.layout.force_moves_every
        if every and self.step_seq % every == 0:
            # The test knob: compaction and relayout in turn, with real copies.
            move = self.arena.relayout if self.step_seq // every % 2 else self.arena.compact
            self._state.record_moves(move())

    def step_processed(self, plan: ArenaStepPlan) -> None:
        """The scheduler processed the output of ``plan``'s step (steps complete in order):
        its fence passes."""
        self.processed_seq = max(self.processed_seq, plan.seq)
        self.arena.ledger.poll()

    def take_step(self) -> ArenaStepPlan:
        """The plan of the step being scheduled; its fence covers the pages it placed or
        moved (they may not move again, nor their bytes be reused, until the scheduler has
        processed the step's output)."""
        st = self._state
        changed = st.changed_vids()
        seq = self.step_seq
        fence = self.arena.fence(f"step {seq}", query=lambda s=seq: self.processed_seq >= s)
        self.fences["opened"] += 1
        if len(changed):
            self.arena.register_use(changed, fence)
        self.arena.ledger.poll()
        st.dirty = False
        plan = st.take_plan(changed, {})
        plan.stats = self.stats()
        plan.seq = seq
        return plan

    def stats(self) -> dict:
        a = self.arena
        used: dict[str, int] = {}
        for k, b in a.usage_by_kind().items():
            if k != NULL_KIND:
                base = k.rstrip("0123456789")
                used[base] = used.get(base, 0) + b
        s = a.stats
        return {
            "arena_used_bytes": a.used_bytes - a.page_bytes[0],
            "arena_free_bytes": a.free_bytes,
            "arena_withheld_bytes": a.pending_bytes,
            "arena_total_bytes": a.total_bytes,
            "arena_used_by_kind": used,
            "arena_compactions": s["compactions"],
            "arena_relayouts": s["relayouts"],
            "arena_pages_moved": s["pages_moved"],
            "arena_bytes_copied": s["bytes_copied"],
            "arena_shortfalls": s["shortfalls"],
            "arena_live_pages": a.num_pages - 1,
            "arena_cached_free_pages": sum(len(p.lru) for p in self._state.pools),
            "arena_cached_pages_moved": self._state.cache_stats["cached_pages_moved"],
            "arena_cache_evictions": self._state.cache_stats["cache_evictions"],
            "arena_fences_opened": self.fences["opened"],
            "arena_fences_passed": self.fences["opened"] - len(
                [f for f in a.ledger.open_fences() if f.label != "null page"]),
        }

    def has_pending_frees(self) -> bool:
        # Freed pages keep the engine stepping once more (an empty step) so the worker's
        # figures (``ulacache_usage``, /metrics) catch up when the engine goes idle.
        return self._state.dirty

    def has_withheld_bytes(self) -> bool:
        return self.arena.pending_bytes > 0

    def lost_block_owners(self, vids, requests, vllm_default=None) -> set[str]:
        """The ids of ``requests`` holding any of ``vids`` in any group (vids are unique
        across kinds: one arena numbers them all). vLLM maps lost blocks to requests only for
        one group, so its default is not used."""
        vids = set(vids)
        # Lost bytes must never be hit again: their pages leave the prefix cache (free-but-
        # cached ones go back to the arena, held ones are freed with their requests).
        self.block_pool.evict_blocks(vids)
        failed = {r.request_id for r in requests
                  if any(vids.intersection(ids) for ids in self.get_block_ids(r.request_id))}
        if failed:
            logger.error("Failing %d request(s) due to KV load failure: a page move lost %d "
                         "arena pages. Request IDs: %s", len(failed), len(vids), sorted(failed))
        return failed
