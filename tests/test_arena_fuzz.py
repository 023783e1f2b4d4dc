"""The arena's scheduler side (vLLM's full, sliding-window and state managers over arena
pages) and its worker under random admit / chunked prefill / decode / finish / preempt /
abort sequences, with moves forced or only when needed and with failing copies, with and
without prefix caching (shared prefixes hit, free-but-cached pages live until evicted or the
cache is reset), against a reference model (driver and invariants: `benchmarks/lab/arena_fuzz.py`;
`benchmarks/fuzz_manager.py --arena` runs 10^5+ operations)."""
from __future__ import annotations

import pytest

from lab.arena_fuzz import run

# Manager-level runs take seconds: a hang (a reclaim loop once did) fails fast, not at
# the suite's 900 s per-test limit.
pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_steps_under_pressure_keep_pages_bytes_and_bands(seed):
    stats = run(seed, num_steps=400, total_pages=48, force_moves=3)
    # The arena really filled up, requests were preempted and recomputed, pages really moved.
    assert stats.refused > 0 and stats.preempted > 0, stats
    assert stats.ops["prefill_chunk"] > 0 and stats.ops["abort"] > 0, stats
    assert stats.compactions > 0 and stats.relayouts > 0 and stats.bytes_copied > 0, stats


@pytest.mark.parametrize("zero_new_pages", [True, False])
def test_moves_only_when_an_admission_needs_room(zero_new_pages):
    """Also with new pages left unzeroed (stock's rule for KV of one precision): pages and
    their bytes stay right either way, and the worker zeroes exactly when the layout says so."""
    stats = run(2, num_steps=600, total_pages=48, force_moves=0, zero_new_pages=zero_new_pages)
    assert stats.compactions + stats.relayouts > 0 and stats.bytes_copied > 0, stats
    assert (stats.zeroed_pages > 0) == zero_new_pages, stats


def test_failing_copies_end_only_requests_holding_lost_pages():
    stats = run(3, num_steps=400, total_pages=48, force_moves=3, fault_every=8)
    assert stats.lost_pages > 0 and stats.ended_by_faults > 0, stats
    # Everything else ran on: requests were still admitted, decoded and finished.
    assert stats.ops["decode"] > 1000 and stats.ops["finish"] > 0, stats


@pytest.mark.parametrize("seed", [0, 1])
def test_prefix_caching_hits_evictions_and_resets_under_pressure(seed):
    """vLLM's prefix caching over the arena: admissions hit cached pages (held by another
    request or free-but-cached), cached pages move with compactions and relayouts (bytes
    checked), cold ones are evicted when the arena needs room, resets leave only the null
    page; refcounts, holdings and hash -> bytes checked every step."""
    stats = run(seed, num_steps=400, total_pages=48, force_moves=3, caching=True)
    assert stats.ops["admit_hit"] > 0 and stats.hit_tokens > 0, stats
    assert stats.cache_evictions > 0 and stats.cached_pages_moved > 0, stats
    assert stats.resets > 0 and stats.preempted > 0, stats


def test_prefix_caching_with_failing_copies_drops_lost_pages_from_the_cache():
    stats = run(4, num_steps=300, total_pages=48, force_moves=3, fault_every=8, caching=True)
    assert stats.lost_pages > 0 and stats.ended_by_faults > 0, stats
    assert stats.ops["admit_hit"] > 0, stats


@pytest.mark.parametrize("seed,fault_every", [(1, 0), (5, 8)])
def test_prefix_caching_at_retention_0_keeps_decoding_states_in_their_pages(seed, fault_every):
    """vLLM's default retention for hybrids (only reachable boundaries cached): past them a
    decoding request's GDN state stays in its page at each page crossing (issue 45), through
    preemptions, aborts, moves and failing copies; bytes, hashes and holdings checked."""
    stats = run(seed, num_steps=400, total_pages=48, force_moves=3, fault_every=fault_every,
                caching=True, retention=0)
    assert stats.state_moves_saved > 0 and stats.ops.get("admit_hit", 0) > 0, stats
    assert stats.preempted > 0 and stats.cached_pages_moved > 0, stats
    assert (stats.lost_pages > 0) == bool(fault_every), stats
