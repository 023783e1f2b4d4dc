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
- Every change of placement (allocations, moves, the copy plan, the new pages, zeroed where
  vLLM zeroes its own: ``ArenaLayout.zero_new_pages``) is collected into the step's
  :class:`ArenaStepPlan`, shipped to the worker by the connector and applied before that
  step's forward.
- One ledger fence per engine step that allocates or moves pages: they are registered with
  it; it passes when the scheduler has processed that step's output. Withheld bytes make the
  scheduler wait (``has_pending_block_frees``) instead of preempting.
- A running request's next tokens (no admission, no prefix hits) take vLLM's own steps for
  that case directly, each counted once (``_allocate_running``); everything else goes
  through vLLM's ``allocate_slots`` after the arena placed the pages.
- vid 0 is the null page: the null block of every manager, pinned, never freed.

Prefix caching (vLLM's own hashing, lookup and hit rules, per group as stock):
- One persistent ``KVCacheBlock`` per live vid; hashed pages are shared read-only by every
  request that hits them. A hashed page whose last holder frees it stays live, *free but
  cached*: it keeps its vid and bytes (never zeroed: only new vids can be), counts as free in
  usage and as reclaimable in the byte admission gate (the watermark included, as stock
  counts its free-but-cached blocks); a hit takes it back.
- Eviction is the arena's reclaim, and the only way a cached page's bytes go back, as in a
  cache: only when a step's new pages need more than the free bytes (no compaction can give
  them), never for the watermark, never the pages this request hits; again only if the
  ladder still finds the free bytes too scattered (pages a step in flight pins). The order
  (``arena.cache``): the pages one request released (finish, preemption, with its window
  pages that slid out while it ran) leave together, least recently released first, from the
  end of the prompt backwards with every kind together; what of a prompt cut into no hit can
  use any more (vLLM's own lookup says how far a hit still reaches) goes with it, so no
  full-attention pages stay cached without the window tail that makes them hittable. A
  running request's released pages go last. ``evict_blocks`` (lost pages included) and
  ``reset_prefix_cache`` release them too.
- Window tails a little wider than stock's (``pools.SIBLING_REACH_TOKENS``): under vLLM's
  retention rule a sibling prompt sharing a prefix hits only where the window's pages were
  kept; stock's 128-token CPU blocks land on that boundary by coarseness, the arena's 32-token
  pages keep it a few pages wider instead (speculative pages, the first to leave), so a
  sibling does not recompute and hold a second copy of the shared prefix.
- Placement stays invisible to vLLM: compaction and relayout move cached pages, held or not,
  like any unfenced page (the copy in the step plan, the vid and its hashes unchanged);
  fences keep pages a step in flight uses from moving or being reused.
- GDN/mamba state runs vLLM's "align" mode (state checkpoints at page boundaries, the
  checkpoint page is the state's natural size); ``sizing.prepare`` pins the state block to
  the attention page, so no hit ends inside a block (no copy-on-write), and the worker
  translates align-mode state copies (``patches/mamba_align_translate``). A prompt's prefill
  is split where stock's is, at stock's coarser block (``prefill_split_block``: no stop at
  the fine 32-token boundaries), and its state stays cached there
  (``pools.keep_state_checkpoints``), so a prompt sharing its prefix with another tail hits
  where stock's blocks let it (issue 45), one such hit of a state a step as stock admits them
  (vLLM's same-step-hit rule at stock's block, ``patches/mamba_same_step_hit``). Past the
  prompt (no state is kept there) a decoding request's running state stays in its page when
  decode crosses a page, as it stays in stock's coarse block (``pools.keep_running_state``):
  no state page every 32 tokens, whose bytes under pressure came from the prefix cache
  (issue 45, 12 MiB).
"""
from __future__ import annotations

import copy

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.request import RequestStatus

from ..line import LineManager, layout_of
from .pools import (
    NULL_KIND,
    ArenaBlockPool,
    ArenaStepPlan,
    ArenaState,
    keep_running_state,
    keep_sibling_tails,
    keep_state_checkpoints,
    state_checkpoint,
)

__all__ = ["ArenaKVCacheManager", "ArenaStepPlan"]

logger = init_logger("vllm.ulacache.arena")

_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


# `_allocate_running` repeats the steps of vLLM's `KVCacheManager.allocate_slots` for a running
# request without hits; it was written against this exact upstream method.
UPSTREAM_ALLOCATE_SLOTS = ("0.32.0", "8c60d937fd9eb0c8")


def check_upstream_allocate_slots() -> None:
    """Fails loudly when vLLM's `allocate_slots` is not the one `_allocate_running` copies."""
    import hashlib
    import inspect

    from ulacache_vllm.patches._hook import VllmHookError, check_vllm_version

    hook = "arena manager's copy of KVCacheManager.allocate_slots"
    check_vllm_version(hook)
    digest = hashlib.sha256(inspect.getsource(KVCacheManager.allocate_slots).encode())
    if digest.hexdigest()[:16] != UPSTREAM_ALLOCATE_SLOTS[1]:
        raise VllmHookError(
            f"ulacache {hook}: vLLM's KVCacheManager.allocate_slots changed since vLLM "
            f"{UPSTREAM_ALLOCATE_SLOTS[0]}; port ArenaKVCacheManager._allocate_running to it "
            f"(and update UPSTREAM_ALLOCATE_SLOTS)")


check_upstream_allocate_slots()  # at import: the method as vLLM ships it, before any wrapper


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
        st = self._state = ArenaState(layout)
        hbs = self.coordinator.block_pool.hash_block_size
        events = self.coordinator.block_pool.enable_kv_cache_events
        for i, mgr in enumerate(self.coordinator.single_type_managers):
            mgr.block_pool = ArenaBlockPool(st, i + 1, hbs, self.enable_caching, events)
            mgr._null_block = st.null_block
        self._checkpoint_tokens = 0  # GDN/mamba: the coarse state checkpoint (0: none)
        if self.enable_caching:
            keep_sibling_tails(self.coordinator.single_type_managers, st)
            keep_running_state(self.coordinator.single_type_managers, st,
                               self.coordinator.retention_interval)
            self._checkpoint_tokens = keep_state_checkpoints(
                self.coordinator.single_type_managers, layout.state_checkpoint_tokens,
                self.use_eagle)
            # How long a hit of a released prompt is (vLLM's lookup), for the reclaim.
            st.hit_length = lambda hashes, n: self.coordinator.find_longest_cache_hit(
                hashes, n)[1]
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

    def allocate_slots(self, request, *args, **kwargs):
        st = self._state
        st.owner = request.request_id  # the cached pages it releases join its unit
        try:
            return self._allocate_slots(request, *args, **kwargs)
        finally:
            st.owner = None

    def _allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                        new_computed_blocks=None, num_lookahead_tokens=0,
                       num_external_computed_tokens=0, delay_cache_blocks=False,
                       num_encoder_tokens=0, full_sequence_must_fit=False, reserved_blocks=0,
                       has_scheduled_reqs=True, skip_zeroing_group_ids=()):
        if num_external_computed_tokens or num_encoder_tokens or reserved_blocks or \
                skip_zeroing_group_ids:
            # vLLM passes the last two only for async KV-connector loads (external tokens).
            raise NotImplementedError(
                "ulacache arena: external KV (async connector loads: num_external_computed_"
                "tokens, reserved_blocks, skip_zeroing_group_ids) and encoder tokens are not "
                "supported")
        if (new_computed_blocks is None and not full_sequence_must_fit and not delay_cache_blocks
                and request.status not in _WAITING):
            return self._allocate_running(request, num_new_tokens, num_new_computed_tokens,
                                          num_lookahead_tokens)
        hits = (new_computed_blocks.blocks if new_computed_blocks is not None
                else self.empty_kv_cache_blocks.blocks)
        # Free-but-cached pages this request hits: touched by vLLM below, so they are neither
        # reclaimable nor new bytes (their ref count is raised while the demand is counted).
        hit_free = [b for blks in hits for b in blks if not b.is_null and b.ref_cnt == 0]
        # (only arena pages hold arena bytes: another pool's blocks, the v4 line's CSA ones,
        # are counted by that pool)
        pages = [b for b in hit_free if isinstance(b.pool, ArenaBlockPool)]
        keep = {b.block_id for b in pages}
        page = self.arena.page_bytes
        hit_bytes = sum(page[b.pool._kind] for b in pages)
        st = self._state
        reclaimable = st.cached_free_bytes() - hit_bytes
        total_computed = min(request.num_computed_tokens + num_new_computed_tokens,
                             self.max_model_len)
        prefill_end = self._prefill_end(request)
        waiting = request.status in _WAITING
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
        if not self._place(demands, watermark, hit_bytes, keep):
            return None
        st.allocating = True
        try:
            return super().allocate_slots(
                request, num_new_tokens, num_new_computed_tokens=num_new_computed_tokens,
                new_computed_blocks=new_computed_blocks,
                num_lookahead_tokens=num_lookahead_tokens,
                delay_cache_blocks=delay_cache_blocks, has_scheduled_reqs=has_scheduled_reqs)
        finally:
            self._staged_taken()

    def _allocate_running(self, request, num_new_tokens, num_new_computed_tokens,
                          num_lookahead_tokens):
        """``allocate_slots`` of a request that is neither admitted nor given prefix hits (a
        running request's next tokens): vLLM's own steps for that case (its
        ``allocate_slots`` without hits, delayed caching or watermark), each counted once."""
        if num_new_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no "
                             "computed tokens to adopt")
        local = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(local, self.max_model_len)
        rid = request.request_id
        self.coordinator.remove_skipped_blocks(
            rid, max(0, total_computed - request.num_in_flight_tokens),
            num_prompt_tokens=request.num_prompt_tokens)
        main = total_computed + num_new_tokens
        need_slot = min(main + num_lookahead_tokens, self.max_model_len)
        demands = self._group_counts(request, need_slot, local, main,
                                     self._prefill_end(request), False)
        if not self._place(demands, 0, 0, set()):
            return None
        self._state.allocating = True
        try:
            new_blocks = self.coordinator.allocate_new_blocks(rid, need_slot, main)
            self.coordinator.cache_blocks(request, min(main, request.num_tokens))
        finally:
            self._staged_taken()
        return self.create_kv_cache_blocks(new_blocks)

    def prefill_split_block(self) -> int:
        """Stock's block for GDN/mamba hybrids (0: none): vLLM's align split runs at it, so a
        prompt's prefill chunks end where stock's do, its coarse checkpoint among them."""
        return self._checkpoint_tokens

    def prefill_checkpoint_stop(self, request) -> int:
        """Where a prompt's prefill chunk also ends when vLLM's split cannot run at stock's
        block: its coarse state checkpoint (``pools.state_checkpoint``), kept by the
        GDN/mamba managers; 0 for none."""
        return state_checkpoint(request.num_prompt_tokens, self._checkpoint_tokens,
                                self.use_eagle)

    def _prefill_end(self, request) -> int:
        if self.coordinator.retention_interval != 0:
            return 0
        return max(request.num_prompt_tokens, request.num_tokens - 1)

    def _place(self, demands: dict[int, int], watermark: int, hit_bytes: int,
               keep: set[int]) -> bool:
        """Place a step's new pages of every kind at once and stage their vids for vLLM's
        managers; False: they do not fit (nothing placed). Cached pages (never ``keep``, the
        request's own hits) are evicted only for bytes the free ones cannot give after
        compaction and relayout; the ``watermark`` (a waiting request's headroom) is checked
        against free plus cached bytes, as stock counts its free-but-cached blocks, and
        evicts nothing."""
        st = self._state
        if not demands:
            return True
        if any(n >= st.DEFER for n in demands.values()):
            return False
        page = self.arena.page_bytes
        need = sum(n * page[k] for k, n in demands.items())
        free = self.arena.free_bytes
        if need + watermark > free + st.cached_free_bytes() - hit_bytes:  # (window frees
            return False  # may have added cached pages since the gate)
        if need <= free:  # the common case: the ladder's first rung, lists
            placed = self.arena.take(demands)
            if placed is not None:
                for k, vids in placed.items():
                    st.staged[k] = vids
                    st.new.extend(vids)
                return True
        else:  # no compaction can help: the cache gives the missing bytes
            st.evict_for(need, keep)
        want = {k: n for k, n in demands.items() if n}  # (kind indices)
        res = self.arena.allocate(want)
        while not res.ok and st.evict_for(
                self.arena.free_bytes + max(res.shortfall_bytes, st.min_page), keep):
            res = self.arena.allocate(want)  # free bytes too scattered: reclaim more
        if not res.ok:
            return False
        st.record_moves(res.copy_plan)
        for name, vids in res.virtual_page_ids.items():
            k = self.arena.kind_index(name)
            st.staged[k] = vids.tolist()
            st.new.extend(st.staged[k])
        return True

    def free(self, request) -> None:
        st = self._state
        st.owner = request.request_id  # its cached pages: one unit, released now
        try:
            with st.batched_release():  # every group's pages in one arena release
                super().free(request)
        finally:
            st.owner = None
            st.cache.close(request.request_id, getattr(request, "block_hashes", None))

    def _staged_taken(self) -> None:
        st = self._state
        st.allocating = False
        if st.staged:
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
        super().take_new_block_ids()  # drained: the step plan zeroes new pages itself
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
        self.fences["opened"] += 1
        if len(changed):  # (a fence over no page would never be open: none is made)
            fence = self.arena.fence(f"step {seq}", query=lambda s=seq: self.processed_seq >= s)
            self.arena.register_use(changed, fence)
        self.arena.ledger.poll()
        st.dirty = False
        plan = st.take_plan(changed)
        # The figures travel only when one changed since the last plan; the fence counts
        # travel every step (two ints).
        figures = self._figures()
        if figures is not st.stats_sent:
            st.stats_sent = plan.stats = figures
        plan.fences = self._fence_counts()
        plan.seq = seq
        return plan

    def _figures(self) -> dict:
        """The arena's figures less the fence counts (one shared dict, rebuilt only when a
        figure can have changed)."""
        a, st = self.arena, self._state
        cached = len(st.cache)
        key = (a.version, a.stats["shortfalls"], cached, *st.cache_stats.values())
        if st.stats_cache[0] != key:
            st.stats_cache = (key, self._arena_stats(cached))
        return st.stats_cache[1]

    def _fence_counts(self) -> tuple[int, int]:
        """(opened, passed): step fences opened so far and those that passed (the null
        page's pin is the one fence that never passes)."""
        opened = self.fences["opened"]
        return opened, opened - (self.arena.ledger.num_open - 1)

    def stats(self) -> dict:
        out = dict(self._figures())
        out["arena_used_by_kind"] = dict(out["arena_used_by_kind"])
        out["arena_fences_opened"], out["arena_fences_passed"] = self._fence_counts()
        return out

    def _arena_stats(self, cached_free_pages: int) -> dict:
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
            "arena_cached_free_pages": cached_free_pages,
            "arena_cached_pages_moved": self._state.cache_stats["cached_pages_moved"],
            "arena_cache_evictions": self._state.cache_stats["cache_evictions"],
            "arena_state_moves_saved": self._state.cache_stats["state_moves_saved"],
        }

    def has_pending_frees(self) -> bool:
        # Freed pages keep the engine stepping once more (an empty step) so the worker's
        # figures (``ulacache_usage``, /metrics) catch up when the engine goes idle.
        return self._state.dirty

    def has_withheld_bytes(self) -> bool:
        return self.arena.pending_bytes > 0

    def page_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The arena pages (vids) a request holds, per group: here every group's block ids."""
        return self.get_block_ids(request_id)

    def lost_block_owners(self, vids, requests, vllm_default=None) -> set[str]:
        """The ids of ``requests`` holding any of ``vids`` in any group (vids are unique
        across kinds: one arena numbers them all). vLLM maps lost blocks to requests only for
        one group, so its default is not used."""
        vids = set(vids)
        # Lost bytes must never be hit again: their pages leave the prefix cache (free-but-
        # cached ones go back to the arena, held ones are freed with their requests).
        self.block_pool.evict_blocks(vids)
        failed = {r.request_id for r in requests
                  if any(vids.intersection(ids) for ids in self.page_ids(r.request_id))}
        if failed:
            logger.error("Failing %d request(s) due to KV load failure: a page move lost %d "
                         "arena pages. Request IDs: %s", len(failed), len(vids), sorted(failed))
        return failed
