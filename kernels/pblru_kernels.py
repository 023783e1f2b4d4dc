"""Triton kernels for PB-LRU: hit detection + touch, and first-k victim extraction from bitmaps.

Same semantics and bit layout as ``kernels.reference`` (which is the CPU path and the oracle).
Import lazily: ``triton.jit`` decides compiled vs interpreted (``TRITON_INTERPRET=1``) at
decoration time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import SLOT_BITS, SLOT_MASK


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
def _hit_touch_kernel(loc_ptr, n, stamps_ptr, stamp, hit_ptr, slot_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(loc_ptr + offs, mask=m, other=-1)
    hit = ((v >> 32) == 0) & m
    slot = tl.where(hit, v, -1)
    tl.store(hit_ptr + offs, hit.to(tl.int8), mask=m)
    tl.store(slot_ptr + offs, slot, mask=m)
    # Touch = write the bucket label (round stamp); entries are unique, so no races.
    tl.store(stamps_ptr + tl.where(hit, v, 0), tl.full([BLOCK], 0, tl.int64) + stamp, mask=hit)


@triton.jit
def _move_bits_kernel(words_ptr, counts_ptr, slots_ptr, old_ptr, new_ptr, n, W,
                      BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    s = tl.load(slots_ptr + offs, mask=m, other=0)
    o = tl.load(old_ptr + offs, mask=m, other=0)
    nw = tl.load(new_ptr + offs, mask=m, other=0)
    word = s >> 6
    bit = tl.full([BLOCK], 1, tl.int64) << (s & 63)
    # Clear in the old row, then set in the new one (same thread: ordered even if equal);
    # atomics make concurrent updates of different bits of one word safe.
    tl.atomic_and(words_ptr + o * W + word, ~bit, mask=m)
    tl.atomic_or(words_ptr + nw * W + word, bit, mask=m)
    one = tl.full([BLOCK], 1, tl.int64)
    tl.atomic_add(counts_ptr + o, -one, mask=m)
    tl.atomic_add(counts_ptr + nw, one, mask=m)


_BLOCK_W = 64
_BLOCK_N = 256


def popcount64(words: torch.Tensor) -> torch.Tensor:
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


def hit_touch(loc_vals: torch.Tensor, stamps: torch.Tensor, stamp: int):
    n = loc_vals.numel()
    hit = torch.empty(n, dtype=torch.int8, device=loc_vals.device)
    slots = torch.empty(n, dtype=torch.int64, device=loc_vals.device)
    if n:
        _hit_touch_kernel[(triton.cdiv(n, _BLOCK_N),)](
            loc_vals.contiguous(), n, stamps, stamp, hit, slots, BLOCK=_BLOCK_N)
    hit = hit.bool()
    return hit, slots, loc_vals.masked_select(hit)


def move_bits(words: torch.Tensor, counts: torch.Tensor, slots: torch.Tensor,
              old_row: torch.Tensor, new_row: torch.Tensor) -> None:
    n = slots.numel()
    if n:
        _move_bits_kernel[(triton.cdiv(n, _BLOCK_N),)](
            words, counts, slots.contiguous(), old_row.contiguous(), new_row.contiguous(), n,
            words.shape[1], BLOCK=_BLOCK_N)


assert SLOT_BITS == 32 and SLOT_MASK == 0xFFFFFFFF  # the kernels hard-code this layout
