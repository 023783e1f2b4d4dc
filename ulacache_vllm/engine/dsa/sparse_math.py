"""Sparse MLA attention over gathered rows (torch math, float32 accumulation).

Same computation as vLLM's `reference_mla_sparse_prefill` (absorbed MQA: each query head attends
over the `K` selected latent rows `[kv_c 512 | k_pe 64]`, values are the first `d_v` columns), but
without modifying its index argument, with -1 padding handled, and chunked over tokens to bound
the gathered working set. Per-token results do not depend on which other tokens are in the batch.
"""
from __future__ import annotations

import torch

TOKEN_CHUNK = 256


def sparse_mla_attention(
    q: torch.Tensor,  # [T, H, D_qk]
    kv_rows: torch.Tensor,  # [R, D_qk] flat row view of the KV cache
    rows: torch.Tensor,  # [T, K] row ids, -1 = not selected
    scale: float,
    d_v: int,
    staged: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out [T, H, d_v] in q.dtype, lse [T, H] float32, natural log). ``staged``:
    (ids [T, K], rows [R', D_qk]) pairs, e.g. the host pool and fetched remote rows; a
    selection is read from a staged source where its id there is >= 0 (by the same gather),
    else from ``kv_rows``."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, d_v, dtype=q.dtype, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    for s in range(0, T, TOKEN_CHUNK):
        e = min(T, s + TOKEN_CHUNK)
        idx = rows[s:e].long()
        t, K = idx.shape
        valid = idx >= 0
        # Flat row gathers (index_select: ~2.5x advanced indexing's speed on CPU); the staged
        # rows are merged in as whole-row integers (`_as_words`), the same bytes.
        kv = kv_rows.index_select(0, idx.reshape(-1).clamp(min=0))  # [t * K, D]
        for ids, src in staged or ():  # stage: other sources' rows beside the device rows
            h = ids[s:e].long()
            there = h >= 0
            if src.shape[0] == 0:
                continue
            got = src.index_select(0, h.reshape(-1).clamp(min=0)).to(kv.device)
            kv = torch.where(there.reshape(-1, 1), _as_words(got), _as_words(kv)).view(kv.dtype)
            valid = valid | there
        kv = kv.view(t, K, -1).float()
        # Padding gathers row 0; zero it so whatever lives there (even NaN/Inf) cannot leak
        # into the output through 0 * x in the value product.
        kv = kv.masked_fill(~valid.unsqueeze(-1), 0.0)
        scores = torch.einsum("thd,tkd->thk", q[s:e].float(), kv) * scale
        scores.masked_fill_(~valid.unsqueeze(1), float("-inf"))
        m = torch.logsumexp(scores, dim=-1)  # [t, H]
        has_any = valid.any(dim=-1)  # tokens with no selected row produce zeros
        probs = torch.exp(scores - m.unsqueeze(-1))
        probs = torch.where(has_any[:, None, None], probs, torch.zeros_like(probs))
        out[s:e] = torch.einsum("thk,tkd->thd", probs, kv[..., :d_v]).to(q.dtype)
        lse[s:e] = torch.where(has_any[:, None], m, lse[s:e])
    return out, lse


def _as_words(rows: torch.Tensor) -> torch.Tensor:
    """Contiguous ``[N, D]`` rows viewed as int64 words when a row is a whole number of them
    (a row merge then moves 8 bytes an element: ~2x the speed of float32 on CPU)."""
    if rows.is_contiguous() and (rows.shape[1] * rows.element_size()) % 8 == 0:
        return rows.view(torch.int64)
    return rows
