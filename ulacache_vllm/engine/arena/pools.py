"""The arena's page pools on the scheduler side: the per-step state shared by vLLM's block
pools (the arena, the vids staged for vLLM's managers, the step's accumulated plan, the
prefix cache's persistent blocks and LRUs) and those pools.

- A step's plan lists every change of placement since the last plan (copies, vids placed
  where, the new pages); while the arena's placement version is the one the worker's
  table was taken at, nothing changed and the plan is empty.
- One persistent ``KVCacheBlock`` per live vid; vid 0 is the null page (pinned, never freed).
- A hashed page whose last holder frees it stays live (free but cached, in
  ``ArenaState.cache``, the arena's eviction order) until an admission needs its bytes and
  no free bytes can serve it; an unhashed page goes back to the arena at once.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_events import AllBlocksCleared
from vllm.logger import init_logger
from vllm.v1.core.block_pool import BlockHashToBlockMap, BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from ulacache_vllm.arena import Arena, Band, KindSpec, RowSpec
from ulacache_vllm.arena.cache import CachedPages

logger = init_logger("vllm.ulacache.arena")

NULL_KIND = "null"
TRANSIENT_VID = -1  # a staged page of no bytes: the null block (e.g. v4's transient states)


def _frozen(shape) -> np.ndarray:
    a = np.zeros(shape, np.int64)
    a.flags.writeable = False
    return a


_NO_VIDS, _NO_NEW = _frozen(0), _frozen((0, 2))  # a plan that places nothing (read-only)


@dataclass
class ArenaStepPlan:
    """What the worker does before a step's forward, in this order: the copy steps (each a
    ``(k, 3)`` array of src, dst, nbytes; sources of a step read before any write), the v2g
    updates (``vids`` placed at ``granules``, pages of ``sizes`` bytes), then zero the new
    pages (``new``: byte offset, nbytes; of the kinds the layout zeroes, ``ArenaGroup.zeroed``)
    where the layout says so (``zero_new_pages``)."""

    copies: list = field(default_factory=list)
    vids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    granules: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    new: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    stats: dict | None = None  # the arena's figures, when one changed since the last plan
    fences: tuple[int, int] = (0, 0)  # step fences (opened, passed) so far
    seq: int = 0  # the engine step (its fence passes when the scheduler processed it)

    def __bool__(self) -> bool:
        return bool(self.copies) or bool(len(self.vids)) or bool(len(self.new))


def arena_kinds(layout) -> list[KindSpec]:
    """The null kind (index 0) and one kind per KV cache group (index = group + 1)."""
    kinds = [KindSpec(NULL_KIND, Band.LOW, (RowSpec("page", (layout.null_page_bytes,), "uint8"),))]
    for g in layout.groups:
        rows = tuple(RowSpec(n, (g.layer_page_bytes,), "uint8") for n in g.layer_names)
        kinds.append(KindSpec(g.kind, Band(g.band), rows))
    return kinds


class ArenaState:
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
        self.new: list[int] = []  # vids allocated since the last plan
        self._sent = np.full(0, -1, np.int64)  # the v2p table the worker has (vid 0 included)
        self._sent_version = -1  # the arena's placement version ``_sent`` was taken at
        self.stats_cache = (None, {})  # (what the figures depend on, ``stats`` less fences)
        self.stats_sent = None  # the figures the last plan carried (the worker has them)
        self.dirty = False  # pages freed since the last plan (the worker's figures are stale)
        self.min_page = min(self.arena.page_bytes[1:])
        self._page_bytes = np.asarray(self.arena.page_bytes, np.int64)
        # Kinds whose new pages the worker zeroes (index = kind: the null kind, then groups).
        self._zeroed = np.asarray([False] + [g.zeroed for g in layout.groups], bool)
        # Prefix caching: every live vid's one KVCacheBlock, the kind pools (each with its
        # free-but-cached pages), those pages in the order they leave (``cache``: units of
        # the pages one request released, least recently released first), the request whose
        # pages are being released (their unit), how long a hit of a released prompt still is
        # (``hit_length(block_hashes, max_tokens)``, vLLM's lookup: set by the manager), and
        # whether vLLM's allocate_slots runs.
        self.live: dict[int, KVCacheBlock] = {}
        self.pools: list = []
        self.cache = CachedPages()
        self.owner = None
        self.hit_length = None
        self.speculative: set[int] = set()  # pages only the sibling reach keeps
        self.reach_marks = None  # (kind, block indices) of the next cache_full_blocks
        self.allocating = False
        self.cache_stats = {"cached_pages_moved": 0, "cache_evictions": 0,
                            "state_moves_saved": 0}
        self.releasing: list[int] | None = None  # inside ``batched_release``

    # A per-kind page demand this large means "not this step" (Mamba's same-step-hit sentinel).
    DEFER = 1 << 40

    def release(self, vids) -> None:
        for v in vids:
            self.live.pop(v, None)
            self.speculative.discard(v)
        if self.releasing is not None:  # one request's groups: one arena release at the end
            self.releasing.extend(vids)
            return
        self.arena.release(list(vids))
        self.dirty = True

    @contextlib.contextmanager
    def batched_release(self):
        """Pages released inside go back to the arena together, at the end."""
        self.releasing = []
        try:
            yield
        finally:
            vids, self.releasing = self.releasing, None
            if vids:
                self.arena.release(vids)
                self.dirty = True

    def cached_free_bytes(self) -> int:
        return self.cache.nbytes

    def evict_for(self, need_bytes: int, keep: set[int]) -> int:
        """The arena's reclaim: evict free-but-cached pages (never one in ``keep``: a
        request's own hits) in the cache's order until ``need_bytes`` are free; a released
        unit cut into loses too what of it no hit can use any more (no half prefix stays).
        Returns the pages evicted."""
        n = 0
        while self.arena.free_bytes < need_bytes:
            # (bytes a fence withholds come back later: loop)
            vids, cut, lowest = self.cache.victims(need_bytes - self.arena.free_bytes, keep)
            if not vids:
                break
            if cut is not None:  # what a hit of that unit's prompt keeps after the cut
                info = self.cache.info.get(cut)
                if info is not None and self.hit_length is not None:
                    for v in vids:  # (the lookup must not see the victims)
                        self._evict(v)
                    n += len(vids)
                    vids = [v for v in self.cache.remaining(cut, self.hit_length(info, lowest))
                            if v not in keep]
            for v in vids:
                self._evict(v)
            n += len(vids)
        self.cache_stats["cache_evictions"] += n
        return n

    def _evict(self, vid: int) -> None:
        blk = self.live[vid]
        blk.pool.evict_page(blk)
        if vid in self.cache:  # never loop on a page that stayed cached
            raise RuntimeError(f"ulacache arena: evicting cached page {vid} left it cached "
                               "(pool bookkeeping diverged)")

    def staged_count(self) -> int:
        return sum(len(v) for v in self.staged.values())

    def changed_vids(self) -> np.ndarray:
        """Live vids placed since the last plan (allocated, even where a freed vid came back
        at its old offset: new bytes for this step's fence) or moved (one vectorised
        comparison of the v2p table against the one the worker has; without a copy since the
        last plan nothing moved and the new vids are all). None while the arena's placement
        version is the one that table was taken at."""
        if self.arena.placement_version == self._sent_version:
            return _NO_VIDS
        v2p, _ = self.arena.placement()
        new = sorted({v for v in self.new if v2p[v] >= 0})
        if not self.copies:
            return np.array(new, np.int64) if new else _NO_VIDS
        if len(self._sent) < len(v2p):
            self._sent = np.concatenate([self._sent, np.full(len(v2p) - len(self._sent), -1)])
        changed = np.flatnonzero(v2p != self._sent[:len(v2p)])
        changed = changed[v2p[changed] >= 0]
        return np.union1d(changed, np.array(new, np.int64)) if new else changed

    def take_plan(self, changed: np.ndarray) -> ArenaStepPlan:
        version = self.arena.placement_version
        if version == self._sent_version and not self.copies and not self.new:
            return ArenaStepPlan([], _NO_VIDS, _NO_VIDS, _NO_VIDS, _NO_NEW)
        v2p, kind = self.arena.placement()
        offs = v2p[changed]
        self._sent, self._sent_version = v2p.copy(), version
        page_bytes = self._page_bytes
        # (a step's few new vids: Python sets and one array, not numpy's set routines)
        fresh = set(self.new)
        new = np.fromiter(sorted(fresh), np.int64, len(fresh))
        new = new[v2p[new] >= 0] if len(new) else new
        if self.copies and self.live:
            # Cached pages (held or free-but-cached) this plan moves (only copies move pages):
            # the copy is in the plan, their vids (and hashes) stay.
            live = self.live
            self.cache_stats["cached_pages_moved"] += sum(
                1 for v in changed.tolist()
                if v not in fresh and v in live and live[v].block_hash is not None)
        ranges = _NO_NEW
        new = new[self._zeroed[kind[new]]] if len(new) else new
        if len(new):
            ranges = np.empty((len(new), 2), np.int64)
            ranges[:, 0] = v2p[new]
            ranges[:, 1] = page_bytes[kind[new]]
        plan = ArenaStepPlan(self.copies, changed, offs // self.layout.alignment,
                             page_bytes[kind[changed]], ranges)
        self.copies, self.new = [], []
        return plan

    def record_moves(self, plan) -> None:
        self.copies.extend(plan.steps)


# A sibling's hit reaches back this far. Under vLLM's retention rule a sliding window's
# pages stay hashed only at the boundaries a hit can be proven to reach (a prompt's replay
# boundary, a shared-prefix junction once seen); stock's 128-token blocks (the CPU default)
# put the next request sharing the prompt's first ~N tokens on the same block boundary, the
# arena's 32-token pages seldom do: it would miss the hit and recompute (and hold) the whole
# shared prefix again. So the window's tail is also kept at every page boundary up to this
# many tokens before each such boundary (three more pages per boundary at W=128): every hit
# stock's 128-token blocks give, the arena gives too, from the same or a later token. Those
# extra pages are speculative (``ArenaState.speculative`` until a hit uses one): the first to
# leave the cache, so they only hold bytes stock would leave free. The arena widens vLLM's
# own mask on each sliding-window manager it owns (as it swaps their block pools).
SIBLING_REACH_TOKENS = 128


def keep_sibling_tails(managers, state) -> None:
    """Widen each sliding-window manager's retained tails (``SIBLING_REACH_TOKENS``)."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    for i, mgr in enumerate(managers):
        if isinstance(mgr, SlidingWindowManager):
            mgr.reachable_block_mask = _sibling_tails(mgr.reachable_block_mask, state, i + 1)


def _sibling_tails(mask, state, kind: int):
    def widened(*, reachable_boundaries=(), alignment_tokens=None, start_block=0, **kw):
        base = mask(reachable_boundaries=reachable_boundaries,
                    alignment_tokens=alignment_tokens, start_block=start_block, **kw)
        if base is None or not alignment_tokens or not reachable_boundaries:
            return base
        extra = []
        for b in reachable_boundaries:
            b = b // alignment_tokens * alignment_tokens
            extra.extend(b - k for k in range(alignment_tokens, SIBLING_REACH_TOKENS,
                                               alignment_tokens) if b > k)
        wide = mask(reachable_boundaries=[*reachable_boundaries, *extra],
                    alignment_tokens=alignment_tokens, start_block=start_block, **kw)
        # The pages only the reach keeps (their pool's cache_full_blocks, called next by
        # vLLM's cache_blocks, marks them speculative).
        state.reach_marks = (kind, [start_block + i for i, (w, m) in enumerate(zip(wide, base))
                                    if w and not m])
        return wide
    return widened


# GDN/mamba state in vLLM's "align" mode exists only where a prefill chunk ended: vLLM's split
# ends a prompt's prefill at its last whole block and keeps (retention 0) the state there
# and at a learnt shared-prefix junction. Stock's blocks are coarse (the CPU build grows them
# until an attention page holds a state page: 640 tokens on the tiny Qwen3-Next, 384 if its
# state is bf16), so a prompt sharing another's first ~N tokens finds it at ``floorB(len - 1)``;
# the arena's 32-token pages put it at ``floor32(len - 1)``, past where a sibling with another
# tail diverges (issue 45: 2,176 hit tokens against stock's 15,360). So under the arena a
# prompt's prefill is split as stock's is, at stock's coarse block (no fine 32-token stop: the
# same chunks and state pages as stock's), and the state at its coarse boundary is kept like
# the replay boundary's (an ordinary cached page of the prompt's unit; evicting from the end
# of the prompt keeps it last): every sibling hit stock's blocks allow, the arena allows too.
def state_checkpoint(num_prompt_tokens: int, tokens: int, drop_eagle_block: bool) -> int:
    """The coarse state checkpoint of a prompt (vLLM's own rule for its last cacheable
    block, at ``tokens``-token blocks); 0 for none."""
    from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

    if not tokens:
        return 0
    return get_mamba_prefill_checkpoint_position(num_prompt_tokens, tokens, drop_eagle_block)


def keep_state_checkpoints(managers, tokens: int, drop_eagle_block: bool) -> int:
    """Each "align"-mode GDN/mamba manager also keeps a prompt's state at its coarse
    checkpoint (``state_checkpoint``), and defers a second same-step hit of that state as
    stock's manager does at its block (``patches/mamba_same_step_hit``: stock admits one
    request hitting a prefix state per step, the arena's 32-token boundary rule none).
    Returns ``tokens``, or 0 where no manager runs "align" mode (nothing to checkpoint)."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    from ulacache_vllm.patches import mamba_same_step_hit

    found = False
    for mgr in managers:
        if tokens and isinstance(mgr, MambaManager) and mgr.mamba_cache_mode == "align":
            mgr.cache_blocks = _with_checkpoint(mgr.cache_blocks, tokens, drop_eagle_block)
            mamba_same_step_hit.install(mgr, tokens)
            found = True
    return tokens if found else 0


def _with_checkpoint(cache_blocks, tokens: int, drop_eagle_block: bool):
    def cache(request, num_tokens, retention_interval=None, *, replay_boundaries):
        stop = state_checkpoint(request.num_prompt_tokens, tokens, drop_eagle_block)
        if stop:  # (a reachable boundary: vLLM's mask keeps the state block ending there)
            replay_boundaries = (*replay_boundaries, stop)
        return cache_blocks(request, num_tokens, retention_interval,
                            replay_boundaries=replay_boundaries)
    return cache


# In "align" mode a running request's state moves to a new block each time decode crosses a
# block boundary (one more state page for a step, and a copy); at the arena's 32-token pages
# that is every 32 tokens (stock: every 640), and under pressure the page's bytes came from
# the prefix cache (issue 45, 12 MiB: a whole cached prefix evicted for one move). Past every
# boundary whose state can be kept (retention 0), the running block moves to the new column
# instead (``patches/mamba_running_state``): no page, no copy.
def keep_running_state(managers, state, retention_interval) -> int:
    """Install the relocation on each align-mode GDN/mamba manager without speculative
    blocks; returns how many took it."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    from ulacache_vllm.patches import mamba_running_state

    def counted() -> None:
        state.cache_stats["state_moves_saved"] += 1

    return sum(mamba_running_state.install(mgr, retention_interval, counted)
               for mgr in managers if isinstance(mgr, MambaManager))


class ArenaBlockPool(BlockPool):
    """A vLLM block pool over arena pages of one kind (``kind`` None: the front pool the
    coordinator and scheduler see; it forwards frees and evictions to each block's own pool
    and reports bytes as usage).

    Prefix caching: one persistent ``KVCacheBlock`` per live vid (``ArenaState.live``),
    hashed by vLLM's own ``cache_full_blocks``. A hashed page whose last holder frees it stays
    live, free but cached (in this pool's ``lru``, and in ``ArenaState.cache`` in the
    unit of the request releasing it, which orders evictions), and is hittable; it goes back
    to the arena only when the arena's reclaim evicts it (``ArenaState.evict_for``), through
    ``evict_blocks`` or ``reset_prefix_cache``. Unhashed pages go back at once."""

    def __init__(self, state: ArenaState, kind: int | None, hash_block_size: int,
                 enable_caching: bool = False, enable_kv_cache_events: bool = False) -> None:
        super().__init__(1, enable_caching=enable_caching, hash_block_size=hash_block_size,
                         enable_kv_cache_events=enable_kv_cache_events)
        self._state = state
        self._kind = kind
        self.null_block = state.null_block
        self.blocks = []  # no per-block list: vids are created on allocation
        self.lru: dict[int, KVCacheBlock] = {}  # free-but-cached pages (order: the cache's)
        if kind is not None:
            # Mamba's "hit made this step, retry next step" sentinel (num_gpu_blocks + 1)
            # must read as a demand no arena fits (``ArenaState.DEFER``).
            self.num_gpu_blocks = ArenaState.DEFER - 1
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
            if v == TRANSIENT_VID:
                out.append(st.null_block)
                continue
            if v in st.live:
                raise RuntimeError(f"ulacache arena: vid {v} handed out while still live")
            blk = KVCacheBlock(v, pool=self)
            blk.ref_cnt = 1
            st.live[v] = blk
            out.append(blk)
        return out

    def free_blocks(self, ordered_blocks) -> None:
        st = self._state
        dead, others, cached = [], {}, False
        for blk in ordered_blocks:
            if blk.is_null:
                continue
            if blk.pool is not None and blk.pool is not self:
                others.setdefault(blk.pool, []).append(blk)
                continue
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                if self.enable_caching and blk.block_hash is not None:
                    # Into the releasing request's unit (its end token orders it there).
                    self.lru[blk.block_id] = blk
                    st.cache.add(blk.block_id, st.arena.page_bytes[self._kind],
                                 blk.block_hash_num_tokens or 0, st.owner,
                                 blk.block_id in st.speculative)
                    cached = True
                else:
                    dead.append(blk.block_id)
        if cached and st.owner is None:  # released by no request: a unit of its own
            st.cache.close(None)
        if dead:
            st.release(dead)
        for pool, blocks in others.items():
            pool.free_blocks(blocks)

    def touch(self, blocks) -> None:
        for blk in blocks:
            if blk.is_null:
                continue
            if blk.ref_cnt == 0:
                self.lru.pop(blk.block_id)
                self._state.cache.remove(blk.block_id)
            self._state.speculative.discard(blk.block_id)  # a hit: no longer speculative
            blk.ref_cnt += 1

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks,
                          block_size, kv_cache_group_id, block_mask=None) -> None:
        super().cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks,
                                  block_size, kv_cache_group_id, block_mask)
        marks, self._state.reach_marks = self._state.reach_marks, None
        if marks is not None and marks[0] == self._kind:
            self._state.speculative.update(blocks[i].block_id for i in marks[1]
                                           if not blocks[i].is_null)

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
            self._state.cache.remove(blk.block_id)
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
                st.cache.remove(v)
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
