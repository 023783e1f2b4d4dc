"""Scheduler classes for `--kv-backend ulacache` (selected through `scheduler_cls`).

They are vLLM's own schedulers (sync and async) with the KV cache manager swapped for
`UlaKVCacheManager`; everything else (admission order, preemption, connectors) is vLLM's.
"""
from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from ulacache_vllm.patches.scheduler_manager import use_manager

from .kv_cache_manager import UlaKVCacheManager


class UlaScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        with use_manager(UlaKVCacheManager):
            super().__init__(*args, **kwargs)
        assert isinstance(self.kv_cache_manager, UlaKVCacheManager)


class UlaAsyncScheduler(AsyncScheduler):
    def __init__(self, *args, **kwargs):
        with use_manager(UlaKVCacheManager):
            super().__init__(*args, **kwargs)
        assert isinstance(self.kv_cache_manager, UlaKVCacheManager)
