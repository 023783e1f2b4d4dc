"""Scheduler-side ulacache KV cache manager.

vLLM's `KVCacheManager` over ulacache's *logical* block pool: block ids are logical addresses
(`block * block_size + offset` names one token's KV entry), the pool holds device + host
capacity, so admission, preemption and freeing count both tiers and no request has a device
quota. Placement (device or host, which slot) is decided in the worker by the mapping table;
this manager reports which logical blocks died so the worker releases their slots (a freed
block that stays in vLLM's prefix cache is not dead: its rows stay until the block is
evicted or reused), and keeps the whole public surface vLLM's scheduler, engine core and
connectors use (it *is* a `KVCacheManager`).

Every free path passes through one place, `_returned`: the manager's own block pool hands
every block it takes back to it, whether the manager freed them (`free`) or vLLM's scheduler
returns a deferred free straight to the pool once the step that may still write them is done
(async scheduling, pipeline parallelism: `pop_blocks_for_free` now, `free_blocks` later). A
block is reported dead only when it is back in the pool.

Prefix caching is vLLM's own over the logical pool: a free block that keeps its hash stays
live on the worker (its rows in either tier, read where they are by a later hit's attention,
promoted by settle like any read row) until it leaves the cache: evicted to be reused (the
pool's `_maybe_evict_cached_block`, reported before the step that rewrites it, so no tier or
remote-row buffer serves its old rows), evicted explicitly, or reset. A cached block whose
rows a failed copy lost leaves the cache too (`lost_block_owners`), so it is never hit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_manager import KVCacheManager

from ..line import LineManager, layout_of


@dataclass
class DsaStep:
    """The DSA line's payload of one step (scheduler -> worker)."""

    freed: list[int] = field(default_factory=list)  # logical blocks that died
    hits: list[int] = field(default_factory=list)  # cached blocks new requests took over


class UlaKVCacheManager(LineManager, KVCacheManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._freed: list[int] = []
        self._hits: list[int] = []
        # Blocks whose identity placement (logical slot == device slot) lands in the device
        # pool: while only these are live, the worker needs no translation at all.
        self._device_blocks = layout_of(self.kv_cache_config).device_blocks
        pool_free = self.block_pool.free_blocks

        def free_blocks(ordered_blocks) -> None:  # this pool's only way back: see module doc
            blocks = list(ordered_blocks)
            pool_free(blocks)
            self._returned(blocks)

        self.block_pool.free_blocks = free_blocks
        pool_evict = self.block_pool._maybe_evict_cached_block

        def evict_cached(block) -> bool:  # a free block leaving the prefix cache: module doc
            evicted = pool_evict(block)
            if evicted and block.ref_cnt == 0:  # (a running request's block stays live)
                self._freed.append(block.block_id)
            return evicted

        self.block_pool._maybe_evict_cached_block = evict_cached

    def _returned(self, blocks) -> None:
        pool = self.block_pool
        queue = pool.free_block_queue
        for blk in blocks:
            bid = blk.block_id
            if blk.ref_cnt == 0 and not blk.is_null:
                if blk.block_hash is None:
                    self._freed.append(bid)
                # else: a prefix-cache entry; its rows stay where they are (PB-LRU ages them
                # out to the host) until the block leaves the cache (module doc).
                if bid >= self._device_blocks and not self.enable_caching:
                    # vLLM reuses freed blocks first (LIFO); send blocks beyond the device
                    # range to the back so low blocks are handed out first again. (With a
                    # prefix cache the queue's order is its eviction order: left alone.)
                    queue.remove(blk)
                    queue.append(blk)

    def _cached_free_blocks(self) -> list[int]:
        return [b.block_id for b in self.block_pool.blocks
                if b.ref_cnt == 0 and not b.is_null and b.block_hash is not None]

    def reset_prefix_cache(self) -> bool:
        cached = self._cached_free_blocks()
        ok = super().reset_prefix_cache()
        if ok:
            self._freed.extend(cached)
        return ok

    def lost_block_owners(self, block_ids, running, vllm_default):
        # Cached free blocks among them leave the prefix cache (vLLM evicts only running
        # requests' blocks); the running requests holding any end as vLLM decides.
        pool = self.block_pool
        cached = {b for b in block_ids
                  if pool.blocks[b].ref_cnt == 0 and pool.blocks[b].block_hash is not None}
        if cached:
            self.evict_blocks(cached)
        return vllm_default()

    def has_pending_frees(self) -> bool:
        return bool(self._freed)

    def take_freed_blocks(self) -> list[int]:
        out, self._freed = self._freed, []
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
