"""Scheduler-side ulacache KV cache manager.

vLLM's `KVCacheManager` over ulacache's *logical* block pool: block ids are logical addresses
(`block * block_size + offset` names one token's KV entry), the pool holds device + host
capacity, so admission, preemption and freeing count both tiers and no request has a device
quota. Placement (device or host, which slot) is decided in the worker by the mapping table;
this manager reports which logical blocks died so the worker releases their slots (a freed
block that stays in vLLM's prefix cache is not dead: its rows stay until the block is
evicted or reused), and keeps the whole public surface vLLM's scheduler, engine core and
connectors use (it *is* a `KVCacheManager`).

The pool is `DsaBlockPool`, vLLM's `BlockPool` with two methods overridden, swapped in for the
coordinator's own after vLLM builds it (as the arena swaps in its `ArenaBlockPool`). Every
free path passes through one place, its `free_blocks`: the pool records every block taken
back, whether the manager freed them (`free`) or vLLM's scheduler returns a deferred free
straight to the pool once the step that may still write them is done (async scheduling,
pipeline parallelism: `pop_blocks_for_free` now, `free_blocks` later). A block is reported
dead only when it is back in the pool.

Prefix caching is vLLM's own over the logical pool: a free block that keeps its hash stays
live on the worker (its rows in either tier, read where they are by a later hit's attention,
promoted by settle like any read row) until it leaves the cache: evicted to be reused (the
pool's `_maybe_evict_cached_block`, reported before the step that rewrites it, so no tier or
remote-row buffer serves its old rows), evicted explicitly, or reset. A cached block whose
rows a failed copy lost leaves the cache too (`lost_block_owners`), so it is never hit.
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager

from ..line import LineManager, layout_of

# The `BlockPool` methods `DsaBlockPool` overrides (each calls vLLM's own first), with the
# parameters they were written against; and the methods that must reach a cached block's
# eviction through the overridden `_maybe_evict_cached_block` (reuse, explicit eviction).
UPSTREAM_BLOCK_POOL = ("0.32.0", {"free_blocks": ("self", "ordered_blocks"),
                                  "_maybe_evict_cached_block": ("self", "block")})
EVICTION_CALLERS = ("get_new_blocks", "evict_blocks")


def check_upstream_block_pool() -> None:
    """Fails loudly when vLLM's `BlockPool` is not the one `DsaBlockPool` overrides."""
    from ulacache_vllm.patches._hook import VllmHookError, check_vllm_version, resolve

    hook = "DSA line's block pool (DsaBlockPool over BlockPool)"
    check_vllm_version(hook)
    module = "vllm.v1.core.block_pool"
    for name, params in UPSTREAM_BLOCK_POOL[1].items():
        _, fn = resolve(module, f"BlockPool.{name}", hook)
        got = tuple(inspect.signature(fn).parameters)
        if got != params:
            raise VllmHookError(f"ulacache {hook}: vLLM's BlockPool.{name} takes {got}, "
                                f"written for {params} (vLLM {UPSTREAM_BLOCK_POOL[0]}); "
                                f"port DsaBlockPool.{name}")
    for name in EVICTION_CALLERS:
        _, fn = resolve(module, f"BlockPool.{name}", hook)
        if "self._maybe_evict_cached_block(" not in inspect.getsource(fn):
            raise VllmHookError(f"ulacache {hook}: vLLM's BlockPool.{name} no longer evicts "
                                f"through _maybe_evict_cached_block; port DsaBlockPool")


check_upstream_block_pool()  # at import, like the arena's check of what it copies


@dataclass
class DsaStep:
    """The DSA line's payload of one step (scheduler -> worker)."""

    freed: list[int] = field(default_factory=list)  # logical blocks that died
    hits: list[int] = field(default_factory=list)  # cached blocks new requests took over


class DsaBlockPool(BlockPool):
    """vLLM's block pool over the logical address space that records the blocks that die
    (``dead``, taken by the manager each step): blocks back in the pool with no hash, and
    free cached blocks leaving the prefix cache (module doc). ``device_blocks``: the blocks
    whose identity placement (logical slot == device slot) lands in the device pool."""

    def __init__(self, num_gpu_blocks: int, device_blocks: int, enable_caching: bool,
                 hash_block_size: int, enable_kv_cache_events: bool = False,
                 metrics_collector=None) -> None:
        super().__init__(num_gpu_blocks, enable_caching=enable_caching,
                         hash_block_size=hash_block_size,
                         enable_kv_cache_events=enable_kv_cache_events,
                         metrics_collector=metrics_collector)
        self.device_blocks = device_blocks
        self.dead: list[int] = []

    def free_blocks(self, ordered_blocks) -> None:  # this pool's only way back: module doc
        blocks = list(ordered_blocks)
        super().free_blocks(blocks)
        self._returned(blocks)

    def _maybe_evict_cached_block(self, block) -> bool:  # leaving the prefix cache: module doc
        evicted = super()._maybe_evict_cached_block(block)
        if evicted and block.ref_cnt == 0:  # (a running request's block stays live)
            self.dead.append(block.block_id)
        return evicted

    def _returned(self, blocks) -> None:
        queue = self.free_block_queue
        for blk in blocks:
            bid = blk.block_id
            if blk.ref_cnt == 0 and not blk.is_null:
                if blk.block_hash is None:
                    self.dead.append(bid)
                # else: a prefix-cache entry; its rows stay where they are (PB-LRU ages them
                # out to the host) until the block leaves the cache (module doc).
                if bid >= self.device_blocks and not self.enable_caching:
                    # vLLM reuses freed blocks first (LIFO); send blocks beyond the device
                    # range to the back so low blocks are handed out first again. (With a
                    # prefix cache the queue's order is its eviction order: left alone.)
                    queue.remove(blk)
                    queue.append(blk)

    def cached_free_blocks(self) -> list[int]:
        return [b.block_id for b in self.blocks
                if b.ref_cnt == 0 and not b.is_null and b.block_hash is not None]


class UlaKVCacheManager(LineManager, KVCacheManager):
    def __init__(self, kv_cache_config, *args, **kwargs):
        # vLLM's coordinator builds one block object per block: give it a one-block config
        # (only its null block), then swap its pool for the DSA pool over every block.
        small = copy.copy(kv_cache_config)
        small.num_blocks = 1
        super().__init__(small, *args, **kwargs)
        # What vLLM derived from the block count, from the whole config again.
        self.kv_cache_config = self.coordinator.kv_cache_config = kv_cache_config
        watermark = inspect.signature(KVCacheManager.__init__).bind(
            self, kv_cache_config, *args, **kwargs).arguments.get("watermark", 0.0)
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        stock = self.coordinator.block_pool
        pool = DsaBlockPool(kv_cache_config.num_blocks,
                            layout_of(kv_cache_config).device_blocks, stock.enable_caching,
                            stock.hash_block_size, stock.enable_kv_cache_events,
                            stock.metrics_collector)
        for mgr in self.coordinator.single_type_managers:
            if mgr.block_pool is stock:
                mgr.block_pool = pool
                mgr._null_block = pool.null_block
        self.coordinator.block_pool = pool
        self.block_pool = pool
        self._hits: list[int] = []

    def reset_prefix_cache(self) -> bool:
        cached = self.block_pool.cached_free_blocks()
        ok = super().reset_prefix_cache()
        if ok:
            self.block_pool.dead.extend(cached)
        return ok

    def lost_block_owners(self, block_ids, holders, vllm_default):
        # Cached free blocks among them leave the prefix cache (vLLM evicts only running
        # requests' blocks); the running requests holding any end as vLLM decides. A waiting
        # request that keeps its blocks (a streaming session between inputs, which vLLM's
        # mapping skips) and holds one ends too, the block evicted (freed uncached later).
        from vllm.v1.request import RequestStatus

        pool = self.block_pool
        cached = {b for b in block_ids
                  if pool.blocks[b].ref_cnt == 0 and pool.blocks[b].block_hash is not None}
        if cached:
            self.evict_blocks(cached)
        failed = set(vllm_default())
        lost = set(block_ids)
        waiting = {r.request_id: lost.intersection(b for g in self.get_block_ids(r.request_id)
                                                   for b in g)
                   for r in holders if r.status != RequestStatus.RUNNING}
        held = set().union(*waiting.values())
        if held:
            self.evict_blocks(held)
        return failed | {rid for rid, ids in waiting.items() if ids}

    def has_pending_frees(self) -> bool:
        return bool(self.block_pool.dead)

    def take_freed_blocks(self) -> list[int]:
        pool = self.block_pool
        out, pool.dead = pool.dead, []
        return out

    def take_step(self) -> DsaStep:
        hits, self._hits = self._hits, []
        return DsaStep(self.take_freed_blocks(), hits)

    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                       new_computed_blocks=None, *args, **kwargs):
        out = super().allocate_slots(request, num_new_tokens, num_new_computed_tokens,
                                     new_computed_blocks, *args, **kwargs)
        if out is not None and num_new_computed_tokens and new_computed_blocks is not None:
            self._hits.extend(b.block_id for b in new_computed_blocks.blocks[0] if not b.is_null)
        return out

    @property
    def num_used_blocks(self) -> int:
        pool = self.block_pool
        return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
