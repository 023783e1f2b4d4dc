"""Torch reference implementations of the ulacache kernels (CPU path and test oracle).

Bit layout shared with the Triton kernels: a bitmap is an int64 tensor, slot ``s`` is bit
``s & 63`` of word ``s >> 6``. Mapping-table values (internal, rank-less) are ``-1`` for
unmapped, else ``tier << 32 | slot`` (tier 0 device, 1 host, 2 pending).
"""

from __future__ import annotations

import torch

SLOT_BITS = 32
SLOT_MASK = (1 << SLOT_BITS) - 1
# Public packed location: tier << 48 | rank << 32 | slot (see core.mapping).
PUB_TIER_SHIFT = 48
PUB_RANK_SHIFT = 32
TIER_PENDING = 2
TIER_REMOTE = 3

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
    return _bit_lut(words.device).index_select(0, words.contiguous().view(torch.uint8).to(torch.int64)).reshape(-1)


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


def hit_touch(loc_vals: torch.Tensor, stamps: torch.Tensor, stamp: int):
    """Hit detection + PB-LRU touch. ``loc_vals`` are internal table values of unique entries.

    A device hit (tier 0; ``-1 >> 32`` is -1, so unmapped is no hit) gets ``stamps[slot] =
    stamp`` (its bucket label: the round of last use). Returns ``(hit_mask, slots,
    hit_slots)`` with ``slots`` = device slot or -1 and ``hit_slots`` the slots of the hits.
    """
    hit = (loc_vals >> SLOT_BITS) == 0
    slots = torch.where(hit, loc_vals, -1)
    hs = loc_vals.masked_select(hit)
    if hs.numel():
        stamps.index_fill_(0, hs, stamp)
    return hit, slots, hs


_BIT_CACHE: dict = {}


def bit64(device) -> torch.Tensor:
    """[64] int64: ``1 << i`` (bit 63 is the sign bit)."""
    b = _BIT_CACHE.get(device)
    if b is None:
        b = torch.ones(64, dtype=torch.int64, device=device) << torch.arange(64, device=device)
        _BIT_CACHE[device] = b
    return b


def move_bits(words: torch.Tensor, counts: torch.Tensor, slots: torch.Tensor,
              old_row: torch.Tensor, new_row: torch.Tensor) -> None:
    """Move unique ``slots`` from bitmap row ``old_row`` to ``new_row`` (per slot; may be equal).

    ``words`` [rows, W] int64 bitmaps, every slot's bit set in its old row; ``counts`` [rows]
    members per row. Sparse: only the touched words change. ``slots`` must be unique (distinct
    bits, so adding / subtracting them is OR / AND-NOT).
    """
    if slots.numel() == 0:
        return
    W = words.shape[1]
    wi = slots >> 6
    bit = bit64(slots.device).index_select(0, slots & 63)
    flat = words.view(-1)
    flat.index_add_(0, old_row * W + wi, bit, alpha=-1)
    flat.index_add_(0, new_row * W + wi, bit)
    one = torch.ones_like(slots)
    counts.index_add_(0, old_row, one, alpha=-1)
    counts.index_add_(0, new_row, one)


def translate(addrs: torch.Tensor, table: torch.Tensor, rank: int, world: int,
              pub_rank: int | None = None) -> torch.Tensor:
    """Logical address -> public packed location (``tier<<48 | rank<<32 | slot``), -1 for padding.

    Addresses owned by another rank (``a % world != rank``) give tier REMOTE with the owner rank.
    Pending (in-flight) entries give tier PENDING with slot 0. ``pub_rank`` (default ``rank``)
    is the rank written into local locations (DP ranks own everything but keep their id).
    """
    pub_rank = rank if pub_rank is None else pub_rank
    valid = addrs >= 0
    a = torch.where(valid, addrs, torch.zeros_like(addrs))
    owner = a % world
    local = valid & (owner == rank)
    v = table.index_select(0, torch.where(local, a // world, torch.zeros_like(a)))
    mine = (v >> SLOT_BITS << PUB_TIER_SHIFT) | (pub_rank << PUB_RANK_SHIFT) | (v & SLOT_MASK)
    mine = torch.where(v >= 0, mine, torch.full_like(v, -1))
    remote = (TIER_REMOTE << PUB_TIER_SHIFT) | (owner << PUB_RANK_SHIFT)
    out = torch.where(local, mine, remote)
    return torch.where(valid, out, torch.full_like(out, -1))
