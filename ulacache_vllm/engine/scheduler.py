"""Scheduler classes for `--kv-backend ulacache` (selected through `scheduler_cls`).

They are vLLM's own schedulers (sync and async) with the KV cache manager swapped for the one
the product line's layout names (`line.LineLayout.manager_cls`: the logical address space's
`UlaKVCacheManager` for DSA models, the arena's `ArenaKVCacheManager` for hybrid models).
Everything else (admission order, preemption, connectors) is vLLM's. Three hooks of the line
run here: which requests a failed copy's lost blocks end (`lost_block_owners`), the close
of a step once its output is processed (`step_processed`) and the block GDN/mamba "align"
mode splits prefills at (`prefill_split_block`, `prefill_checkpoint_stop`, through
`patches/mamba_checkpoint_split`);
a finished request skips vLLM's connector hook (ulacache's connector takes nothing from it).
"""
from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from ulacache_vllm.patches import mamba_checkpoint_split
from ulacache_vllm.patches.scheduler_manager import use_manager

from .connector import UlaCacheConnector
from .line import layout_of

# vLLM's hooks for connector-reported lost blocks (a line may map them to requests itself)
# and for a finished request's connector work.
for _hook in ("_handle_invalid_blocks", "_connector_finished"):
    if not callable(getattr(Scheduler, _hook, None)):
        raise ImportError(f"ulacache: vLLM's Scheduler.{_hook} moved (this vLLM is not the "
                          "0.32 ulacache's scheduler was built for)")
mamba_checkpoint_split.check()


class _UlaSchedulerMixin:
    def _ula_init(self, base, *args, **kwargs):
        cfg = kwargs.get("kv_cache_config", args[1] if len(args) > 1 else None)
        cls = layout_of(cfg).manager_cls()
        with use_manager(cls):
            base.__init__(self, *args, **kwargs)
        assert isinstance(self.kv_cache_manager, cls)

    def _handle_invalid_blocks(self, invalid_block_ids, num_scheduled_tokens):
        # Every request that holds blocks: running ones and the waiting ones vLLM lets keep
        # theirs (streaming sessions between inputs; ulacache refuses remote-load connectors);
        # `finish_requests` ends either kind with the error.
        return self.kv_cache_manager.lost_block_owners(
            invalid_block_ids, [*self.running, *self.kv_holding_waiting],
            lambda: super(_UlaSchedulerMixin, self)._handle_invalid_blocks(
                invalid_block_ids, num_scheduled_tokens))

    def _mamba_block_aligned_split(self, request, num_new_tokens,
                                   num_new_local_computed_tokens=0,
                                   num_external_computed_tokens=0):
        # vLLM's split, at the line's block (or cut where it checkpoints a prompt's state).
        return mamba_checkpoint_split.split(
            super()._mamba_block_aligned_split, self, request, num_new_tokens,
            num_new_local_computed_tokens, num_external_computed_tokens)

    def _connector_finished(self, request):
        # ulacache's connector takes nothing from a finished request (the KV cache manager
        # frees its pages next): vLLM's per-request block-id lists for it are not built.
        if type(self.connector) is UlaCacheConnector:
            return False, None
        return super()._connector_finished(request)

    def update_from_output(self, scheduler_output, model_runner_output):
        out = super().update_from_output(scheduler_output, model_runner_output)
        meta = scheduler_output.kv_connector_metadata
        if meta is not None:
            self.kv_cache_manager.step_processed(meta.step)
        return out


class UlaScheduler(_UlaSchedulerMixin, Scheduler):
    def __init__(self, *args, **kwargs):
        self._ula_init(Scheduler, *args, **kwargs)


class UlaAsyncScheduler(_UlaSchedulerMixin, AsyncScheduler):
    def __init__(self, *args, **kwargs):
        self._ula_init(AsyncScheduler, *args, **kwargs)
