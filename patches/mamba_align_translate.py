"""Hook: `collect_mamba_copy_meta` (v1/worker/mamba_utils.py).

With prefix caching on, GDN/mamba layers run vLLM's "align" state mode: before each forward
`preprocess_mamba` copies a request's previous state block (a prefix-cache hit, or last
step's running state) into its current one, addressing states as `state[block_id]` with the
ids of the request's block table. Under the arena those ids are virtual page ids and the
state views are indexed by granule: the ids are translated to granules (the line worker's
`translate_ids`, `line.LineWorker`; the identity for a line that does not move pages) before
vLLM builds the copy list. A copy of a block onto itself (the arena's running state relocated
to its new column, `patches/mamba_running_state`) is dropped from the list. Every other
backend keeps vLLM's behaviour.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ._hook import replace, resolve

HOOK = "mamba_align_translate"
MODULE = "vllm.v1.worker.mamba_utils"


def collect(orig, copy_bufs, kv_cache_config, mamba_state_copy_funcs, mamba_group_ids,
            src_block_idx, dest_block_idx, accept_token_bias, req_state, forward_context):
    """The hook, given vLLM's original."""
    from ulacache_vllm.engine.connector import ula_connector

    conn = ula_connector()
    if conn is None:
        return orig(copy_bufs, kv_cache_config, mamba_state_copy_funcs, mamba_group_ids,
                    src_block_idx, dest_block_idx, accept_token_bias, req_state,
                    forward_context)
    ids = list(req_state.block_ids)
    for g in mamba_group_ids:
        ids[g] = conn.worker.translate_ids(ids[g])
    start = copy_bufs.offset
    out = orig(copy_bufs, kv_cache_config, mamba_state_copy_funcs, mamba_group_ids,
               src_block_idx, dest_block_idx, accept_token_bias,
               SimpleNamespace(block_ids=ids), forward_context)
    _drop_self_copies(copy_bufs, start)
    return out


def _drop_self_copies(copy_bufs, start: int) -> None:
    """Drop the entries from ``start`` on that copy a range onto itself."""
    src, dst, sizes = copy_bufs.src_ptrs.np, copy_bufs.dst_ptrs.np, copy_bufs.sizes.np
    end = copy_bufs.offset
    keep = np.flatnonzero(src[start:end] != dst[start:end]) + start
    k = start + len(keep)
    if k != end:  # (the kept entries move down in order; none is overwritten before read)
        src[start:k], dst[start:k], sizes[start:k] = src[keep], dst[keep], sizes[keep]
    copy_bufs.offset = k


def apply() -> None:
    _, orig = resolve(MODULE, "collect_mamba_copy_meta", HOOK)
    orig = getattr(orig, "__ulacache_original__", orig)

    def collect_mamba_copy_meta(copy_bufs, kv_cache_config, mamba_state_copy_funcs,
                                mamba_group_ids, src_block_idx, dest_block_idx,
                                accept_token_bias, req_state, forward_context):
        return collect(orig, copy_bufs, kv_cache_config, mamba_state_copy_funcs,
                       mamba_group_ids, src_block_idx, dest_block_idx, accept_token_bias,
                       req_state, forward_context)

    replace(MODULE, "collect_mamba_copy_meta", collect_mamba_copy_meta, HOOK)
