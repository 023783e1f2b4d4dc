"""The DSA indexer's scores ``q . k`` with bits that do not depend on how many keys are scored.

TP shard mode scores a rank's share of a request's keys and merges the shares' top-k; stock
(the whole scoring) and the shards select the same rows only if a key's score has the same
bits whatever the keys beside it. A BLAS product does not promise that: MKL / oneDNN pick
kernels and blocking by shape and by CPU (AMX, AVX-512, AVX2), so a query times 8 keys and
the same query times 33 keys need not round alike. Two paths, neither of which a BLAS's
reduction order can change, and no host-specific branch:

- **Exact** (the indexer's own inputs): the queries are fp8 values and every key is fp8 values
  times one power-of-two scale (`cpu_indexer.quant_fp8_ue8m0`). Then each row is an integer of
  at most 21 bits times a power of two (4 significant bits, exponents within 17 of each
  other), a product of a query and a key element at most 42 bits, and a sum of D <= 2**11 of
  them at most 53 bits: float64 holds every partial sum exactly, in any order and with or
  without FMA. The float64 product is therefore the exact
  dot product, rounded once to float32 (round to nearest even): the same bits on every x86
  CPU, at BLAS speed.
- **Fixed order** (any other float input): elementwise products (each rounded once), summed by
  a pairwise tree over the head dimension whose shape depends on D alone; keys in chunks
  (elementwise ops give each element the same bits whatever the chunk). Slower; a caller
  that feeds fp8-grid inputs never takes it.

`scores(q, keys)` picks the path from the data (`on_fp8_grid`): one elementwise pass over the
queries and the keys, cheap beside the product.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
MAX_ROW_EXPONENT_SPAN = 17  # fp8 e4m3: 448 = 1.75 * 2**8 down to 2**-9
MAX_EXACT_DIM = 1 << 11  # 21-bit rows: 42-bit products, a sum of up to 2**11: < 2**53
FIXED_ORDER_CHUNK = 1 << 23  # elements of one product block on the fixed-order path


def on_fp8_grid(x: torch.Tensor) -> bool:
    """Every row of ``x`` (last dim) holds fp8 e4m3 values times one power of two of its own
    (1 for raw fp8 values), in the sense the exact path needs: each nonzero value has at most
    4 significant bits and a row's exponents span at most 17 (448 down to fp8's smallest
    subnormal), so a row is an integer of at most 21 bits times a power of two. NaN, inf or an
    fp32 subnormal anywhere: False. Bit operations only (cheap beside the product)."""
    if x.numel() == 0:
        return True
    bits = x.reshape(-1, x.shape[-1]).float().view(torch.int32)
    if bool((bits & 0xFFFFF).any()):  # more than 3 explicit mantissa bits somewhere
        return False
    exp = (bits >> 23) & 0xFF
    nonzero = (bits & 0x7FFFFFFF) != 0
    if bool((nonzero & ((exp == 0) | (exp == 0xFF))).any()):  # subnormal, inf or NaN
        return False
    hi = exp.amax(dim=-1)
    lo = torch.where(nonzero, exp, torch.full_like(exp, 0xFF)).amin(dim=-1)
    return bool(((hi - lo) <= MAX_ROW_EXPONENT_SPAN).all())


def exact_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q [n, H, D]``, ``keys [L, D]`` on the fp8 grid -> ``[n, H, L]`` float32, the exact dot
    products rounded once (see the module docstring)."""
    return torch.einsum("nhd,ld->nhl", q.double(), keys.double()).float()


def fixed_order_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q [n, H, D]``, ``keys [L, D]`` float32 -> ``[n, H, L]``: products rounded once each,
    summed over D by a pairwise tree fixed by D."""
    n, H, D = q.shape
    L = keys.shape[0]
    out = torch.empty(n, H, L, dtype=torch.float32)
    qf, kf = q.float(), keys.float()
    step = max(1, FIXED_ORDER_CHUNK // max(1, n * H * D))
    for s in range(0, L, step):
        e = min(L, s + step)
        x = qf.unsqueeze(2) * kf[s:e].unsqueeze(0).unsqueeze(0)  # [n, H, l, D]
        while x.shape[-1] > 1:
            half = x.shape[-1] // 2
            y = x[..., :half] + x[..., half:2 * half]
            x = torch.cat([y, x[..., 2 * half:]], -1) if x.shape[-1] % 2 else y
        out[:, :, s:e] = x[..., 0]
    return out


def scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q [n, H, D] . keys [L, D] -> [n, H, L]`` float32 whose bits for a key do not depend on
    the other keys: exact on fp8-grid inputs (the indexer's), fixed-order otherwise."""
    if q.shape[-1] <= MAX_EXACT_DIM and on_fp8_grid(q) and on_fp8_grid(keys):
        return exact_scores(q, keys)
    return fixed_order_scores(q, keys)
