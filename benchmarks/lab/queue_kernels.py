"""Kernels of the lab's queue and bitmap PB-LRUs (``pblru_queue.py``, ``pblru_bitmap.py``):
their torch references (the CPU path and the tests' oracle) and, through ``impl``, their Triton
twins (``queue_kernels_triton.py``) on CUDA, as ``ulacache_vllm.kernels`` dispatches.

Bit layout shared with the Triton kernels: a bitmap is an int64 tensor, slot ``s`` is bit
``s & 63`` of word ``s >> 6``. Table values (internal, rank-less) are ``-1`` for unmapped, else
``tier << 32 | slot`` (tier 0 device).
"""

from __future__ import annotations

import importlib
import sys

import torch
from ulacache_vllm.kernels import use_triton
from ulacache_vllm.kernels.reference import compact, split_hits


def impl(t: torch.Tensor):
    """The kernel module for tensors like ``t``: the Triton one, or this one (the reference)."""
    if use_triton(t):  # imported lazily: TRITON_INTERPRET is read at decoration time
        return importlib.import_module(f"{__package__}.queue_kernels_triton")
    return sys.modules[__name__]


_M1 = 0x5555555555555555
_M2 = 0x3333333333333333
_M4 = 0x0F0F0F0F0F0F0F0F
_H01 = 0x0101010101010101


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= (1 << 63) else x


def popcount64(words: torch.Tensor) -> torch.Tensor:
    """Per-word set-bit count (SWAR; torch has no int64 popcount)."""
    x = words
    # Logical shift emulation: arithmetic >> then mask off the sign-extended bits.
    x = x - ((x >> 1) & _signed(_M1))
    x = (x & _signed(_M2)) + ((x >> 2) & _signed(_M2))
    x = (x + (x >> 4)) & _signed(_M4)
    return (x * _signed(_H01)) >> 56 & 0xFF


_LUT_CACHE: dict = {}


def _bit_lut(device) -> torch.Tensor:
    """[256, 8] bool: bits of each byte value, LSB first (int64 broadcast shifts are slow on CPU)."""
    lut = _LUT_CACHE.get(device)
    if lut is None:
        lut = ((torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1).bool()
        _LUT_CACHE[device] = lut
    return lut


def unpack_bits(words: torch.Tensor) -> torch.Tensor:
    """int64 words [M] -> bool [M*64] (bit ``i*64 + b`` = bit b of word i; little-endian bytes)."""
    w = words.contiguous()
    if w.numel() and w.stride(-1) != 1:  # a 1-element strided view counts as contiguous
        w = w.clone(memory_format=torch.contiguous_format)
    return _bit_lut(words.device).index_select(0, w.view(torch.uint8).to(torch.int64)).reshape(-1)


def expand_first_k(words: torch.Tensor, k: int) -> torch.Tensor:
    """Positions ``i*64 + bit`` of the first ``k`` set bits of ``words`` (word order, then bit order).

    Returns fewer than ``k`` positions when fewer bits are set.
    """
    if k <= 0 or words.numel() == 0:
        return words.new_empty(0)
    if words.numel() > 256:
        # Only expand the words needed to reach k bits: O(k) on dense bitmaps.
        cum = torch.cumsum(popcount64(words), 0)
        need = int(torch.searchsorted(cum, torch.tensor([k], device=words.device)).item()) + 1
        words = words[: min(need, words.numel())]
    return unpack_bits(words).nonzero().squeeze(1)[:k]


def slots_to_words(slots: torch.Tensor, num_words: int) -> torch.Tensor:
    """Dense word mask with the bits of ``slots`` set. ``slots`` must be unique (sum == OR)."""
    mask = torch.zeros(num_words, dtype=torch.int64, device=slots.device)
    mask.index_add_(0, slots >> 6, torch.ones_like(slots) << (slots & 63))
    return mask


def queue_push(slots: torch.Tensor, qslot: torch.Tensor, qpos: torch.Tensor, start: int,
               pos: torch.Tensor | None = None) -> None:
    """PB-LRU touch: append unique ``slots`` to the queue at positions ``start, start+1, ...``.

    ``qslot[start + i] = slots[i]`` and ``qpos[slots[i]] = start + i``: the new entries become
    the slots' live entries, every older entry of those slots turns stale. ``pos`` may pass
    those positions precomputed (a view of an arange), saving an op.
    """
    n = slots.numel()
    if n:
        if pos is None:
            pos = torch.arange(start, start + n, dtype=qpos.dtype, device=slots.device)
        elif pos.dtype != qpos.dtype:
            pos = pos.to(qpos.dtype)
        qslot[start:start + n] = slots  # casts int64 slots into PB-LRU's int32 queue
        # scatter_ with a tensor source: ~2.5x faster than index_copy_ / index_fill_ on CPU
        # at 10^4 indices (same semantics for unique indices).
        qpos.scatter_(0, slots, pos)


def hit_touch_push(loc_vals: torch.Tensor, qslot: torch.Tensor, qpos: torch.Tensor, start: int,
                   iota: torch.Tensor):
    """PB-LRU hit detection + touch: the hits among internal table values of unique entries
    are appended to the queue at ``start, start+1, ...`` in input order (``queue_push``).

    ``iota`` is a cached ``arange`` at least as long as the queue. Returns
    ``(hit_mask, hit_slots)``.
    """
    hit, hs = split_hits(loc_vals)
    n = hs.numel()
    if n:
        queue_push(hs, qslot, qpos, start, iota[start:start + n])
    return hit, hs


def queue_take(wslots: torch.Tensor, wpos: torch.Tensor, qpos: torch.Tensor, k: int):
    """Stale filter + first ``k`` over a queue window.

    ``wslots`` are the window's slots, ``wpos`` their queue positions; an entry is live iff
    ``qpos[slot] == position``. Returns ``(live_slots, used, n_live)``: the first
    ``min(k, n_live)`` live slots in window order; ``used``, a count of leading window entries
    that are all stale or returned (a safe head advance: the whole window when it holds at
    most ``k`` live entries, else through the ``k``-th live one -- or 0 on CPU when the window
    is small, where rescanning is cheaper than locating it); ``n_live`` the window's live count.
    """
    m = wslots.numel()
    if k <= 0 or m == 0:
        return wslots.new_empty(0), 0, 0
    valid = qpos.index_select(0, wslots) == wpos
    live = compact(wslots, valid)
    g = live.numel()
    if g <= k:
        return live, m, g
    if m <= _EXACT_USED_MIN:
        return live[:k], 0, g
    # The k-th live entry's position is its slot's qpos: O(1), no second pass over the mask.
    kth = int(qpos.index_select(0, live[k - 1:k])) - int(wpos[0])
    return live[:k], kth + 1, g


_EXACT_USED_MIN = 2048


