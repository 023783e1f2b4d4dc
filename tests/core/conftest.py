"""Core tests use tiny pools: run the queue PB-LRU's queue at every size there.

The small-pool fast path (a timestamp scan below ``SMALL_POOL_SLOTS``) would otherwise take
every one of these pools; it is covered on its own by ``test_pblru_is_exact_lru`` (small=4096).
Module-scoped, not function-scoped: hypothesis refuses function-scoped fixtures under @given.
"""

import pytest

from ulacache_vllm.core import pblru_queue as pblru


@pytest.fixture(autouse=True, scope="module")
def _queue_at_every_pool_size():
    old = pblru.SMALL_POOL_SLOTS
    pblru.SMALL_POOL_SLOTS = 0
    yield
    pblru.SMALL_POOL_SLOTS = old
