"""Hook: `Scheduler._mamba_block_aligned_split` (v1/core/sched/scheduler.py), overridden only
by ulacache's own scheduler classes (`engine/scheduler.py`, the engines running
`--kv-backend ulacache`); vLLM's class and every other scheduler keep vLLM's method.

In GDN/mamba "align" mode a prompt's state is checkpointed only where a prefill chunk ends,
and vLLM's split ends chunks at its own stops (block boundaries, the prompt's last cacheable
block, a shared-prefix junction), all at the engine's block. The line's KV cache manager may
name a coarser block to split at (`LineManager.prefill_split_block`: the arena's GDN models,
whose 32-token pages are finer than stock's 640-token block, issue 45): vLLM's own split then
runs as stock's does at that block (its method over a view of the scheduler whose block is
that one), so the prompt's chunks and state checkpoints end where stock's do, a multiple of
the engine's block or the prefill's end. Where vLLM's split could not honour that (a budget
below the block, or its fine-grained/internal checkpoints), vLLM's chunk is only cut at the
line's stop (`LineManager.prefill_checkpoint_stop`) when it lies strictly inside it.
"""
from __future__ import annotations

import inspect

from ._hook import VllmHookError, check_vllm_version, resolve

HOOK = "mamba_checkpoint_split"
MODULE = "vllm.v1.core.sched.scheduler"
ATTR = "Scheduler._mamba_block_aligned_split"
PARAMS = ("self", "request", "num_new_tokens", "num_new_local_computed_tokens",
          "num_external_computed_tokens")
# What vLLM's split reads as the block (a view at the coarse block overrides these).
BLOCK_READS = ("self.cache_config.block_size", "self.block_size")


def check() -> None:
    """Fails loudly when vLLM's method moved, changed its parameters or reads its block
    elsewhere."""
    check_vllm_version(HOOK)
    _, fn = resolve(MODULE, ATTR, HOOK)
    params = tuple(inspect.signature(fn).parameters)
    if params != PARAMS:
        raise VllmHookError(f"ulacache patch '{HOOK}': {MODULE}.{ATTR} takes {params}, "
                            f"written for {PARAMS}; port the override")
    src = inspect.getsource(fn)
    if any(r not in src for r in BLOCK_READS):
        raise VllmHookError(f"ulacache patch '{HOOK}': {MODULE}.{ATTR} no longer reads its "
                            f"block as {BLOCK_READS}; port the override")


class _View:
    """``obj`` with some attributes replaced (the rest read through)."""

    def __init__(self, obj, **attrs):
        self.__dict__.update(attrs, _obj=obj)

    def __getattr__(self, name):
        return getattr(self.__dict__["_obj"], name)


def coarse_split_ok(scheduler, block: int) -> bool:
    """Whether vLLM's split at ``block`` ends every chunk but the prefill's last on a
    multiple of ``block`` (a whole number of the engine's blocks): no fine-grained or
    internal checkpoints, and a block no wider than a chunk's budget."""
    if not block or block % scheduler.block_size or scheduler.mamba_partial_cache_hit \
            or scheduler.mamba_has_prefill_checkpoint_blocks:
        return False
    budget = scheduler.max_num_scheduled_tokens
    threshold = scheduler.scheduler_config.long_prefill_token_threshold
    if threshold > 0:
        budget = min(budget, threshold)
    return block <= budget


def split(orig, scheduler, request, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
          num_external_computed_tokens: int = 0) -> int:
    """The override's body, given vLLM's method (bound to ``scheduler``): its split at the
    line's block, or its chunk cut at the line's stop."""
    manager = scheduler.kv_cache_manager
    block = manager.prefill_split_block()
    if coarse_split_ok(scheduler, block):
        at_block = _View(scheduler, block_size=block,
                         cache_config=_View(scheduler.cache_config, block_size=block))
        return orig.__func__(at_block, request, num_new_tokens,
                             num_new_local_computed_tokens, num_external_computed_tokens)
    n = orig(request, num_new_tokens, num_new_local_computed_tokens,
             num_external_computed_tokens)
    stop = manager.prefill_checkpoint_stop(request)
    start = (request.num_computed_tokens + num_new_local_computed_tokens
             + num_external_computed_tokens)
    if start < stop < start + n:
        return stop - start
    return n


def apply() -> None:
    """Nothing to install (the override is a method of ulacache's scheduler classes)."""
    check()
