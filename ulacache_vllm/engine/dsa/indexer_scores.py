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
queries and the keys, cheap beside the product. `indexer_logits` is the indexer's whole score,
``sum_h w[t, h] * relu(q[t, h] . k[s])`` over each query's causal keys, in tiles of queries
and keys (a few MiB of product in reused buffers: no full-size float64 copy of the keys or the
product, no fresh pages per call) rounded, rectified, weighted and summed over heads there
(elementwise ops and a head tree fixed by H: a tile's bits are the whole's).

`certified_logits` is the whole (unsharded) indexer's faster route to the same selection: a
float32 BLAS pass, whose error against those exact logits is bounded a priori (any summation
order, any blocking: ``gamma_D * |q| |k|`` through relu, weight and head tree), then the exact
float64 product only for the keys whose bound straddles the query's k-th score. Every key it
does not rescore is certainly in or certainly out of the exact top-k, and every key tied at
the exact k-th score is rescored, so `topk.local_candidates` selects exactly what it selects
on `indexer_logits`. Its values are not all exact, so the shard path, whose candidates'
scores are merged across ranks, keeps `indexer_logits`.
"""
from __future__ import annotations

import math
import threading
from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
MAX_ROW_EXPONENT_SPAN = 17  # fp8 e4m3: 448 = 1.75 * 2**8 down to 2**-9
MAX_EXACT_DIM = 1 << 11  # 21-bit rows: 42-bit products, a sum of up to 2**11: < 2**53
FIXED_ORDER_CHUNK = 1 << 23  # elements of one product block on the fixed-order path
TILE_ROWS = 256  # (query, head) rows of one tile of `indexer_logits` (float64 products)
FAST_TILE_ROWS = 1024  # of the float32 pass (8 MiB of product: ~15% more GEMM throughput)
TILE_KEYS = 2048  # keys of one tile (2 MiB of float64 keys; 4 MiB of product at 256 rows)
FP8_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
FP8_TABLE64 = FP8_TABLE.double()


class _Scratch(threading.local):
    """Per-thread scratch buffers of `_tiled_logits`, kept between calls: a tile's few MiB
    are allocated once, not mapped afresh (and page-faulted) every call, which cost more than
    the decode at decode sizes. Grown on demand, never shrunk; one set per thread, so
    concurrent callers never share a buffer."""

    def __init__(self):
        self.bufs: dict = {}

    def get(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self.bufs.get((name, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype)
            self.bufs[(name, dtype)] = buf
        return buf[:numel]


_SCRATCH = _Scratch()


def _pair_table(table: torch.Tensor) -> torch.Tensor:
    """[65536] int64: the two float32 values of a little-endian pair of fp8 codes read as one
    uint16, packed in one 8-byte word (a 1-D gather of words is ~1.5x faster than one of
    [65536, 2] rows)."""
    i = torch.arange(1 << 16)
    pairs = torch.stack([table[i & 0xFF], table[i >> 8]], 1).contiguous()
    return pairs.view(torch.int64).view(-1)


FP8_PAIR_WORDS = _pair_table(FP8_TABLE)
FP8_PAIRS64 = FP8_PAIR_WORDS.view(torch.float32).view(-1, 2).double()  # [65536, 2] float64


def fp8_to_float(x: torch.Tensor, dtype: torch.dtype = torch.float32,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 e4m3 codes (uint8 or float8 dtype) -> float32 or float64, exact, through a table
    lookup on pairs of codes (~3-4x faster than `.float()` on vLLM's CPU torch). ``out``: a
    buffer of at least ``x.numel()`` elements to write into (fresh pages cost more than the
    lookup)."""
    codes = x.contiguous().view(torch.uint8)
    n = codes.numel()
    dst = (torch.empty(n, dtype=dtype) if out is None else out.view(-1)[:n])
    if n % 2 == 0 and n:
        decode_pairs(pair_indices(codes.reshape(-1)), dtype, dst)
    else:
        table = FP8_TABLE64 if dtype == torch.float64 else FP8_TABLE
        torch.index_select(table, 0, codes.reshape(-1).int(), out=dst)
    return dst.view(codes.shape)


def pair_indices(codes: torch.Tensor) -> torch.Tensor:
    """uint8 fp8 codes (an even last dim; rows may be strided) as int32 indices of
    `FP8_PAIR_WORDS`, one per two codes, shaped ``[..., last / 2]``."""
    if codes.stride(-1) != 1 or any(st % 2 for st in codes.stride()[:-1]) \
            or codes.storage_offset() % 2:
        codes = codes.contiguous()
    return codes.view(torch.uint16).int()


def decode_pairs(idx: torch.Tensor, dtype: torch.dtype, out: torch.Tensor) -> torch.Tensor:
    """The values of `pair_indices` ``idx`` into ``out`` (``2 * idx.numel()`` elements of
    ``dtype``, flat, starting at an even element): float32 by one gather of packed pairs,
    float64 by one gather of [2] rows (both exact)."""
    if dtype == torch.float64:
        return torch.index_select(FP8_PAIRS64, 0, idx.reshape(-1), out=out.view(-1, 2))
    torch.index_select(FP8_PAIR_WORDS, 0, idx.reshape(-1), out=out.view(-1).view(torch.int64))
    return out


class Fp8Keys(NamedTuple):
    """Keys as the indexer cache holds them: fp8 e4m3 codes and one power-of-two (UE8M0) scale
    per key. `indexer_logits` decodes them a tile at a time and applies the scale to the
    product (exact: a power of two), so no full-size float copy of the keys is made."""

    codes: torch.Tensor  # [L, D] uint8
    scales: torch.Tensor  # [L] float32, powers of two

    @property
    def shape(self):
        return self.codes.shape

    def __len__(self):
        return self.codes.shape[0]

    def on_grid(self) -> bool:
        """Every scale a positive, finite, normal power of two: the exact path's condition on
        the keys (the cache's UE8M0 scales are)."""
        b = self.scales.float().contiguous().view(torch.int32)  # bits: sign, exponent, mantissa
        if b.numel() == 0:
            return True
        lo, hi = torch.aminmax(b)  # > 0: positive, not zero; < inf's bits: finite
        return bool(lo > 0) and bool(hi < 0x7F800000) and not bool((b & 0x7FFFFF).any())

    def dequantized(self, dtype: torch.dtype = torch.float32, rows=None) -> torch.Tensor:
        """[L, D] (or the keys ``rows``) in ``dtype``, fp8 values times scales: exact."""
        codes, scales = (self.codes, self.scales) if rows is None else \
            (self.codes[rows], self.scales[rows])
        return fp8_to_float(codes, dtype) * scales.to(dtype).unsqueeze(1)


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


def fp32_gemm_is_ieee() -> bool:
    """torch's float32 matmuls round as IEEE float32 (no TF32 / bf16 inner products), which
    the error bound of `certified_logits` assumes."""
    if torch.get_float32_matmul_precision() != "highest":
        return False
    mm = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    return getattr(mm, "fp32_precision", "none") in ("none", "ieee")


def head_sum(x: torch.Tensor) -> torch.Tensor:
    """``x [n, H, L] -> [n, L]``, the sum over heads as a pairwise tree whose order depends on
    H alone: elementwise adds, so each key's logit has the same bits however many keys are
    scored beside it. A bmm over heads does not: vLLM's CPU torch takes a naive kernel below
    400 multiply-adds and a BLAS one above, whose sums differ in the last bits."""
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        y = x[:, :half] + x[:, half:2 * half]
        x = torch.cat([y, x[:, 2 * half:]], 1) if x.shape[1] % 2 else y
    return x[:, 0]


def head_sum_(x: torch.Tensor) -> torch.Tensor:
    """`head_sum` in place on a scratch ``x [n, H, L]`` (its contents are consumed): the same
    tree, the same bits, no temporaries. Returns an [n, L] view into ``x``."""
    h = x.shape[1]
    while h > 1:
        half = h // 2
        x.narrow(1, 0, half).add_(x.narrow(1, half, half))
        if h % 2:
            x.select(1, half).copy_(x.select(1, 2 * half))
        h = half + h % 2
    return x.select(1, 0)


def indexer_logits(q: torch.Tensor, weights: torch.Tensor, keys,
                   positions: torch.Tensor, key_positions: torch.Tensor,
                   exact: bool) -> torch.Tensor:
    """``logits[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])`` for every key with
    ``key_positions[s] <= positions[t]``, ``-inf`` for the others: [n, L] float32.

    ``q [n, H, D]`` float, ``weights [n, H]``, ``keys`` [L, D] float or `Fp8Keys`,
    ``key_positions`` ascending. ``exact``: q and keys are on the fp8 grid (`on_fp8_grid`,
    `Fp8Keys.on_grid`), so each ``q . k`` is the exact float64 product rounded once; otherwise
    the fixed-order path. Then, per element: relu, times the weight (float32), and the head
    tree (`head_sum`). No step's bits depend on the tile, so none depends on the keys beside."""
    return _tiled_logits(q, weights, keys, positions, key_positions,
                         "exact" if exact else "fixed")[0]


def _tiled_logits(q, weights, keys, positions, key_positions, mode: str):
    """`indexer_logits`'s tiles; ``mode``: "exact" (float64 products), "fixed" (fixed-order
    float32), or "fast" (one float32 BLAS product per tile, any order: approximate), which
    also returns the largest key 2-norm (float64, rounded up) for `certified_logits`'s bound.

    Keys outer, queries inner: a tile of keys is decoded once into a reused buffer, and every
    tile of queries whose last position reaches it is multiplied with it there."""
    n, H, D = q.shape
    L = keys.shape[0]
    out = torch.full((n, L), float("-inf"), dtype=torch.float32)
    knorm = 0.0 if mode == "fast" else None
    if n == 0 or L == 0:
        return out, knorm
    per = max(1, (FAST_TILE_ROWS if mode == "fast" else TILE_ROWS) // H)
    rows_max = min(per, n) * H
    tk = TILE_KEYS
    tiles = [(a, min(n, a + per)) for a in range(0, n, per)]
    # A key after a tile's last query is no query's: the causal triangle is skipped; a key
    # at or before its first query's position is every query's (no mask there).
    if len(tiles) == 1:
        ends = torch.stack(torch.aminmax(positions)).view(1, 2)
    else:
        padded = positions.new_empty(len(tiles) * per)
        padded[:n] = positions
        padded[n:] = positions[-1]
        ends = torch.stack(torch.aminmax(padded.view(len(tiles), per), dim=1), 1)
    bounds = torch.searchsorted(key_positions, ends, right=True).tolist()
    lims = [hi for _, hi in bounds]
    w = weights.float()
    fp8 = isinstance(keys, Fp8Keys)
    tiled = mode != "fixed"
    if tiled:
        dt = torch.float64 if mode == "exact" else torch.float32
        q_all = q.to(dt).reshape(n * H, D)
        kbuf = _SCRATCH.get("keys", min(tk, max(lims)) * D, dt)
        gbuf = _SCRATCH.get("product", rows_max * min(tk, max(lims)), dt)
        sbuf = _SCRATCH.get("rounded", rows_max * min(tk, max(lims)), torch.float32) \
            if mode == "exact" else None
        scales = keys.scales.to(dt) if fp8 else None
        # the codes as pair-table indices, once per call (`fp8_to_float`'s lookup, per tile)
        pairs = pair_indices(keys.codes) if fp8 and D % 2 == 0 else None
    else:
        q_all = q.float()
        kf = (keys.dequantized() if fp8 else keys).float()
    for c in range(0, max(lims), tk):
        d = min(max(lims), c + tk)
        if tiled:
            if pairs is not None:  # fp8 values times their power-of-two scale: exact
                kt = decode_pairs(pairs[c:d], dt, kbuf[:(d - c) * D]).view(d - c, D)
                kt.mul_(scales[c:d].unsqueeze(1))
            elif fp8:
                kt = fp8_to_float(keys.codes[c:d], dt, kbuf)
                kt.mul_(scales[c:d].unsqueeze(1))
            else:
                kt = kbuf[:(d - c) * D].view(d - c, D).copy_(keys[c:d])
            if knorm is not None:
                top = float(torch.linalg.vector_norm(kt, dim=1).amax())
                knorm = knorm if top <= knorm else top  # NaN propagates
        for (a, b), lim in zip(tiles, lims):
            e = min(d, lim)
            if e <= c:
                continue
            rows, cols = (b - a) * H, e - c
            if mode == "exact":
                g = torch.mm(q_all[a * H:b * H], kt[:cols].t(),
                             out=gbuf[:rows * cols].view(rows, cols))
                s = sbuf[:rows * cols].view(rows, cols).copy_(g)  # rounded once
            elif mode == "fast":
                s = torch.mm(q_all[a * H:b * H], kt[:cols].t(),
                             out=gbuf[:rows * cols].view(rows, cols))
            else:
                s = fixed_order_scores(q_all[a:b], kf[c:e]).reshape(rows, cols)
            s.relu_().mul_(w[a:b].reshape(-1, 1))
            out[a:b, c:e] = head_sum_(s.view(b - a, H, cols))
    for (a, b), (lo, hi) in zip(tiles, bounds):
        if lo < hi:
            out[a:b, lo:hi].masked_fill_(key_positions[lo:hi].unsqueeze(0)
                                         > positions[a:b].unsqueeze(1), float("-inf"))
    if knorm is not None:  # a float32 norm: up by its relative error bound
        knorm = knorm * (1.0 + (D + 4) * 2.0 ** -24)
    return out, knorm


def _exact_keys(keys, cols: torch.Tensor) -> torch.Tensor:
    """The keys ``cols`` as float64 [m, D] (exact: fp8 values times power-of-two scales)."""
    if isinstance(keys, Fp8Keys):
        return keys.dequantized(torch.float64, cols)
    return keys[cols].double()


def error_bound_factor(D: int, H: int) -> float:
    """C with ``|fast - exact| <= C * sum_h |w_h| |q_h| * |k|`` for one logit of
    `_tiled_logits`' "fast" mode against its "exact" mode, twice over for margin.

    One score: the float32 product of D terms in any order (blocked, FMA or not) is within
    ``gamma_D * sum_d |q_d k_d| <= gamma_D |q| |k|`` of the real dot product, the exact path's
    within ``u |q| |k|`` (one rounding), ``gamma_n = n u / (1 - n u)``, ``u = 2**-24``. relu is
    1-Lipschitz; the weight's rounding adds ``u`` to either side and the head tree of depth
    ``ceil(log2 H)`` ``gamma_depth`` times the sum of magnitudes, on either side."""
    u = 2.0 ** -24
    depth = max(1, math.ceil(math.log2(max(H, 1))))

    def gamma(m):
        return m * u / (1 - m * u)

    one = (gamma(D) + u) * (1 + u) + 2 * u * (1 + gamma(D) + u)
    tree = 2 * gamma(depth) * (1 + u) * (1 + gamma(D) + u)
    return 2.0 * (one + tree) * (1 + gamma(depth))


# Absolute slack for float32 underflow (flush-to-zero hosts): far below any logit that matters.
ABS_SLACK = 2.0 ** -100


def certified_logits(q: torch.Tensor, weights: torch.Tensor, keys, positions: torch.Tensor,
                     key_positions: torch.Tensor, topk: int) -> torch.Tensor | None:
    """[n, L] float32 logits on which `topk.local_candidates(., key_positions, topk)` selects
    exactly what it selects on ``indexer_logits(..., exact=True)`` (the module docstring):
    the float32 approximation, with the exact logit for every key whose bound straddles its
    query's k-th approximate score T (``|approx - T| <= 2b``). Inputs on the fp8 grid; None
    where float32 GEMMs are not IEEE or the approximation is not finite (the caller then
    scores exactly).

    Why it is exact: with ``|approx - exact| <= b`` per key, at least k keys have
    ``exact >= T - b`` and fewer than k have ``exact > T + b``, so the exact k-th score E lies
    in ``[T - b, T + b]``. A key left above (``approx > T + 2b``) is above E and above every
    rescored key not in the exact top-k (those read <= E), one left below (``< T - 2b``) is
    below E; every key tied at E is rescored and ordered by position as in the exact case. So
    the k best of these logits are the exact k best, though their values are not all exact."""
    if not fp32_gemm_is_ieee():
        return None
    n, H, D = q.shape
    approx, knorm = _tiled_logits(q, weights, keys, positions, key_positions, "fast")
    if n == 0 or approx.shape[1] == 0:
        return approx
    q64 = q.double()
    w = weights.float()
    # twice the bound, per query: 2 * C * max|k| * sum_h |w_h| |q_h|
    two_b = torch.linalg.vector_norm(q64, dim=-1).mul_(w.abs()).sum(1, keepdim=True)
    two_b.mul_(2 * error_bound_factor(D, H) * knorm).add_(2 * ABS_SLACK)
    if not (float(approx.amax()) < math.inf and math.isfinite(float(two_b.amax()))):
        return None  # NaN or +inf in the approximation, or an infinite bound
    kk = min(topk, approx.shape[1])
    thr = approx.topk(kk, dim=1, sorted=False).values.amin(1, keepdim=True)  # -inf: < kk causal
    near = (approx - thr).abs_() <= two_b.float()
    per = max(1, TILE_ROWS // H)
    for a in range(0, n, per):
        b = min(n, a + per)
        near_t = near if b - a == n else near[a:b]
        cols = near_t.any(0).nonzero().squeeze(1)
        if cols.numel() == 0:
            continue
        qt = q64 if b - a == n else q64[a:b]
        g = torch.mm(qt.reshape(-1, D), _exact_keys(keys, cols).t())
        s = g.float().relu_().mul_(w[a:b].reshape(-1, 1))  # as `indexer_logits`' exact path
        exact = head_sum_(s.view(b - a, H, cols.numel()))
        at = approx if b - a == n else approx[a:b]
        at[:, cols] = torch.where(near_t.index_select(1, cols), exact, at.index_select(1, cols))
    return approx
