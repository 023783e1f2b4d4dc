"""Baseline for `benchmarks/indexer_scores.py`: the indexer's top-k as it scored before the
scores were made shape-independent (keys decoded by ``.float()``, one float32 BLAS product; a
single key scored beside a zero key). Its bits for a key depend on how many keys the product holds, on some CPUs."""
from __future__ import annotations

import torch

from ulacache_vllm.engine.dsa.cpu_indexer import FP8, SCORE_CHUNK, cache_views
from ulacache_vllm.engine.dsa.indexer_scores import head_sum
from ulacache_vllm.engine.dsa.topk import local_candidates


def read_keys_float(kv_cache, block_row, n):
    """The cache's keys as read before: fp8 decoded by ``.float()``, times the scales."""
    bs = kv_cache.shape[1]
    nb = (n + bs - 1) // bs
    values, scales = cache_views(kv_cache)
    ids = block_row[:nb].long()
    v = values[ids].reshape(nb * bs, -1)[:n].view(FP8).float()
    s = scales[ids].reshape(nb * bs, 4)[:n].contiguous().view(torch.float32)
    return v * s


def select_topk_fp32_blas(q, weights, keys, positions, topk, key_positions=None,
                          candidates=False):
    n, L = q.shape[0], keys.shape[0]
    key_pos = torch.arange(L) if key_positions is None else key_positions
    vals = torch.full((n, topk), float("-inf"), dtype=torch.float32)
    out = torch.full((n, topk), -1, dtype=torch.int32)
    kk = torch.cat([keys, keys.new_zeros(1, keys.shape[1])]) if L == 1 else keys
    for s in range(0, n, SCORE_CHUNK):
        e = min(n, s + SCORE_CHUNK)
        scores = torch.einsum("nhd,ld->nhl", q[s:e], kk)[..., :L].relu_()
        logits = head_sum(scores.mul_(weights[s:e].unsqueeze(-1)))
        causal = key_pos.unsqueeze(0) <= positions[s:e].unsqueeze(1)
        logits = logits.masked_fill(~causal, float("-inf"))
        vals[s:e], out[s:e] = local_candidates(logits, key_pos, topk)
    return (vals, out) if candidates else out
