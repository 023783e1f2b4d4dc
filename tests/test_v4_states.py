"""The v4 line's transient compressor states (`engine/v4/states.py`), without an engine.

The scratch plan must give every compression boundary exactly the window of states vLLM's
own path reads (this step's tokens and the rows before the step the arena kept), and the
arena must receive every kept token's state and none of a transient one. Checked against a
model of the two kernels (write a token's state at its slot; a boundary reads its window's
rows) over random batches: prefill chunks (first and later ones), decodes at and between
boundaries, both V4 state shapes (window 8 / 4-token pages / ratio 4 and window 128 / 8-token
pages / ratio 128). And the scheduler's arithmetic: which new pages are transient, how many
pages a request holds, and the window frees that skip the transient pages' null blocks.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from ulacache_vllm.engine.v4.states import (
    install_window_frees,
    is_state_group,
    scratch_plan,
    step_positions,
    transient_pages,
    window_pages,
)

SHAPES = [(8, 4, 4), (128, 8, 128)]  # (window, block size, compress ratio)


def _value(r: int, p: int) -> float:
    return float(r * 100_000 + p + 1)


def _batch(rng: random.Random, W: int, bs: int):
    """A step: per request (computed tokens, new tokens), a block table whose transient and
    freed pages are the null granule 0, the arena state cache holding the kept rows of the
    computed tokens."""
    reqs = []
    for _ in range(rng.randint(1, 5)):
        c = rng.choice([0, 0, rng.randint(1, 400), rng.randint(W, 300)])
        n = rng.choice([1, 1, rng.randint(2, 3 * W), rng.randint(1, 600)])
        reqs.append((c, n))
    max_blocks = max(-(-(c + n) // bs) for c, n in reqs) + 1
    table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
    granules = list(range(1, 1 + len(reqs) * max_blocks))
    rng.shuffle(granules)
    cache = torch.full((1 + len(reqs) * max_blocks, bs, 1), -1.0)
    slots, positions, req_of = [], [], []
    for r, (c, n) in enumerate(reqs):
        end = c + n
        for b in range(-(-end // bs)):
            lo, hi = b * bs, (b + 1) * bs
            freed = hi <= c - W + 1  # out of the window before the step: freed, null
            # a page this step allocates that lies wholly before the window after it
            transient = b >= -(-c // bs) and hi <= end - W + 1
            if freed or transient:
                continue
            g = granules.pop()
            table[r, b] = g
            for p in range(lo, min(hi, c)):  # the rows kept from earlier steps
                cache[g, p - lo, 0] = _value(r, p)
        for p in range(c, end):
            b = p // bs
            slots.append(int(table[r, b]) * bs + p % bs)
            positions.append(p)
            req_of.append(r)
    return reqs, table, cache, torch.tensor(slots), torch.tensor(positions), \
        torch.tensor(req_of, dtype=torch.int32)


@pytest.mark.parametrize("W, bs, ratio", SHAPES)
def test_every_boundary_reads_the_window_vllm_reads(W, bs, ratio):
    rng = random.Random(W)
    planned = chunked = 0
    for it in range(120):
        reqs, table, cache, slots, pos, req = _batch(rng, W, bs)
        chunk = (37, 200, 512)[it % 3]  # (chunks cut inside requests and windows)
        plan = scratch_plan(slots, table, bs, req, pos, W, ratio, chunk)
        transient = (slots >= 0) & (slots < bs)
        if not bool(transient.any()):
            assert plan is None
            continue
        planned += 1
        chunked += len(plan.chunks) > 1
        assert plan.transient == int(transient.sum())
        # save, arena: the kept tokens only, never the null granule
        assert torch.equal(plan.keep_slots[~transient], slots[~transient])
        assert bool((plan.keep_slots[transient] == -1).all())
        arena = cache.clone()
        for t, s in enumerate(plan.keep_slots.tolist()):
            if s >= 0:
                arena[s // bs, s % bs, 0] = _value(int(req[t]), int(pos[t]))
        assert bool((arena[0] == -1).all())  # the null page is never written
        covered = []
        for c in plan.chunks:
            # save, scratch: tokens lo..end at their rows (the rest stale); the arena's tails
            scratch = torch.full((c.rows, 1, 1), -7.0)
            for i, row in enumerate(c.save_rows.tolist()):
                t = c.lo + i
                scratch[row, 0, 0] = _value(int(req[t]), int(pos[t]))
            scratch[c.tail_rows, 0] = arena[c.tail_blocks, c.tail_offsets]
            # store: every boundary of the chunk reads its whole window, exactly
            for i, t in enumerate(range(c.start, c.end)):
                covered.append(t)
                p, r = int(pos[t]), int(req[t])
                if (p + 1) % ratio:
                    continue
                got = [float(scratch[g, 0, 0]) if g >= 0 else None
                       for g in c.gather[i].tolist()]
                want = [_value(r, q) if q >= 0 else None for q in range(p - W + 1, p + 1)]
                assert got == want, (reqs, t, p)
            assert c.rows <= chunk + W - 1 + len(reqs) * (W - 1)
        assert covered == list(range(len(pos)))  # every token once, in order
    assert planned > 30 and chunked > 5


def test_step_positions_from_the_window_metadata():
    qsl = torch.tensor([0, 1, 4, 6])
    seq = torch.tensor([10, 3, 102])
    req = torch.tensor([0, 1, 1, 1, 2, 2], dtype=torch.int32)
    assert step_positions(qsl, seq, req).tolist() == [9, 0, 1, 2, 100, 101]


def test_transient_pages_are_the_chunk_before_its_last_window():
    # a first chunk of 2200 tokens, C4 states (window 8, 4-token pages): pages 0..547 lie
    # before position 2193, pages 548-549 hold the last window
    assert transient_pages(0, 550, 2200, 8, 4) == 548
    # the next chunk (2200..2999), 200 pages from page 550
    assert transient_pages(550, 200, 3000, 8, 4) == 198
    # a decode step: nothing
    assert transient_pages(750, 1, 3001, 8, 4) == 0
    assert transient_pages(0, 2, 5, 8, 4) == 0
    # C128 states (window 128, 8-token pages)
    assert transient_pages(0, 275, 2200, 128, 8) == 259
    assert window_pages(8, 4) == 3 and window_pages(128, 8) == 17
    assert is_state_group(["model.layers.1.attn.compressor.state_cache",
                           "model.layers.3.attn.indexer.compressor.state_cache"])
    assert not is_state_group(["model.layers.1.attn.swa_cache"])


def test_window_frees_skip_the_transient_null_blocks_and_free_every_real_page():
    null = SimpleNamespace(is_null=True)
    freed = []
    mgr = SimpleNamespace(block_size=4, _null_block=null, req_to_blocks={},
                          get_num_skipped_tokens=lambda n: max(0, n - 8 + 1),
                          block_pool=SimpleNamespace(free_blocks=freed.extend),
                          free=lambda rid: freed.extend(
                              b for b in mgr.req_to_blocks.pop(rid) if not b.is_null))
    low = {}
    install_window_frees(mgr, low)
    real = lambda i: SimpleNamespace(is_null=False, i=i)  # noqa: E731
    # chunk 1 (0..2199): pages 0..547 transient, 548-549 real; chunk 2 (2200..2999): 550-747
    # transient, 748-749 real (vLLM's own frees would stop at page 747 and keep 548-549)
    blocks = [null] * 548 + [real(548), real(549)] + [null] * 198 + [real(748), real(749)]
    mgr.req_to_blocks["a"] = blocks
    mgr.remove_skipped_blocks("a", 2200)  # the second chunk's allocation: 548-549 still read
    assert freed == []
    mgr.remove_skipped_blocks("a", 3000)
    assert sorted(b.i for b in freed) == [548, 549] and low["a"] == 748
    assert all(b.is_null for b in blocks[:748])
    mgr.remove_skipped_blocks("a", 3000)  # nothing twice
    assert len(freed) == 2
    mgr.free("a")
    assert sorted(b.i for b in freed) == [548, 549, 748, 749] and "a" not in low


def test_with_prefix_caching_the_tails_vllm_hashes_keep_their_pages():
    """With prefix caching on (retention 0), the pages vLLM's own mask will hash are not
    transient: the window's tail before the prompt's replay boundary (and a junction)."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from ulacache_vllm.engine.v4.manager import V4KVCacheManager
    from ulacache_vllm.engine.v4.sizing import state_request_pages
    from ulacache_vllm.engine.v4.states import transient_states

    spec = SlidingWindowSpec(block_size=8, num_kv_heads=1, head_size=1024,
                             dtype=torch.float32, sliding_window=128)
    mgr = SimpleNamespace(reachable_block_mask=SlidingWindowManager.reachable_block_mask,
                          cache_hit_alignment_tokens=256, kv_cache_spec=spec, use_eagle=False,
                          dcp_world_size=1)
    marks = ("kind", [1])
    me = SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=[mgr],
                                                     scheduler_block_size=256,
                                                     retention_interval=0),
                         _state=SimpleNamespace(reach_marks=marks))
    me._boundaries = lambda r: V4KVCacheManager._boundaries(me, r)
    # A first chunk of a 2200-token prompt: pages 0..258 lie before the last window; the
    # replay boundary 2199 aligns to 2048, whose hit reads the 16 pages before it (240..255).
    req = SimpleNamespace(num_prompt_tokens=2200, shared_prefix_boundary=None)
    kept = V4KVCacheManager._kept(me, req, 1, 0, 259)
    assert [i for i, k in enumerate(kept) if k] == list(range(240, 256))
    assert me._state.reach_marks is marks  # the arena's marks untouched
    # A junction at 1000 (aligned 768) keeps the 16 pages before page 96 too.
    req.shared_prefix_boundary = 1000
    kept = V4KVCacheManager._kept(me, req, 1, 0, 259)
    assert [i for i, k in enumerate(kept) if k] == [*range(80, 96), *range(240, 256)]
    # A later chunk past both boundaries keeps nothing below its window.
    assert not any(V4KVCacheManager._kept(me, req, 1, 275, 200))
    # Retention other than 0 keeps every page (no transient states); the sizing counts a
    # window plus two hits' tails with caching on, a window without it.
    assert transient_states(False, None, False) and transient_states(True, 0, False)
    assert not transient_states(True, None, False) and not transient_states(True, 256, False)
    assert not transient_states(True, 0, True)
    names = ("model.layers.1.attn.compressor.state_cache",)
    cc = lambda caching, retention: SimpleNamespace(cache_config=SimpleNamespace(  # noqa: E731
        enable_prefix_caching=caching, prefix_cache_retention_interval=retention))
    from ulacache_vllm.engine.v4.states import hit_tail_pages
    for w, b in ((128, 8), (8, 4)):  # vLLM's own count of a hit's pages
        assert hit_tail_pages(w, b) == SlidingWindowManager._contiguous_blocks_for_hit(w, b, False)
    assert state_request_pages(cc(True, 0))(names, spec) == 17 + 2 * 16
    assert state_request_pages(cc(False, 0))(names, spec) == 17
    assert state_request_pages(cc(True, 0))(("model.layers.1.attn.swa_cache",), spec) is None
    assert state_request_pages(cc(True, 512))(names, spec) is None
