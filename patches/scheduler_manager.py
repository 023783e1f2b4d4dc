"""Hook: the `KVCacheManager` name that `Scheduler.__init__` instantiates (v1/core/sched/scheduler.py).

`Scheduler.__init__` hard-codes `KVCacheManager(...)`. ulacache's scheduler classes construct
through `use_manager(cls)`, which rebinds that module attribute for the duration of their own
`super().__init__()` only, so every other scheduler keeps vLLM's manager.
"""
from __future__ import annotations

import contextlib
import threading

from ._hook import check_vllm_version, resolve

HOOK = "scheduler_manager"
MODULE = "vllm.v1.core.sched.scheduler"
_lock = threading.Lock()


@contextlib.contextmanager
def use_manager(manager_cls):
    check_vllm_version(HOOK)
    mod, current = resolve(MODULE, "KVCacheManager", HOOK)
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    if current is not KVCacheManager and current is not manager_cls:
        raise RuntimeError(f"ulacache: {MODULE}.KVCacheManager is already replaced by {current}")
    with _lock:
        mod.KVCacheManager = manager_cls
        try:
            yield
        finally:
            mod.KVCacheManager = KVCacheManager
