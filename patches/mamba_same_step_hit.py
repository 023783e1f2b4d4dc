"""Hook: vLLM's same-step-hit guard of the GDN/mamba managers the arena owns
(`MambaManager.cache_blocks` / `_cache_partial_tail_block` feeding `cached_blocks_this_step`,
which `get_num_blocks_to_allocate` reads; v1/core/single_type_kv_cache_manager.py), installed
on those manager instances only (`engine/arena/pools.keep_state_checkpoints`); vLLM's class
and every other engine keep vLLM's methods.

A request whose last hit block's hash is in the manager's `cached_blocks_this_step` is not
admitted this step (`get_num_blocks_to_allocate` returns `num_gpu_blocks + 1`). Besides the
blocks cached this step, align-mode `cache_blocks` puts there the state block at the prompt's
last hash-block boundary whenever it is called with exactly that boundary
(`_cache_partial_tail_block`). The hybrid coordinator rounds the tokens it caches down to the
scheduler's block (`HybridKVCacheCoordinator._align_cacheable`), so with stock's block (640
tokens on the tiny Qwen3-Next, hash block = block) that call happens in the step a prompt's
prefill reaches its last 640-token boundary, in the next step (its last chunk: the state
block is still in its table), and in the step a request hitting that state is admitted (the
hit block is in its table until the next step's `remove_skipped_blocks`): in each, a second
request hitting the same state waits a step, and every request queued behind it with it.

The arena's 32-token pages put that boundary at `floor32(len - 1)`, past the shared prefix,
where no state is (the arena splits prefills at stock's block, `patches/mamba_checkpoint_split`,
and keeps the state at stock's boundary, `pools.keep_state_checkpoints`): the guard never
fires for a hit of that state, the arena admits two siblings in the step stock admits one,
and the prompt prefills in another batch (bf16 GDN on the CPU build is not batch-invariant:
issue 45's 12/16 MiB wave 2, one prompt's tokens differed from stock's from token 28 on).
So the installed `cache_blocks` applies vLLM's rule once more at stock's block: when the
cached tokens rounded down to it equal the prompt's last boundary at it (vLLM's
`get_mamba_prefill_checkpoint_position`, Mamba's `drop_eagle_checkpoint_block`) and the
request's state block ending there is in its table, that prefix's hash is put in
`cached_blocks_this_step`. Nothing is cached, allocated or freed; only admission waits, as
stock's does. Not repeated: vLLM's internal-checkpoint re-keying (a request with an entry in
`_checkpoints` keeps vLLM's rule only) and its shared-prefix junction case (the arena's
junctions are at its own block, where vLLM's rule already sees them).
"""
from __future__ import annotations

import hashlib
import inspect

from ._hook import VllmHookError, check_vllm_version, resolve

HOOK = "mamba_same_step_hit"
# The code whose rule the installed `cache_blocks` repeats (written against these sources).
UPSTREAM = {
    ("vllm.v1.core.single_type_kv_cache_manager", "MambaManager.cache_blocks"):
        "626bd25664008900",
    ("vllm.v1.core.single_type_kv_cache_manager", "MambaManager._cache_partial_tail_block"):
        "9b239358d444c517",
    ("vllm.v1.core.single_type_kv_cache_manager", "MambaManager.get_num_blocks_to_allocate"):
        "1cb46983bbf184ff",
    ("vllm.v1.core.single_type_kv_cache_manager", "MambaManager.new_step_starts"):
        "a2fbcc68b60c8a46",
    ("vllm.v1.core.kv_cache_coordinator", "HybridKVCacheCoordinator._align_cacheable"):
        "0a579dcba95975db",
}


def check() -> None:
    """Fails loudly when vLLM's same-step-hit rule is not the one this hook repeats."""
    check_vllm_version(HOOK)
    for (module, attr), digest in UPSTREAM.items():
        _, fn = resolve(module, attr, HOOK)
        fn = getattr(fn, "__ulacache_original__", fn)
        if hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16] != digest:
            raise VllmHookError(f"ulacache patch '{HOOK}': {module}.{attr} changed since vLLM "
                                "0.32.0; port the same-step-hit guard at stock's block "
                                "(and UPSTREAM)")


def boundary_hash(mgr, request, num_tokens: int, tokens: int):
    """The hash vLLM's `_cache_partial_tail_block` would put in `cached_blocks_this_step` at
    ``tokens``-token blocks (hash block = block, as stock's), for this call's ``num_tokens``
    (the arena's cacheable tokens); None where vLLM's rule would give none."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
    from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

    if request.request_id in mgr._checkpoints:  # vLLM re-keys its internal checkpoint
        return None
    coarse = num_tokens // tokens * tokens  # (stock's coordinator rounds to its block)
    if coarse <= 0 or coarse != get_mamba_prefill_checkpoint_position(
            request.num_prompt_tokens, tokens, mgr.drop_eagle_checkpoint_block):
        return None
    hbs = mgr.block_pool.hash_block_size
    if coarse % mgr.block_size or coarse % hbs or coarse // hbs > len(request.block_hashes):
        return None
    blocks = mgr.req_to_blocks.get(request.request_id, ())
    idx = coarse // mgr.block_size - 1
    if idx >= len(blocks) or blocks[idx].is_null:
        return None
    return make_block_hash_with_group_id(request.block_hashes[coarse // hbs - 1],
                                         mgr.kv_cache_group_id)


def install(mgr, tokens: int) -> bool:
    """Apply vLLM's same-step-hit rule at ``tokens``-token blocks too on ``mgr`` (see the
    module doc). False (nothing installed) where the manager is not an align-mode one or
    ``tokens`` is not a multiple of its block."""
    check()
    if (getattr(mgr, "mamba_cache_mode", None) != "align" or not tokens
            or tokens % mgr.block_size or tokens == mgr.block_size):
        return False
    cache = mgr.cache_blocks

    def cache_blocks(request, num_tokens, retention_interval=None, *, replay_boundaries):
        out = cache(request, num_tokens, retention_interval,
                    replay_boundaries=replay_boundaries)
        h = boundary_hash(mgr, request, num_tokens, tokens)
        if h is not None:
            mgr.cached_blocks_this_step.add(h)
        return out

    mgr.cache_blocks = cache_blocks
    return True


def apply() -> None:
    """Nothing to install globally (the arena installs it on its own managers)."""
    check()
