"""Scheduler side of ulacache with vLLM's prefix cache on: which freed logical blocks the
worker is told to release. vLLM's CPU build turns prefix caching off for MLA models, so this
drives `UlaKVCacheManager` directly with vLLM's own request hashing and block pool."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from ulacache_vllm.engine.dsa.manager import UlaKVCacheManager
from ulacache_vllm.engine.line import UlaKVCacheConfig

# Manager-level runs take seconds: a hang (a reclaim loop once did) fails fast, not at
# the suite's 900 s per-test limit.
pytestmark = pytest.mark.timeout(120)

BS = 16


@pytest.fixture
def manager():
    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cfg = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    cfg = UlaKVCacheConfig.of(cfg, SimpleNamespace(device_blocks=0))
    return UlaKVCacheManager(cfg, max_model_len=512, scheduler_block_size=BS,
                             hash_block_size=BS, enable_caching=True)


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), None,
                   block_hasher=get_request_block_hasher(BS, sha256))


def _run(mgr, req) -> list[int]:
    """Schedule the whole prompt (reusing cached blocks), return the request's block ids."""
    computed, n_computed, _ = mgr.get_computed_blocks(req)
    blocks = mgr.allocate_slots(req, req.num_tokens - n_computed, n_computed, computed)
    assert blocks is not None
    req.num_computed_tokens = req.num_tokens
    return [b for b in mgr.get_block_ids(req.request_id)[0]]


def test_cached_blocks_are_not_released_until_evicted_or_reset(manager):
    shared = list(range(1, 4 * BS + 1))  # 4 full blocks
    a = _request("a", shared + [900, 901, 902])  # + a partial 5th block
    ids_a = _run(manager, a)
    assert len(ids_a) == 5
    manager.free(a)
    dead = manager.take_freed_blocks()
    # Only the partial block died; the 4 full ones stay in the prefix cache with their rows.
    assert dead == [ids_a[4]]

    manager.take_step()
    b = _request("b", shared + [700])
    ids_b = _run(manager, b)
    assert ids_b[:4] == ids_a[:4]  # prefix hit: the cached blocks (and their rows) reused
    assert manager.take_step().hits == ids_a[:4]  # the worker counts where their rows sit
    manager.free(b)
    assert manager.take_freed_blocks() == [ids_b[4]]

    assert manager.reset_prefix_cache()
    assert sorted(manager.take_freed_blocks()) == sorted(ids_a[:4])


def test_evicted_cache_blocks_are_released(manager):
    a = _request("a", list(range(1, 2 * BS + 1)))
    ids_a = _run(manager, a)
    manager.free(a)
    assert manager.take_freed_blocks() == []
    manager.evict_blocks({ids_a[0]})
    assert manager.take_freed_blocks() == [ids_a[0]]


def test_deferred_free_skips_shared_blocks(manager):
    shared = list(range(1, 2 * BS + 1))
    a, b = _request("a", shared + [5]), _request("b", shared + [6])
    ids_a, ids_b = _run(manager, a), _run(manager, b)
    assert ids_a[:2] == ids_b[:2]  # b shares a's two full blocks
    # Drop the shared blocks from the prefix cache while both requests hold them: after that
    # only the reference count keeps them alive.
    manager.evict_blocks(set(ids_a[:2]))
    assert manager.take_freed_blocks() == []  # still referenced: not dead
    popped = manager.pop_blocks_for_free(a)  # deferred free (async scheduling)
    # Nothing is dead while a step in flight may still write the blocks ...
    assert manager.take_freed_blocks() == []
    # ... until vLLM returns them to the pool: a's partial block dies; the shared blocks live
    # on in b.
    manager.block_pool.free_blocks(reversed(popped))
    assert manager.take_freed_blocks() == [ids_a[2]]
    manager.free(b)
    # Now nothing holds them and they are no longer cached: dead, with b's partial block.
    assert sorted(manager.take_freed_blocks()) == sorted(ids_b)


@pytest.mark.parametrize("deferred", [False, True])
def test_every_free_path_reports_and_orders_blocks_alike(deferred):
    """vLLM's scheduler returns a deferred free straight to the block pool (several batches in
    flight); it must pass through the manager like a normal free: the same blocks reported
    dead, and blocks beyond the device range sent to the back of the free queue, so the
    device-range blocks are handed out first again."""
    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cfg = KVCacheConfig(num_blocks=16, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    cfg = UlaKVCacheConfig.of(cfg, SimpleNamespace(device_blocks=4))  # blocks 0-3
    mgr = UlaKVCacheManager(cfg, max_model_len=512, scheduler_block_size=BS,
                            hash_block_size=BS, enable_caching=False)
    req = _request("a", list(range(1, 8 * BS + 1)))  # 8 blocks: 1..8 (0 is the null block)
    ids = _run(mgr, req)
    assert sorted(ids) == list(range(1, 9))
    if deferred:
        popped = mgr.pop_blocks_for_free(req)
        assert mgr.take_freed_blocks() == []
        mgr.block_pool.free_blocks(reversed(popped))  # as Scheduler._drain_deferred_frees
    else:
        mgr.free(req)
    assert sorted(mgr.take_freed_blocks()) == ids
    head = []
    blk = mgr.block_pool.free_block_queue.fake_free_list_head.next_free_block
    while blk is not None and len(head) < 3:
        head.append(blk.block_id)
        blk = blk.next_free_block
    assert set(head) == {1, 2, 3}, head  # device-range blocks first, whatever the path


def test_cached_blocks_taken_for_reuse_are_released_before_their_rewrite(manager):
    """vLLM evicts a free cached block lazily, when the pool hands it out again; the worker
    must hear of it in the same step's payload (before the new owner's rows are written),
    else a tier or a TP remote-row buffer could serve the old rows at those addresses."""
    a = _request("a", list(range(1, 3 * BS + 1)))  # 3 full blocks, all cached
    ids_a = _run(manager, a)
    manager.free(a)
    assert manager.take_step().freed == []  # cached: live on the worker
    # Fill the pool: every other free block first (vLLM hands cached blocks out last), then
    # a's cached blocks are evicted and reused.
    taken, i = [], 0
    while not set(ids_a) <= set(taken):
        n = min(manager.block_pool.get_num_free_blocks(), 512 // BS)
        assert n > 0
        taken += _run(manager, _request(f"b{i}", list(range(1000 * (i + 1),
                                                            1000 * (i + 1) + n * BS))))
        i += 1
    assert sorted(manager.take_step().freed) == sorted(ids_a)  # reported once, by this step


def test_lost_cached_blocks_leave_the_prefix_cache(manager):
    """A cached free block whose rows a failed copy lost is evicted (never hit again) and
    reported dead; vLLM's own handling decides the running requests' fate."""
    a = _request("a", list(range(1, 2 * BS + 1)))
    ids_a = _run(manager, a)
    manager.free(a)
    manager.take_step()
    calls = []
    out = manager.lost_block_owners({ids_a[0]}, [], lambda: calls.append(1) or {"x"})
    assert out == {"x"} and calls == [1]
    assert manager.take_step().freed == [ids_a[0]]
    b = _request("b", list(range(1, 2 * BS + 1)) + [5])
    _, n_hit, _ = manager.get_computed_blocks(b)
    assert n_hit == 0  # the chain's first block is gone: no hit


def test_the_pool_is_the_dsa_subclass_shared_by_every_group_over_every_block():
    """The DSA pool is a `BlockPool` subclass swapped in after vLLM builds its coordinator (as
    the arena swaps in its pool): one pool over the whole config, the one every group, the
    coordinator and the manager use, with vLLM's figures from the whole block count."""
    from ulacache_vllm.engine.dsa.manager import DsaBlockPool

    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cfg = KVCacheConfig(num_blocks=40, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec),
                                         KVCacheGroupSpec(["layer.1"], spec)])
    cfg = UlaKVCacheConfig.of(cfg, SimpleNamespace(device_blocks=8))
    mgr = UlaKVCacheManager(cfg, max_model_len=512, scheduler_block_size=BS,
                            hash_block_size=BS, enable_caching=True, watermark=0.1)
    pool = mgr.block_pool
    assert type(pool) is DsaBlockPool and pool.device_blocks == 8
    assert mgr.coordinator.block_pool is pool and len(pool.blocks) == 40
    assert all(m.block_pool is pool and m._null_block is pool.null_block
               for m in mgr.coordinator.single_type_managers)
    assert mgr.kv_cache_config is cfg and mgr.coordinator.kv_cache_config is cfg
    assert mgr.watermark_blocks == 4 and pool.get_num_free_blocks() == 39
    assert "free_blocks" not in vars(pool)  # no per-instance replacement left


def test_the_installed_block_pool_is_the_one_overridden():
    from ulacache_vllm.engine.dsa import manager as m

    m.check_upstream_block_pool()


def test_a_changed_block_pool_or_version_fails_loudly(monkeypatch):
    from vllm.v1.core.block_pool import BlockPool

    from ulacache_vllm.engine.dsa import manager as m
    from ulacache_vllm.patches._hook import VllmHookError

    def free_blocks(self, blocks, extra):  # other parameters
        return None

    monkeypatch.setattr(BlockPool, "free_blocks", free_blocks)
    with pytest.raises(VllmHookError, match="DsaBlockPool.free_blocks"):
        m.check_upstream_block_pool()
    monkeypatch.undo()

    def evict_blocks(self, block_ids):  # no longer through _maybe_evict_cached_block
        return None

    monkeypatch.setattr(BlockPool, "evict_blocks", evict_blocks)
    with pytest.raises(VllmHookError, match="evict_blocks"):
        m.check_upstream_block_pool()
    monkeypatch.undo()
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(VllmHookError, match="0.33.0"):
        m.check_upstream_block_pool()
