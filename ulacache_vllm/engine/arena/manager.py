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
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np
from vllm.v1.core.block_pool import BlockPool
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
    coordinator and scheduler see; it frees any kind and reports bytes as usage)."""

    def __init__(self, state: _ArenaState, kind: int | None, hash_block_size: int) -> None:
        super().__init__(1, enable_caching=False, hash_block_size=hash_block_size)
        self._state = state
        self._kind = kind
        self.null_block = state.null_block
        self.blocks = []  # no per-block list: vids are created on allocation

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        staged = self._state.staged.get(self._kind, [])
        if num_blocks > len(staged):
            raise ValueError(f"ulacache arena: {num_blocks} pages of kind {self._kind} taken, "
                             f"{len(staged)} staged (the allocation count diverged)")
        vids, self._state.staged[self._kind] = staged[:num_blocks], staged[num_blocks:]
        out = []
        for v in vids:
            blk = KVCacheBlock(v, pool=self)
            blk.ref_cnt = 1
            out.append(blk)
        return out

    def free_blocks(self, ordered_blocks) -> None:
        dead = []
        for blk in ordered_blocks:
            if blk.is_null:
                continue
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                dead.append(blk.block_id)
        if dead:
            self._state.arena.release(np.asarray(dead, np.int64))
            self._state.dirty = True

    def touch(self, blocks) -> None:  # prefix caching is off under ulacache
        for blk in blocks:
            if not blk.is_null:
                blk.ref_cnt += 1

    def get_num_free_blocks(self) -> int:
        st = self._state
        if st.staged_count():  # inside allocate_slots: exactly what was placed
            return st.staged_count()
        return st.arena.free_bytes // st.min_page

    def get_usage(self) -> float:
        a = self._state.arena
        null = a.page_bytes[0]
        return (a.used_bytes - null) / max(1, a.total_bytes - null)

    def evict_blocks(self, block_ids) -> None:
        return None

    def reset_prefix_cache(self) -> bool:
        return True


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
        for i, mgr in enumerate(self.coordinator.single_type_managers):
            mgr.block_pool = ArenaBlockPool(st, i + 1, hbs)
            mgr._null_block = st.null_block
        front = ArenaBlockPool(st, None, hbs)
        self.coordinator.block_pool = front
        self.block_pool = front
        self.arena = st.arena
        self._watermark_bytes = int(kwargs.get("watermark", 0.0) * layout.total_bytes)
        self.step_seq = 0  # steps scheduled
        self.processed_seq = 0  # steps whose output the scheduler processed
        self.fences = {"opened": 0, "passed": 0}

    # -------------------------------------------------------------- allocation
    def _group_counts(self, request, num_tokens_need_slot: int, total_computed: int,
                      num_tokens_main_model: int, prefill_end: int, cap: bool) -> dict[int, int]:
        empty = self.empty_kv_cache_blocks.blocks
        out = {}
        for i, mgr in enumerate(self.coordinator.single_type_managers):
            n = mgr.get_num_blocks_to_allocate(
                request.request_id, num_tokens_need_slot, empty[i], total_computed,
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
        if num_new_computed_tokens or num_external_computed_tokens or num_encoder_tokens:
            raise NotImplementedError("ulacache arena: prefix-cache hits, external KV and "
                                      "encoder tokens are not supported")
        total_computed = min(request.num_computed_tokens, self.max_model_len)
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if self.coordinator.retention_interval != 0:
            prefill_end = 0
        waiting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        watermark = self._watermark_bytes if has_scheduled_reqs and waiting else 0
        page = self.arena.page_bytes
        if full_sequence_must_fit or waiting:
            # The admission gate in bytes: the request's whole (capped) sequence, every kind.
            full = min(request.num_tokens, self.max_model_len)
            need = self._group_counts(request, full, total_computed, full, prefill_end, True)
            if sum(n * page[k] for k, n in need.items()) + watermark > self.arena.free_bytes:
                return None
        self.coordinator.remove_skipped_blocks(
            request.request_id, max(0, total_computed - request.num_in_flight_tokens),
            num_prompt_tokens=request.num_prompt_tokens)
        main = total_computed + num_new_tokens
        need_slot = min(main + num_lookahead_tokens, self.max_model_len)
        demands = self._group_counts(request, need_slot, total_computed, main, prefill_end, False)
        st = self._state
        if demands:
            if sum(n * page[k] for k, n in demands.items()) + watermark > self.arena.free_bytes:
                return None
            res = self.arena.allocate({self.arena.kinds[k].name: n for k, n in demands.items()})
            if not res.ok:
                return None
            st.record_moves(res.copy_plan)
            for name, vids in res.virtual_page_ids.items():
                k = self.arena.kind_index(name)
                st.staged[k] = vids.tolist()
                st.new.extend(st.staged[k])
        try:
            return super().allocate_slots(
                request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens,
                delay_cache_blocks=delay_cache_blocks, has_scheduled_reqs=has_scheduled_reqs)
        finally:
            left = st.staged_count()
            st.staged.clear()
            if left:
                raise RuntimeError(f"ulacache arena: {left} staged pages were not taken "
                                   "(the allocation count diverged from vLLM's)")

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
        plan = st.take_plan(changed, self.stats())
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
        failed = {r.request_id for r in requests
                  if any(vids.intersection(ids) for ids in self.get_block_ids(r.request_id))}
        if failed:
            logger.error("Failing %d request(s) due to KV load failure: a page move lost %d "
                         "arena pages. Request IDs: %s", len(failed), len(vids), sorted(failed))
        return failed
