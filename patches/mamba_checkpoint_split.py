"""Hook: `Scheduler._mamba_block_aligned_split` (v1/core/sched/scheduler.py), overridden only
by ulacache's own scheduler classes (`engine/scheduler.py`, the engines running
`--kv-backend ulacache`); vLLM's class and every other scheduler keep vLLM's method.

In GDN/mamba "align" mode a prompt's state is checkpointed only where a prefill chunk ends,
and vLLM's split ends chunks at its own stops (block boundaries, the prompt's last cacheable
block, a shared-prefix junction). The line's KV cache manager may name one more stop
(`LineManager.prefill_checkpoint_stop`: the arena's coarse state checkpoint, issue 45); the
chunk vLLM chose is cut there when the stop lies strictly inside it. Nothing else changes.
"""
from __future__ import annotations

import inspect

from ._hook import VllmHookError, check_vllm_version, resolve

HOOK = "mamba_checkpoint_split"
MODULE = "vllm.v1.core.sched.scheduler"
ATTR = "Scheduler._mamba_block_aligned_split"
PARAMS = ("self", "request", "num_new_tokens", "num_new_local_computed_tokens",
          "num_external_computed_tokens")


def check() -> None:
    """Fails loudly when vLLM's method moved or changed its parameters."""
    check_vllm_version(HOOK)
    _, fn = resolve(MODULE, ATTR, HOOK)
    params = tuple(inspect.signature(fn).parameters)
    if params != PARAMS:
        raise VllmHookError(f"ulacache patch '{HOOK}': {MODULE}.{ATTR} takes {params}, "
                            f"written for {PARAMS}; port the override")


def split(orig, scheduler, request, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
          num_external_computed_tokens: int = 0) -> int:
    """The override's body, given vLLM's method (bound to ``scheduler``): its chunk, cut at
    the line's stop."""
    n = orig(request, num_new_tokens, num_new_local_computed_tokens,
             num_external_computed_tokens)
    stop = scheduler.kv_cache_manager.prefill_checkpoint_stop(request)
    start = (request.num_computed_tokens + num_new_local_computed_tokens
             + num_external_computed_tokens)
    if start < stop < start + n:
        return stop - start
    return n


def apply() -> None:
    """Nothing to install (the override is a method of ulacache's scheduler classes)."""
    check()
