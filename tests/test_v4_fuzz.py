"""The DeepSeek-V4 line's scheduler side (the arena's managers and the CSA rows' logical block
pool, over V4's caches as vLLM's spec classes declare them) with the arena's worker and the CSA
rows' store, under random admit / chunked prefill / decode / finish / preempt / abort / prefix
hit / reset sequences, against a reference of what each request holds and what each page and
row holds (driver and invariants: `benchmarks/lab/v4_fuzz.py`; `benchmarks/fuzz_manager.py
--v4` runs longer). No model and no V4 kernel: it runs on every host, also where V4's engines
are refused (no AVX512-BF16)."""
from __future__ import annotations

import pytest

from lab.v4_fuzz import run

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def quiet_faults():
    """The injected faults' error lines off for one test (the level restored after)."""
    import logging

    log = logging.getLogger("vllm.ulacache")
    level = log.level
    log.setLevel(logging.CRITICAL)
    yield
    log.setLevel(level)


def test_pressure_preemption_and_moves_keep_every_page_and_row():
    st = run(2, 150, force_moves=3)
    # The arena and the CSA pool really filled up (admissions deferred, requests preempted),
    # pages moved, rows went to the host and came back, chunks left transient state pages.
    assert st.refused > 0 and st.preempted > 0, st
    assert st.ops["prefill_chunk"] > 0 and st.ops["abort"] > 0, st
    assert st.arena["arena_compactions"] > 0 and st.arena["arena_relayouts"] > 0, st.arena
    assert st.csa["demotions"] > 0 and st.csa["promotions"] > 0, st.csa
    assert st.arena["transient_state_pages"] > 0, st.arena
    assert st.rows_written > 0 and st.rows_read > 0


def test_prefix_caching_hits_evictions_and_resets_keep_every_page_and_row():
    """Hits take cached CSA blocks (their rows in either tier) and arena pages; the rows a hit
    reads hold the values of the tokens the new request shares; cold cached pages are evicted
    and move with compactions; resets leave nothing."""
    st = run(1, 150, caching=True, force_moves=3)
    assert st.ops.get("admit_hit", 0) > 0 and st.hit_tokens > 0, st.ops
    assert st.resets > 0, st.ops
    assert st.arena["arena_cache_evictions"] > 0, st.arena
    assert st.arena["arena_cached_pages_moved"] > 0, st.arena
    assert st.csa["demotions"] > 0 and st.csa["promotions"] > 0, st.csa


def test_a_failed_arena_copy_ends_only_the_requests_holding_lost_pages(quiet_faults):
    """A failing page move loses arena pages: the requests holding one end (their CSA blocks and
    rows freed with them), every other request runs on. A CSA block id is a logical block of
    the CSA pool, not an arena page: a lost page with the same number ends no one (it did,
    before `V4KVCacheManager.page_ids`)."""
    st = run(0, 150, force_moves=3, fault_every=6)
    assert st.lost_pages > 0 and st.ops.get("ended_by_fault", 0) > 0, st.ops
    assert st.ops["decode"] > 100 and st.ops.get("finish", 0) > 0, st.ops


def test_failed_csa_row_moves_end_only_the_requests_holding_lost_rows(quiet_faults):
    """Now and then a copy fails: an arena page move, or a CSA row demotion, promotion or
    staging copy. The rows it drops are reported as lost CSA blocks (beside lost pages, in
    their own id space): the requests holding one end, the blocks leave the prefix cache,
    every other request's rows and pages keep their bytes and it runs on; at the end nothing
    is left in the pools."""
    st = run(2, 150, caching=True, force_moves=3, fault_every=4, csa_faults=True)
    assert st.lost_csa_blocks > 0 and st.csa["failed_copies"] > 0, st.csa
    assert st.lost_pages > 0 and st.ops.get("ended_by_fault", 0) > 0, st.ops
    assert st.ops.get("admit_hit", 0) > 0 and st.csa["promotions"] > 0, (st.ops, st.csa)
    assert st.ops["decode"] > 100, st.ops
