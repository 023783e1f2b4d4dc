"""The DSA indexer's top-k in one canonical order, whole or merged from token shards.

`torch.topk` does not order ties (DSA logits tie often: 0 whenever every head's relu(q.k) is
0), so the set it returns for tied scores at the k-th place is not a function of the scores
alone. Here the selection is: score descending, then position ascending; the output lists the
selected positions ascending, -1 padded. Stock vLLM (through ulacache's CPU indexer) and every
TP mode select with these functions, so a token-sharded indexer that merges per-rank
candidates (`merge_candidates`) selects exactly what the whole indexer selects: every member of
the global top-k is in its owner's local top-k under the same total order.

Scores are float32; positions travel through a float32 all-gather as raw bits
(`pack_candidates`), so any int32 position survives.
"""
from __future__ import annotations

import numpy as np
import torch

NEG_INF = float("-inf")


def _canonical_idx(scores: torch.Tensor, kk: int) -> torch.Tensor:
    """[n, kk] column indices of the kk best by (score desc, column asc), ascending; m where
    fewer than kk candidates are finite."""
    vals, cols = scores.topk(kk, dim=-1, sorted=False)
    thr = vals.amin(-1, keepdim=True)  # the k-th best
    # a row where exactly kk finite scores reach the k-th: no tie straddles the k-th place,
    # so top-k's own set is the canonical one (the common case); the others below
    ok = (thr > NEG_INF) & ((scores >= thr).sum(-1, keepdim=True, dtype=torch.int32) == kk)
    idx = cols.sort(dim=-1).values
    if not bool(ok.all()):
        bad = (~ok).squeeze(1).nonzero().squeeze(1)
        idx[bad] = _canonical_ties(scores[bad], thr[bad], kk)
    return idx


def _canonical_ties(scores: torch.Tensor, thr: torch.Tensor, kk: int) -> torch.Tensor:
    """`_canonical_idx` for rows whose k-th best score ``thr`` [n, 1] is tied past the k-th
    place or is -inf: the ties at the k-th place taken lowest column first."""
    n, m = scores.shape
    finite = scores > NEG_INF
    gt = (scores > thr) & finite
    eq = (scores == thr) & finite
    need = kk - gt.sum(dim=-1, keepdim=True)
    sel = gt | (eq & (eq.cumsum(dim=-1) <= need))  # tied at the k-th: lowest columns first
    iota = torch.arange(m, device=scores.device)
    key = torch.where(sel, iota, torch.full_like(iota, m))
    return key.topk(kk, dim=-1, largest=False, sorted=True).values


def _picked(scores: torch.Tensor, positions: torch.Tensor, kk: int):
    """(column indices [n, kk] as `_canonical_idx` gives them, which are real, their
    positions as int32) of the canonical top-kk."""
    n, m = scores.shape
    idx = _canonical_idx(scores, kk)
    col = idx.clamp(max=m - 1)
    pos = positions if positions.dim() == 2 else positions.unsqueeze(0).expand(n, m)
    return col, idx < m, pos.gather(1, col).to(torch.int32)


def canonical_topk(scores: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """``scores`` [n, m] float (-inf: not a candidate), ``positions`` [n, m] int ascending
    along m (or [m], shared). Returns [n, k] int32: the positions of the k best candidates by
    (score desc, position asc), ascending, -1 padded."""
    n, m = scores.shape
    out = torch.full((n, k), -1, dtype=torch.int32, device=scores.device)
    kk = min(k, m)
    if kk and n:
        _, ok, picked = _picked(scores, positions, kk)
        out[:, :kk] = torch.where(ok, picked, torch.full_like(picked, -1))
    return out


def local_candidates(scores: torch.Tensor, positions: torch.Tensor, k: int):
    """One shard's candidates: its canonical top-k as (scores [n, k] float32 with -inf
    padding, positions [n, k] int32 with -1 padding), positions ascending."""
    n, m = scores.shape
    vals = torch.full((n, k), NEG_INF, dtype=torch.float32, device=scores.device)
    out = torch.full((n, k), -1, dtype=torch.int32, device=scores.device)
    kk = min(k, m)
    if kk == 0 or n == 0:
        return vals, out
    col, ok, picked = _picked(scores, positions, kk)
    out[:, :kk] = torch.where(ok, picked, torch.full_like(picked, -1))
    v = scores.gather(1, col).float()
    vals[:, :kk] = torch.where(ok, v, torch.full_like(v, NEG_INF))
    return vals, out


def pack_candidates(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[n, k] float32 scores + [n, k] int32 positions -> [n, 2k] float32 (positions as bits)."""
    return torch.cat([scores.float(), positions.to(torch.int32).view(torch.float32)], dim=-1)


def unpack_candidates(packed: torch.Tensor):
    k = packed.shape[-1] // 2
    return packed[..., :k], packed[..., k:].contiguous().view(torch.int32)


def merge_candidates(scores: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """Global canonical top-k from every shard's candidates: ``scores``/``positions``
    [P, n, k'] CPU tensors (padding: -inf / -1). Returns [n, k] int32 positions ascending, -1
    padded. One compiled pass (`kernels.shard_cpu.merge_topk`): shard mode runs on CPU only."""
    from ulacache_vllm.kernels.shard_cpu import merge_topk

    s = np.ascontiguousarray(scores.float().numpy())
    p = np.ascontiguousarray(positions.to(torch.int32).numpy())
    return torch.from_numpy(merge_topk(s, p, k))
