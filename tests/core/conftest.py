"""Core tests use tiny pools: run both PB-LRUs' own searches (round labels, queue) at every
size there.

The small-pool fast path (a timestamp scan up to ``SMALL_POOL_SLOTS``) would otherwise take
every one of these pools; it is covered on its own (``small`` in the property tests).
Module-scoped, not function-scoped: hypothesis refuses function-scoped fixtures under @given.

``triton_interpreter``: Triton's interpreter for the kernel test modules that ask for it, and
only while their tests run (``_triton_interpreter.py``).
"""

import pytest

from lab import pblru_queue
from ulacache_vllm.core import pblru


@pytest.fixture(autouse=True, scope="module")
def _own_search_at_every_pool_size():
    old = pblru.SMALL_POOL_SLOTS, pblru_queue.SMALL_POOL_SLOTS
    pblru.SMALL_POOL_SLOTS = pblru_queue.SMALL_POOL_SLOTS = 0
    yield
    pblru.SMALL_POOL_SLOTS, pblru_queue.SMALL_POOL_SLOTS = old


@pytest.fixture(scope="module")
def triton_interpreter():
    """``TRITON_INTERPRET=1`` while a kernel test module's tests run (Triton's interpreter
    reads it then too), the previous state after: see ``_triton_interpreter.py``. Only the
    modules that ask for it (``pytestmark``) get it; nothing else in the session sees it."""
    from _triton_interpreter import interpreted

    with interpreted():
        yield
