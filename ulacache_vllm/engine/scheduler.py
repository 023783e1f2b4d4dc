"""Scheduler classes for `--kv-backend ulacache` (selected through `scheduler_cls`).

They are vLLM's own schedulers (sync and async) with the KV cache manager swapped: the logical
address space's `UlaKVCacheManager` for DSA models, the arena's `ArenaKVCacheManager` for hybrid
models (chosen by what the engine core's sizing attached to the KV cache config). Everything
else (admission order, preemption, connectors) is vLLM's.

One addition for the arena: vLLM maps KV load errors (blocks a connector lost) to requests only
for single-group layouts, and refuses others. The arena's vids are unique across its groups, so
its pages lost by a failed move end the requests holding them with an error (the policy is
always "fail": a hybrid request's recurrent state cannot be recomputed from a prefix).
"""
from __future__ import annotations

from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from ulacache_vllm.patches.scheduler_manager import use_manager

from .dsa.manager import UlaKVCacheManager

logger = init_logger("vllm.ulacache.scheduler")
# vLLM's hook for connector-reported lost blocks (overridden below for the arena).
if not callable(getattr(Scheduler, "_handle_invalid_blocks", None)):
    raise ImportError("ulacache: vLLM's Scheduler._handle_invalid_blocks moved (this vLLM is "
                      "not the 0.32 the arena's failure path was built for)")


def _manager_cls(args, kwargs):
    cfg = kwargs.get("kv_cache_config", args[1] if len(args) > 1 else None)
    if getattr(cfg, "ulacache_arena", None) is not None:
        from .arena.manager import ArenaKVCacheManager

        return ArenaKVCacheManager
    return UlaKVCacheManager


class _UlaSchedulerMixin:
    def _ula_init(self, base, *args, **kwargs):
        cls = _manager_cls(args, kwargs)
        with use_manager(cls):
            base.__init__(self, *args, **kwargs)
        assert isinstance(self.kv_cache_manager, cls)

    def _handle_invalid_blocks(self, invalid_block_ids, num_scheduled_tokens):
        mgr = self.kv_cache_manager
        if not hasattr(mgr, "requests_holding"):  # one group (DSA): vLLM's own handling
            return super()._handle_invalid_blocks(invalid_block_ids, num_scheduled_tokens)
        failed = mgr.requests_holding(invalid_block_ids, self.running)
        if failed:
            logger.error("Failing %d request(s) due to KV load failure: a page move lost "
                         "%d arena pages. Request IDs: %s", len(failed), len(invalid_block_ids),
                         sorted(failed))
        return failed

    def update_from_output(self, scheduler_output, model_runner_output):
        out = super().update_from_output(scheduler_output, model_runner_output)
        plan = getattr(scheduler_output.kv_connector_metadata, "arena", None)
        if plan is not None:  # the arena's step fence: this step's pages may move again
            self.kv_cache_manager.step_processed(plan.seq)
        return out


class UlaScheduler(_UlaSchedulerMixin, Scheduler):
    def __init__(self, *args, **kwargs):
        self._ula_init(Scheduler, *args, **kwargs)


class UlaAsyncScheduler(_UlaSchedulerMixin, AsyncScheduler):
    def __init__(self, *args, **kwargs):
        self._ula_init(AsyncScheduler, *args, **kwargs)
