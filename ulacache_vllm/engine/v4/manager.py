"""The v4 line's scheduler side: the arena's KV cache manager with DeepSeek-V4's CSA group on
a logical block pool.

Every V4 cache but the CSA compressed rows is an arena kind (`arena.manager`). The CSA group's
block ids are logical blocks of their own pool (`dsa.manager.DsaBlockPool`: vLLM's
`BlockPool` over device + host rows, recording the blocks that die), whose rows the worker
places (`rows.py`). So admission and every step count both: the arena's bytes for the other
kinds, the CSA pool's free blocks (device and host tiers together: no request has a device
quota) for the CSA rows; a CSA demand that does not fit defers the request (vLLM then waits
or preempts, as for arena bytes). The CSA kind has no arena bytes. Dead CSA blocks travel to
the worker in the step payload, which frees their rows before the step's forward. Blocks whose
rows a failed copy lost come back from the worker among the step's lost ids (`worker.py`):
the requests holding them end with an error and the blocks leave the prefix cache, as the
arena's lost pages do.

A prefill chunk's compressor-state pages that lie before the last window of the step are
transient (`states.py`): vLLM's manager gets the null block for them, the arena places only
the rest, and the admission gate counts a state kind at one window of pages per request. With
prefix caching on (retention 0, stock's default), the pages vLLM's own mask will hash (a
window's tail before the replay boundary or a junction: what a later hit reads) are not
transient, and the gate counts those tails too.
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm.logger import init_logger

from ..arena.manager import ArenaKVCacheManager
from ..arena.pools import TRANSIENT_VID, ArenaState, ArenaStepPlan
from ..dsa.manager import DsaBlockPool
from .states import (hit_tail_pages, install_window_frees, is_state_group, transient_pages,
                     transient_states, window_pages)

logger = init_logger("vllm.ulacache.v4")


@dataclass
class V4StepPayload:
    """The arena's step plan and the CSA blocks that died since the last step."""

    plan: ArenaStepPlan
    csa_dead: list[int]


class V4KVCacheManager(ArenaKVCacheManager):
    def __init__(self, kv_cache_config, *args, **kwargs):
        super().__init__(kv_cache_config, *args, **kwargs)
        csa = self.layout.csa
        self._csa_kind = csa.group + 1  # arena kind indices are group + 1
        mgr = self.coordinator.single_type_managers[csa.group]
        arena_pool = mgr.block_pool
        if arena_pool in self._state.pools:
            self._state.pools.remove(arena_pool)
        pool = DsaBlockPool(csa.num_blocks, csa.num_blocks, self.enable_caching,
                            arena_pool.hash_block_size, arena_pool.enable_kv_cache_events)
        mgr.block_pool = pool
        mgr._null_block = pool.null_block
        self.csa_pool = pool
        # Compressor-state kinds whose out-of-window pages are transient (`states.py`). With
        # prefix caching on, the pages vLLM's retention rule hashes (the window's tail before
        # a replay boundary or a junction) hold their bytes: only under retention 0, stock's
        # default (a denser rule keeps every page). kind -> (window, block size); the pages
        # handed as transient so far; this step's pending ones (a transient flag per new page).
        self._states: dict[int, tuple[int, int]] = {}
        self._transient: dict[int, list[bool]] = {}
        self.transient_state_pages = 0
        co = self.coordinator
        if transient_states(self.enable_caching, co.retention_interval,
                            bool(co.eagle_group_ids)):
            for i, g in enumerate(self.layout.groups):
                if is_state_group(g.layer_names):
                    m = co.single_type_managers[i]
                    self._states[i + 1] = (m.sliding_window, m.block_size)
                    install_window_frees(m, {})

    def _group_counts(self, request, num_tokens_need_slot: int, total_computed: int,
                      num_tokens_main_model: int, prefill_end: int, cap: bool,
                      hits=None) -> dict[int, int]:
        out = super()._group_counts(request, num_tokens_need_slot, total_computed,
                                    num_tokens_main_model, prefill_end, cap, hits)
        n = out.pop(self._csa_kind, 0)
        # The request's CSA hits count as taking free blocks too (a free-but-cached hit
        # leaves the free queue when touched; a held one is counted safe side).
        held = 0 if hits is None else sum(1 for b in hits[self._csa_kind - 1] if not b.is_null)
        if n + held > self.csa_pool.get_num_free_blocks():
            out[self._csa_kind] = ArenaState.DEFER  # (reads as a demand no arena fits)
        for k, (window, bs) in self._states.items():
            n = out.get(k, 0)
            if not n or n >= ArenaState.DEFER:
                continue
            if cap:  # the admission gate: one window of pages (and the kept tails)
                out[k] = min(n, window_pages(window, bs) + self._kept_tail_pages(request, k))
                continue
            first_new = -(-num_tokens_need_slot // bs) - n  # vLLM's allocate_new_blocks
            tr = transient_pages(first_new, n, num_tokens_main_model, window, bs)
            if not tr:
                continue
            flags = [True] * tr + [False] * (n - tr)
            if self.enable_caching:
                kept = self._kept(request, k, first_new, tr)
                if kept is None:
                    continue
                flags[:tr] = [not m for m in kept]
            tr = sum(flags)
            if tr:
                self._transient[k] = flags
                if n == tr:
                    del out[k]
                else:
                    out[k] = n - tr
        return out

    def _boundaries(self, request) -> list[int]:
        """The positions vLLM's `cache_blocks` keeps a window's tail before (its own rule)."""
        from vllm.v1.core.kv_cache_coordinator import replay_boundaries

        out = [*replay_boundaries(request.num_prompt_tokens,
                                  self.coordinator.scheduler_block_size, use_eagle=False)]
        if request.shared_prefix_boundary:
            out.append(request.shared_prefix_boundary)
        return out

    def _kept(self, request, kind: int, first: int, count: int) -> list[bool] | None:
        """Which of a state kind's pages ``first .. first + count`` vLLM will hash (the
        manager's own mask, as `cache_blocks` calls it; the arena's reach marks untouched):
        those hold their bytes. None: every page."""
        mgr = self.coordinator.single_type_managers[kind - 1]
        marks = self._state.reach_marks
        try:
            return mgr.reachable_block_mask(
                start_block=first, end_block=first + count,
                alignment_tokens=mgr.cache_hit_alignment_tokens, kv_cache_spec=mgr.kv_cache_spec,
                use_eagle=mgr.use_eagle, retention_interval=self.coordinator.retention_interval,
                reachable_boundaries=self._boundaries(request),
                dcp_world_size=mgr.dcp_world_size)
        finally:
            self._state.reach_marks = marks

    def _kept_tail_pages(self, request, kind: int) -> int:
        """The pages a step may keep below the window with prefix caching on: a hit's
        contiguous pages before each boundary."""
        if not self.enable_caching:
            return 0
        return len(self._boundaries(request)) * hit_tail_pages(*self._states[kind])

    def _place(self, demands, watermark, hit_bytes, keep) -> bool:
        """The arena's placement of the real pages, then this step's transient state pages
        staged among them (a state kind's new pages ascend by position; the arena's vids
        fill the pages not transient, in order)."""
        transient, self._transient = self._transient, {}
        if not super()._place(demands, watermark, hit_bytes, keep):
            return False
        staged = self._state.staged
        for k, flags in transient.items():
            real = iter(staged.get(k, ()))
            staged[k] = [TRANSIENT_VID if t else next(real) for t in flags]
            assert next(real, None) is None, "v4 states: more pages placed than staged"
            self.transient_state_pages += sum(flags)
        return True

    def page_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The arena's groups only: the CSA group's ids are logical blocks of its own pool (a
        lost arena page with the same number is not one of them)."""
        ids = self.get_block_ids(request_id)
        return tuple(g for i, g in enumerate(ids) if i != self.layout.csa.group)

    def lost_block_owners(self, block_ids, requests, vllm_default=None) -> set[str]:
        """The arena's lost pages (ids >= 0) and the CSA pool's lost blocks (< 0: the worker's
        ``csa_lost_id``): the requests holding any end with an error; lost CSA blocks leave
        the prefix cache (a free cached one's rows die with it, a held one is freed uncached)."""
        requests = list(requests)
        vids = {b for b in block_ids if b >= 0}
        csa = {-1 - b for b in block_ids if b < 0}
        failed = super().lost_block_owners(vids, requests) if vids else set()
        if csa:
            self.csa_pool.evict_blocks(csa)
            g = self.layout.csa.group
            mine = {r.request_id for r in requests
                    if csa.intersection(self.get_block_ids(r.request_id)[g])}
            if mine:
                logger.error("Failing %d request(s) due to KV load failure: a CSA row move lost "
                             "rows of %d logical blocks. Request IDs: %s", len(mine), len(csa),
                             sorted(mine))
            failed |= mine
        return failed

    def take_step(self) -> V4StepPayload:
        dead, self.csa_pool.dead = self.csa_pool.dead, []
        return V4StepPayload(super().take_step(), dead)

    def step_processed(self, payload: V4StepPayload) -> None:
        super().step_processed(payload.plan)

    def has_pending_frees(self) -> bool:
        return super().has_pending_frees() or bool(self.csa_pool.dead)

    def reset_prefix_cache(self) -> bool:
        cached = self.csa_pool.cached_free_blocks()  # (their rows die with the cache)
        if not super().reset_prefix_cache():
            return False
        ok = self.csa_pool.reset_prefix_cache()
        if ok:
            self.csa_pool.dead.extend(cached)
        return ok

    def stats(self) -> dict:
        out = super().stats()
        out["csa_free_blocks"] = self.csa_pool.get_num_free_blocks()
        out["transient_state_pages"] = self.transient_state_pages
        return out
