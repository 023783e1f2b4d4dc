"""The scheduler-facing manager and the worker store under random admit / append / finish /
preempt / abort / deferred-free sequences, against a reference model (driver and invariants:
`benchmarks/lab/manager_fuzz.py`; `benchmarks/fuzz_manager.py` runs 10^5+ operations)."""
from __future__ import annotations

import pytest

from lab.manager_fuzz import run

# Manager-level runs take seconds: a hang (a reclaim loop once did) fails fast, not at
# the suite's 900 s per-test limit.
pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operation_sequences_keep_blocks_and_rows_consistent(seed):
    stats = run(seed, num_ops=600)
    assert stats.ops.get("deferred", 0) > 0 and stats.ops.get("preempt", 0) > 0
    assert stats.refused > 0  # the pool really filled up
    assert stats.reported_dead > 0
    # Rows spilled to the host and came back: the worker's tiers were really exercised.
    assert stats.worker_demotions > 0 and stats.worker_promotions > 0, stats


def test_a_long_manager_only_run():
    stats = run(7, num_ops=4000, worker=False)
    assert stats.reported_dead > 0 and stats.refused > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_prefix_caching_sequences_keep_blocks_and_rows_consistent(seed):
    """With vLLM's prefix caching on: shared prefixes hit, cached free blocks keep their rows
    (in either tier) until reuse evicts them or a reset clears the cache, and every live token
    still reads its own row."""
    stats = run(seed, num_ops=600, caching=True)
    assert stats.hit_tokens > 0 and stats.resets > 0, stats
    # The pool filled: cached free blocks were evicted to be handed out again.
    assert stats.reuse_evictions > 0 and stats.reported_dead > 0, stats
    assert stats.worker_demotions > 0 and stats.worker_promotions > 0, stats
    assert stats.hit_entries_host > 0, stats  # hits on rows the host tier held
