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
"""
from __future__ import annotations

from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
MAX_ROW_EXPONENT_SPAN = 17  # fp8 e4m3: 448 = 1.75 * 2**8 down to 2**-9
MAX_EXACT_DIM = 1 << 11  # 21-bit rows: 42-bit products, a sum of up to 2**11: < 2**53
FIXED_ORDER_CHUNK = 1 << 23  # elements of one product block on the fixed-order path
TILE_ROWS = 256  # (query, head) rows of one tile of `indexer_logits`
TILE_KEYS = 2048  # keys of one tile (2 MiB of float64 keys; 4 MiB of product at 256 rows)
FP8_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
FP8_TABLE64 = FP8_TABLE.double()


def fp8_to_float(x: torch.Tensor, table: torch.Tensor = FP8_TABLE,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 e4m3 codes (uint8 or float8 dtype) -> float32 (or ``table``'s dtype) through a
    256-entry table: exact, and ~3x faster than `.float()` on vLLM's CPU torch."""
    codes = x.contiguous().view(torch.uint8)
    flat = codes.reshape(-1).int()
    if out is None:
        return table.index_select(0, flat).view(codes.shape)
    return torch.index_select(table, 0, flat, out=out.view(-1)).view(codes.shape)


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
        """Every scale a finite power of two: the exact path's condition on the keys."""
        m = torch.frexp(self.scales).mantissa
        return bool(((m == 0.5) & torch.isfinite(self.scales)).all())

    def dequantized(self) -> torch.Tensor:
        """[L, D] float32 (fp8 values times scales: exact)."""
        return fp8_to_float(self.codes) * self.scales.unsqueeze(1)


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


def indexer_logits(q: torch.Tensor, weights: torch.Tensor, keys,
                   positions: torch.Tensor, key_positions: torch.Tensor,
                   exact: bool) -> torch.Tensor:
    """``logits[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])`` for every key with
    ``key_positions[s] <= positions[t]``, ``-inf`` for the others: [n, L] float32.

    ``q [n, H, D]`` float, ``weights [n, H]``, ``keys`` [L, D] float or `Fp8Keys`,
    ``key_positions`` ascending. ``exact``: q and keys are on the fp8 grid (`on_fp8_grid`,
    `Fp8Keys.on_grid`), so each ``q . k`` is the exact float64 product rounded once; otherwise
    the fixed-order path. Then, per element: relu, times the weight (float32), and the head
    tree (`head_sum`). No step's bits depend on the tile, so none depends on the keys beside.

    Keys outer, queries inner: a tile of keys is decoded once into a reused buffer, and every
    tile of queries whose last position reaches it is multiplied with it there."""
    n, H, D = q.shape
    L = keys.shape[0]
    out = torch.full((n, L), float("-inf"), dtype=torch.float32)
    if n == 0 or L == 0:
        return out
    per = max(1, TILE_ROWS // H)
    rows_max = min(per, n) * H
    tk = TILE_KEYS
    tiles = [(a, min(n, a + per)) for a in range(0, n, per)]
    # A key after a tile's last query is no query's: the causal triangle is skipped.
    last = positions.new_full((len(tiles) * per,), int(positions.min()))
    last[:n] = positions
    lims = torch.searchsorted(key_positions, last.view(len(tiles), per).amax(1),
                              right=True).tolist()
    w = weights.float()
    fp8 = isinstance(keys, Fp8Keys)
    if exact:
        q_all = q.double().reshape(n * H, D)
        kbuf = torch.empty(tk * D, dtype=torch.float64)
        gbuf = torch.empty(rows_max * tk, dtype=torch.float64)
        sbuf = torch.empty(rows_max * tk, dtype=torch.float32)
        scales = keys.scales.double() if fp8 else None
    else:
        q_all = q.float()
        kf = (keys.dequantized() if fp8 else keys).float()
    for c in range(0, max(lims), tk):
        d = min(max(lims), c + tk)
        if exact:
            if fp8:  # times its power-of-two scale: exact
                kt = fp8_to_float(keys.codes[c:d], FP8_TABLE64, kbuf[:(d - c) * D])
                kt.mul_(scales[c:d].unsqueeze(1))
            else:
                kt = kbuf[:(d - c) * D].view(d - c, D).copy_(keys[c:d])
        for (a, b), lim in zip(tiles, lims):
            e = min(d, lim)
            if e <= c:
                continue
            rows, cols = (b - a) * H, e - c
            if exact:
                g = torch.mm(q_all[a * H:b * H], kt[:cols].t(),
                             out=gbuf[:rows * cols].view(rows, cols))
                s = sbuf[:rows * cols].view(rows, cols).copy_(g)  # rounded once
            else:
                s = fixed_order_scores(q_all[a:b], kf[c:e]).reshape(rows, cols)
            s.relu_().mul_(w[a:b].reshape(-1, 1))
            out[a:b, c:e] = head_sum(s.view(b - a, H, cols))
    for (a, b), lim in zip(tiles, lims):
        out[a:b, :lim].masked_fill_(
            key_positions[:lim].unsqueeze(0) > positions[a:b].unsqueeze(1), float("-inf"))
    return out
