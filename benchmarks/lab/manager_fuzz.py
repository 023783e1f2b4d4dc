"""Fuzz driver for the scheduler-facing manager and the worker store together, against a
reference model of which request holds which logical blocks.

Random admit / append / finish / preempt / abort / deferred-free sequences run on a real
`UlaKVCacheManager` (vLLM's block pool and single-type managers, no engine); every step's
frees and new token slots go to a real `UlaWorkerStore` (tiny pools, so rows spill to the
host), as the connector carries them. After every operation:

* no block is held twice or is the null block; every live request holds exactly the blocks
  its tokens need; the pool's free count is the total less what is held or waiting in a
  deferred free;
* a block is reported dead only once it is back in the pool, never while held or pending,
  and never twice without being allocated again;
* the worker holds a row for exactly the live tokens' logical slots (device + host used).

At the end everything is released: the pool is full again and the worker's pools are empty.
`tests/test_manager_fuzz.py` runs a few thousand operations; `benchmarks/fuzz_manager.py`
runs 10^5 or more.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

BS = 16


@dataclass
class FuzzStats:
    ops: dict = field(default_factory=dict)
    refused: int = 0  # admissions / appends the pool could not hold
    reported_dead: int = 0
    worker_promotions: int = 0
    worker_demotions: int = 0
    hit_tokens: int = 0  # prompt tokens admissions took from the prefix cache
    resets: int = 0  # prefix-cache resets that went through
    hit_entries_host: int = 0  # hit entries that sat in the host tier
    reuse_evictions: int = 0  # cached free blocks evicted to be handed out again


def _manager(num_blocks: int, device_blocks: int, caching: bool = False):
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from ulacache_vllm.engine.dsa.manager import UlaKVCacheManager
    from ulacache_vllm.engine.line import UlaKVCacheConfig

    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    cfg = UlaKVCacheConfig.of(cfg, SimpleNamespace(device_blocks=device_blocks))
    return UlaKVCacheManager(cfg, max_model_len=num_blocks * BS, scheduler_block_size=BS,
                             hash_block_size=BS, enable_caching=caching)


def _store(num_blocks: int, device_blocks: int):
    from ulacache_vllm.engine.config import UlaSettings
    from ulacache_vllm.engine.dsa.sizing import UlaLayout
    from ulacache_vllm.engine.dsa.store import UlaWorkerStore

    layers = ["l.0"]
    host_blocks = num_blocks - device_blocks
    layout = UlaLayout(block_size=BS, device_slots=device_blocks * BS,
                       host_slots=host_blocks * BS, num_logical=num_blocks * BS,
                       num_blocks=num_blocks, mla_layers=layers, leaders=layers,
                       mla_row_bytes={"l.0": 16}, mla_head_size=4, mla_dtype="float32",
                       indexer_bytes_per_token=0)
    mods = {n: SimpleNamespace(kv_cache=None, impl=SimpleNamespace()) for n in layers}
    return UlaWorkerStore(layout, UlaSettings(), mods, torch.device("cpu")), mods


def run(seed: int, num_ops: int, num_blocks: int = 48, device_blocks: int = 8,
        worker: bool = True, caching: bool = False) -> FuzzStats:
    """``caching``: vLLM's prefix caching on; prompts start with one of a few shared prefixes,
    admissions take prefix hits, cached free blocks stay live on the worker until they leave
    the cache (reuse, reset), and a ``reset`` operation clears the cache."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    from ulacache_vllm.engine.dsa.worker import DsaWorker

    rng = random.Random(seed)
    mgr = _manager(num_blocks, device_blocks, caching)
    hasher = get_request_block_hasher(BS, sha256) if caching else None
    prng = random.Random(seed + 1000)  # (its own stream: the runs without caching are unchanged)
    prefixes = [[prng.randint(1, 999) for _ in range(prng.randint(1, 3) * BS)] for _ in range(3)]
    store, mods = _store(num_blocks, device_blocks) if worker else (None, None)
    stats = FuzzStats()
    live: dict[str, Request] = {}
    deferred: deque[tuple[int, list]] = deque()  # (op index it may return at, blocks)
    reported_dead: set[int] = set()  # dead and reported, not allocated since
    step_freed: list[int] = []
    step_new: list[int] = []  # logical slots written this step
    step_hits: list[int] = []  # cached blocks admissions took over this step
    fresh: set[int] = set()  # blocks handed out by this operation
    counter = [0]

    def slots_of(req, start: int, end: int) -> list[int]:
        ids = mgr.get_block_ids(req.request_id)[0]
        return [ids[p // BS] * BS + p % BS for p in range(start, end)]

    def allocate(req, n: int, hit_blocks=None, n_hit: int = 0) -> bool:
        before = req.num_computed_tokens
        had = set(mgr.get_block_ids(req.request_id)[0]) if req.request_id in live else set()
        if hit_blocks is not None:
            had |= {b.block_id for b in hit_blocks.blocks[0]}
        if mgr.allocate_slots(req, n, n_hit, hit_blocks) is None:
            stats.refused += 1
            return False
        for b in mgr.get_block_ids(req.request_id)[0]:
            reported_dead.discard(b)
            if b not in had:
                fresh.add(b)
        req.num_computed_tokens = before + n_hit + n
        step_new.extend(slots_of(req, before + n_hit, before + n_hit + n))
        return True

    def admit():
        counter[0] += 1
        rid = f"r{counter[0]}"
        head = list(rng.choice(prefixes)) if caching and rng.random() < 0.7 else []
        # At most 6 blocks of prompt: a step's writes fit the device pool, as sizing ensures.
        tokens = head + [rng.randint(1, 999) for _ in range(rng.randint(1, 6 * BS - len(head)))]
        req = Request(rid, tokens, SamplingParams(max_tokens=1 << 20), None,
                      block_hasher=hasher)
        hit_blocks, n_hit = (mgr.get_computed_blocks(req)[:2] if caching else (None, 0))
        if allocate(req, len(tokens) - n_hit, hit_blocks, n_hit):
            live[rid] = req
            stats.hit_tokens += n_hit

    def append():
        req = live[rng.choice(sorted(live))]
        k = rng.randint(1, 2 * BS)
        for _ in range(k):
            req.append_output_token_ids(rng.randint(1, 999))
        allocate(req, k)  # refused: the request keeps its blocks (the scheduler would preempt)

    def release(kind: str):
        rid = rng.choice(sorted(live))
        req = live.pop(rid)
        if kind == "deferred":
            blocks = mgr.pop_blocks_for_free(req)
            deferred.append((i + rng.randint(1, 5), blocks))
        else:  # finish, abort and preemption free the same way on this side
            mgr.free(req)

    def drain(now: int, everything: bool = False):
        while deferred and (everything or deferred[0][0] <= now):
            _, blocks = deferred.popleft()
            mgr.block_pool.free_blocks(reversed(blocks))  # as Scheduler._drain_deferred_frees

    def check():
        held = [b for r in live.values() for b in mgr.get_block_ids(r.request_id)[0]]
        for r in live.values():
            ids = mgr.get_block_ids(r.request_id)[0]
            assert len(ids) == len(set(ids)), "a block held twice by one request"
        if not caching:  # (with it, requests share their cached prefix blocks)
            assert len(held) == len(set(held)), "a block held twice"
        assert 0 not in held, "the null block handed out"
        for r in live.values():
            need = -(-r.num_computed_tokens // BS)
            assert len(mgr.get_block_ids(r.request_id)[0]) == need, r.request_id
        pending = [b.block_id for _, bl in deferred for b in bl]
        free = mgr.block_pool.get_num_free_blocks()
        in_use = set(held) | set(pending)
        assert free == num_blocks - 1 - len(in_use), (free, len(held), len(pending))
        step = mgr.take_step()
        dead = step.freed
        step_hits.extend(step.hits)
        for b in dead:
            if b in fresh:  # a cached block evicted to be handed out again: its old rows die
                assert caching, f"block {b} reported dead as it was handed out"
                stats.reuse_evictions += 1
                continue
            assert b not in held and b not in pending, f"block {b} reported dead while in use"
            assert b not in reported_dead, f"block {b} reported dead twice"
            reported_dead.add(b)
        fresh.clear()
        stats.reported_dead += len(dead)
        step_freed.extend(dead)

    def worker_step():
        """The connector's step: frees and new slots to the worker, the rows written (value =
        logical slot), then a random read of live tokens checked row by row."""
        if store is None:
            return
        sm = torch.tensor(step_new, dtype=torch.int64)
        if step_hits:
            DsaWorker(store).count_prefix_hits(list(step_hits))  # the worker's counting
        step_hits.clear()
        store.begin_step(list(step_freed), {"l.0": sm})
        t = mods["l.0"].impl.translator
        rows = t.write_slots("l.0", sm)
        mods["l.0"].kv_cache.view(-1, 4).index_copy_(
            0, rows, sm.float().unsqueeze(1).expand(-1, 4).contiguous())
        step_freed.clear()
        step_new.clear()
        u = store.usage()
        used = u["device_used"] + u["host_used"]
        # Rows are freed per whole block, when the block is back in the pool and (with
        # prefix caching) out of the cache.
        held = {b for r in live.values() for b in mgr.get_block_ids(r.request_id)[0]}
        held |= {b.block_id for _, bl in deferred for b in bl}
        cached = {b.block_id for b in mgr.block_pool.blocks
                  if b.ref_cnt == 0 and not b.is_null and b.block_hash is not None}
        written = {s for r in live.values() for s in slots_of(r, 0, r.num_computed_tokens)}
        assert len(written) <= used <= len(held | cached) * BS, used
        if live:
            tokens = [s for r in live.values() for s in slots_of(r, 0, r.num_computed_tokens)]
            sel = torch.tensor(rng.sample(tokens, min(len(tokens), 24)), dtype=torch.int64)
            dev, staged = t.resolve("l.0", sel.unsqueeze(0), None)
            got = torch.full((sel.numel(),), -1.0)
            on_dev = dev[0] >= 0
            got[on_dev] = mods["l.0"].kv_cache.view(-1, 4)[dev[0][on_dev], 0]
            for ids, rows in zip(staged, t.staged_rows("l.0")):
                there = ids[0] >= 0
                got[there] = rows[ids[0][there], 0]
            assert torch.equal(got, sel.float()), "a live token read the wrong row"

    ops = (("admit", 4), ("append", 6), ("finish", 2), ("abort", 1), ("preempt", 1),
           ("deferred", 2)) + ((("reset", 0.1),) if caching else ())
    names, weights = zip(*ops)
    for i in range(num_ops):
        op = rng.choices(names, weights)[0] if live else "admit"
        stats.ops[op] = stats.ops.get(op, 0) + 1
        if op == "admit":
            admit()
        elif op == "append":
            append()
        elif op == "reset":  # as vLLM's reset with reset_running_requests: preempt all first
            for rid in sorted(live):
                mgr.free(live.pop(rid))
            drain(i, everything=True)
            stats.resets += bool(mgr.reset_prefix_cache())
        else:
            release(op)
        drain(i)
        check()
        worker_step()
    for rid in sorted(live):
        mgr.free(live.pop(rid))
    drain(num_ops, everything=True)
    check()
    worker_step()
    if caching:  # cached blocks keep their rows until the cache is reset
        assert mgr.reset_prefix_cache()
        check()
        worker_step()
    assert mgr.block_pool.get_num_free_blocks() == num_blocks - 1
    if store is not None:
        u = store.usage()
        assert u["device_used"] == 0 and u["host_used"] == 0, u
        stats.worker_promotions = sum(g.mapping.stats.promotions for g in store.groups)
        stats.worker_demotions = sum(g.mapping.stats.demotions for g in store.groups)
        stats.hit_entries_host = store.totals()["prefix_hit_entries_host"]
    return stats
