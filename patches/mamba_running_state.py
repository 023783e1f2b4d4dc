"""Hook: the "align"-mode running state of the GDN/mamba managers the arena owns
(`MambaManager.get_num_blocks_to_allocate`, `allocate_new_blocks`, v1/core/
single_type_kv_cache_manager.py), installed on those manager instances only
(`engine/arena/pools.keep_running_state`); vLLM's class and every other engine keep vLLM's
methods. Also `collect_mamba_copy_meta`'s copies of a block onto itself are dropped
(`patches/mamba_align_translate`).

In align mode vLLM keeps a request's running state in the block of its last token: when
decode crosses a block boundary, `allocate_new_blocks` appends a new block, the worker copies
the state into it before the forward (`preprocess_mamba`), and `remove_skipped_blocks` frees
the previous block a step later, unless its state was cached there. Stock's block on the CPU
build is 640 tokens on the tiny Qwen3-Next; the arena's is 32, so every 32 decode tokens a
request needs one more state page (the state's whole size) for a step, and under memory
pressure its bytes come from the prefix cache: issue 45's 12 MiB run evicted a whole cached
prefix (its state and 96 full-attention pages) for one such move, and a later prompt missed.

Under vLLM's default retention (interval 0) a state is kept only at a reachable boundary: the
prompt's replay boundary (`num_prompt_tokens - 1`), a shared-prefix junction, the arena's
coarse checkpoint, all within the prompt (or at the junction). Past them no boundary's state
is ever cached, so there the running block itself moves to the new column, as vLLM moves a
speculative block (`_relocate_speculative_block`): the old column becomes the null block, no
page is allocated or freed, and the worker's align copy is a copy of the block onto itself
(dropped). Everything else (prefill, MTP's speculative blocks, partial hits, internal
checkpoints, a shared or hashed block, other retention intervals) keeps vLLM's path.
"""
from __future__ import annotations

import hashlib
import inspect

from ._hook import VllmHookError, check_vllm_version, resolve

HOOK = "mamba_running_state"
MODULE = "vllm.v1.core.single_type_kv_cache_manager"
# The methods whose bookkeeping the relocation repeats (written against these sources).
UPSTREAM = {
    "MambaManager.get_num_blocks_to_allocate": "1cb46983bbf184ff",
    "MambaManager.allocate_new_blocks": "a68fab2ee72268ce",
    "MambaManager.remove_skipped_blocks": "915e3f478aba9de5",
    "MambaManager.pop_blocks_for_free": "8b4404c7281f4e5f",
}


def check() -> None:
    """Fails loudly when vLLM's align-mode bookkeeping is not the one this hook repeats."""
    check_vllm_version(HOOK)
    for attr, digest in UPSTREAM.items():
        _, fn = resolve(MODULE, attr, HOOK)
        fn = getattr(fn, "__ulacache_original__", fn)
        if hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16] != digest:
            raise VllmHookError(f"ulacache patch '{HOOK}': {MODULE}.{attr} changed since vLLM "
                                "0.32.0; port the running-state relocation (and UPSTREAM)")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def install(mgr, retention_interval, on_relocate=lambda: None) -> bool:
    """Relocate ``mgr``'s running state at decode boundaries no state is kept at (see the
    module doc); ``on_relocate`` is called for each. False (nothing installed) where the
    manager is not an align-mode one without speculative blocks, or retention is not 0."""
    check()
    if (getattr(mgr, "mamba_cache_mode", None) != "align" or mgr.num_speculative_blocks
            or mgr.has_prefill_checkpoint_blocks or retention_interval != 0):
        return False
    limit: dict[str, int] = {}  # request -> the last token a kept boundary can be at
    decided: dict[str, int] = {}  # request -> block count of a relocation counted this step
    count, allocate = mgr.get_num_blocks_to_allocate, mgr.allocate_new_blocks
    cache, pop = mgr.cache_blocks, mgr.pop_blocks_for_free
    bs = mgr.block_size

    def relocatable(request_id: str, num_tokens: int, new_computed_blocks=()) -> bool:
        blocks = mgr.req_to_blocks.get(request_id)
        if (not blocks or len(new_computed_blocks) or request_id not in limit
                or request_id not in mgr._allocated_block_reqs
                or request_id in mgr._checkpoints or request_id in mgr._partial_hit_reqs
                or _cdiv(num_tokens, bs) != len(blocks) + 1):
            return False
        # The boundary crossed ends the last block: no kept boundary is there or past it.
        return len(blocks) * bs > limit[request_id] and \
            mgr.block_pool.is_block_writable(blocks[-1])

    def get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
                                   total_computed_tokens, num_local_computed_tokens,
                                   num_tokens_main_model, apply_admission_cap=False,
                                   prefill_end=0):
        decided.pop(request_id, None)
        if not apply_admission_cap and relocatable(request_id, num_tokens_main_model,
                                                   new_computed_blocks):
            decided[request_id] = len(mgr.req_to_blocks[request_id])
            return 0
        return count(request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                     num_local_computed_tokens, num_tokens_main_model,
                     apply_admission_cap=apply_admission_cap, prefill_end=prefill_end)

    def allocate_new_blocks(request_id, num_tokens, num_tokens_main_model):
        n = decided.pop(request_id, None)
        if n is None or not relocatable(request_id, num_tokens_main_model) or \
                len(mgr.req_to_blocks[request_id]) != n:
            return allocate(request_id, num_tokens, num_tokens_main_model)
        blocks = mgr.req_to_blocks[request_id]
        block = blocks[-1]
        blocks[-1] = mgr._null_block
        blocks.append(block)
        # vLLM's bookkeeping of a new running block (its column ``n``): the column it frees
        # a step later is null now, so nothing is freed.
        mgr.last_state_block_idx[request_id] = n - 1
        mgr._allocated_block_reqs.add(request_id)
        on_relocate()
        return [block]

    def cache_blocks(request, num_tokens, retention_interval=None, *, replay_boundaries):
        limit[request.request_id] = max(request.num_prompt_tokens - 1,
                                        request.shared_prefix_boundary or 0,
                                        *replay_boundaries)
        return cache(request, num_tokens, retention_interval,
                     replay_boundaries=replay_boundaries)

    def pop_blocks_for_free(request_id):
        limit.pop(request_id, None)
        decided.pop(request_id, None)
        return pop(request_id)

    mgr.get_num_blocks_to_allocate = get_num_blocks_to_allocate
    mgr.allocate_new_blocks = allocate_new_blocks
    mgr.cache_blocks = cache_blocks
    mgr.pop_blocks_for_free = pop_blocks_for_free
    return True


def apply() -> None:
    """Nothing to install globally (the arena installs it on its own managers)."""
    check()
