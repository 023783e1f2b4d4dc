"""Triton kernels of the lab's queue and bitmap PB-LRUs: the queue's push, hit detection +
touch, stale filter + first-k, and the bitmaps' popcount and first-k expansion.

Same semantics and bit layout as ``queue_kernels`` (the CPU path and the oracle). Import
lazily (``queue_kernels.impl``): ``triton.jit`` decides compiled vs interpreted
(``TRITON_INTERPRET=1``) at decoration time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _popcount_kernel(words_ptr, out_ptr, M, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = rows < M
    w = tl.load(words_ptr + rows, mask=m, other=0)
    j = tl.arange(0, 64).to(tl.int64)
    bits = (w[:, None] >> j[None, :]) & 1
    tl.store(out_ptr + rows, tl.sum(bits, axis=1), mask=m)


@triton.jit
def _expand_kernel(words_ptr, excl_ptr, out_ptr, M, K, BLOCK: tl.constexpr):
    # Each set bit writes its own position at (exclusive prefix of its word + rank in word).
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = rows < M
    w = tl.load(words_ptr + rows, mask=m, other=0)
    base = tl.load(excl_ptr + rows, mask=m, other=0)
    j = tl.arange(0, 64).to(tl.int64)
    bits = (w[:, None] >> j[None, :]) & 1
    rank = tl.cumsum(bits, axis=1) - bits
    pos = base[:, None] + rank
    keep = (bits != 0) & (pos < K) & m[:, None]
    val = rows.to(tl.int64)[:, None] * 64 + j[None, :]
    tl.store(out_ptr + pos, val, mask=keep)


@triton.jit
def _queue_push_kernel(slots_ptr, qslot_ptr, qpos_ptr, start, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    s = tl.load(slots_ptr + offs, mask=m, other=0)
    pos = offs.to(tl.int64) + start
    tl.store(qslot_ptr + pos, s, mask=m)
    tl.store(qpos_ptr + s, pos, mask=m)  # slots are unique: no races


@triton.jit
def _hit_flags_kernel(loc_ptr, flags_ptr, n, BLOCK: tl.constexpr):
    # A table value is a hit iff its tier (bits 32 and up) is 0; -1 (unmapped) is not.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(loc_ptr + offs, mask=m, other=-1)
    tl.store(flags_ptr + offs, ((v >> 32) == 0).to(tl.int64), mask=m)


@triton.jit
def _hit_push_kernel(loc_ptr, cum_ptr, qslot_ptr, qpos_ptr, start, n, BLOCK: tl.constexpr):
    # Each hit appends its slot at start + (its rank among the hits): input order is kept.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(loc_ptr + offs, mask=m, other=-1)
    hit = m & ((v >> 32) == 0)
    pos = start + tl.load(cum_ptr + offs, mask=m, other=1) - 1
    tl.store(qslot_ptr + pos, v, mask=hit)
    tl.store(qpos_ptr + v, pos, mask=hit)  # unique entries: unique slots, no races


@triton.jit
def _queue_live_kernel(wslots_ptr, wpos_ptr, qpos_ptr, flags_ptr, n, BLOCK: tl.constexpr):
    # Stale filter: an entry is live iff it is its slot's latest entry (qpos[slot] == pos).
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    s = tl.load(wslots_ptr + offs, mask=m, other=0)
    p = tl.load(wpos_ptr + offs, mask=m, other=-2)
    q = tl.load(qpos_ptr + s, mask=m, other=-1)
    tl.store(flags_ptr + offs, (q == p).to(tl.int64), mask=m)


@triton.jit
def _queue_first_k_kernel(wslots_ptr, flags_ptr, cum_ptr, out_ptr, n, K, BLOCK: tl.constexpr):
    # Each live entry writes its slot at its rank among the live ones, if that rank is < K.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    f = tl.load(flags_ptr + offs, mask=m, other=0)
    rank = tl.load(cum_ptr + offs, mask=m, other=0) - 1
    keep = m & (f != 0) & (rank < K)
    s = tl.load(wslots_ptr + offs, mask=keep, other=0)
    tl.store(out_ptr + rank, s, mask=keep)


_BLOCK_W = 64
_BLOCK_N = 256


def popcount64(words: torch.Tensor) -> torch.Tensor:
    words = words.contiguous()  # the kernel indexes flat memory
    out = torch.empty_like(words)
    M = words.numel()
    if M:
        _popcount_kernel[(triton.cdiv(M, _BLOCK_W),)](words, out, M, BLOCK=_BLOCK_W)
    return out


def expand_first_k(words: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or words.numel() == 0:
        return words.new_empty(0)
    words = words.contiguous()
    cnt = popcount64(words)
    cum = torch.cumsum(cnt, 0)
    total = int(cum[-1].item())
    k = min(k, total)
    out = torch.empty(k, dtype=torch.int64, device=words.device)
    if k:
        excl = cum - cnt
        M = words.numel()
        _expand_kernel[(triton.cdiv(M, _BLOCK_W),)](words, excl, out, M, k, BLOCK=_BLOCK_W)
    return out


def queue_push(slots: torch.Tensor, qslot: torch.Tensor, qpos: torch.Tensor, start: int,
               pos: torch.Tensor | None = None) -> None:
    n = slots.numel()
    if n:
        _queue_push_kernel[(triton.cdiv(n, _BLOCK_N),)](
            slots.contiguous(), qslot, qpos, start, n, BLOCK=_BLOCK_N)


def hit_touch_push(loc_vals: torch.Tensor, qslot: torch.Tensor, qpos: torch.Tensor, start: int,
                   iota: torch.Tensor | None = None):
    """Hit flags, a prefix sum, one scatter kernel: no boolean compaction on the way."""
    n = loc_vals.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=loc_vals.device), loc_vals.new_empty(0)
    loc = loc_vals.contiguous()
    flags = torch.empty(n, dtype=torch.int64, device=loc.device)
    grid = (triton.cdiv(n, _BLOCK_N),)
    _hit_flags_kernel[grid](loc, flags, n, BLOCK=_BLOCK_N)
    cum = torch.cumsum(flags, 0)
    nh = int(cum[-1].item())
    if nh:
        _hit_push_kernel[grid](loc, cum, qslot, qpos, start, n, BLOCK=_BLOCK_N)
    # Hit slots leave as int64 (the queue may be int32); to(copy=True): never a view of it.
    return flags.bool(), qslot[start:start + nh].to(torch.int64, copy=True)


def queue_take(wslots: torch.Tensor, wpos: torch.Tensor, qpos: torch.Tensor, k: int):
    m = wslots.numel()
    if k <= 0 or m == 0:
        return wslots.new_empty(0), 0, 0
    wslots, wpos = wslots.contiguous(), wpos.contiguous()
    flags = torch.empty(m, dtype=torch.int64, device=wslots.device)
    grid = (triton.cdiv(m, _BLOCK_N),)
    _queue_live_kernel[grid](wslots, wpos, qpos, flags, m, BLOCK=_BLOCK_N)
    cum = torch.cumsum(flags, 0)
    total = int(cum[-1].item())
    g = min(k, total)
    out = torch.empty(g, dtype=wslots.dtype, device=wslots.device)
    if g:
        _queue_first_k_kernel[grid](wslots, flags, cum, out, m, g, BLOCK=_BLOCK_N)
    if total <= k:
        return out, m, total
    # The k-th live entry is the first position where the running count reaches k.
    kt = torch.tensor([k], dtype=cum.dtype, device=cum.device)
    return out, int(torch.searchsorted(cum, kt).item()) + 1, total
