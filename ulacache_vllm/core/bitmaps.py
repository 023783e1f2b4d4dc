"""Packed multi-row bitmaps with summary levels: the buckets of the bitmap PB-LRU
(`benchmarks/lab/pblru_bitmap.py`) and the derived free-set view of a slot pool (`SlotPool.free_bits`;
allocation itself uses a free stack, see pools.py).

Row ``r`` is one set of slots (a bucket, or a free list). Level 0 holds one bit per slot; level
``i+1`` holds one bit per word of level ``i`` ("that word is non-zero"), so finding the first
``k`` members in a priority order of rows only touches non-empty segments. Rows are padded so
that every level has whole words; the top level has at most 64 words per row. Summary levels
are rebuilt lazily, once before the next search, however many updates came before it.
"""

from __future__ import annotations

import torch

from ulacache_vllm import kernels as K


class HierBitmap:
    def __init__(self, rows: int, num_slots: int, device: torch.device):
        self.rows = rows
        self.num_slots = num_slots
        words = max(1, -(-num_slots // 64))
        # Choose the number of summary levels so the top level has <= 64 words per row.
        nlev = 1
        while -(-words // 64 ** (nlev - 1)) > 64:
            nlev += 1
        top = -(-words // 64 ** (nlev - 1))
        self.level_words = [top * 64 ** (nlev - 1 - i) for i in range(nlev)]  # level 0 first
        self.levels = [torch.zeros(rows, w, dtype=torch.int64, device=device)
                       for w in self.level_words]
        self.device = device
        self._dirty = False

    @property
    def words(self) -> torch.Tensor:
        """Level-0 words, shape [rows, W0]; mutate only through the methods below."""
        return self.levels[0]

    def rebuild_summaries(self) -> None:
        shifts = torch.arange(64, device=self.device, dtype=torch.int64)
        for i in range(1, len(self.levels)):
            below = self.levels[i - 1]
            nz = (below != 0).view(self.rows, -1, 64).to(torch.int64) << shifts
            # Distinct bits: the sum is their OR.
            self.levels[i] = nz.sum(-1)
        self._dirty = False

    def mask(self, slots: torch.Tensor) -> torch.Tensor:
        """Word mask [W0] of unique ``slots``."""
        return K.reference.slots_to_words(slots, self.level_words[0])

    def add(self, row: int, slots: torch.Tensor) -> None:
        """Add unique ``slots`` to ``row`` (caller guarantees they are in no other row)."""
        if slots.numel():
            self.levels[0][row] |= self.mask(slots)
            self._dirty = True

    def remove(self, slots: torch.Tensor) -> None:
        """Remove unique ``slots`` from whichever rows hold them."""
        if slots.numel():
            self.levels[0] &= ~self.mask(slots)
            self._dirty = True

    def move_to(self, row: int, slots: torch.Tensor) -> None:
        """Put unique ``slots`` in ``row`` only, taking them out of any other row."""
        if slots.numel():
            m = self.mask(slots)
            self.levels[0] &= ~m
            self.levels[0][row] |= m
            self._dirty = True

    def move_all(self, src: int, dst: int) -> None:
        """Fold row ``src`` into ``dst`` (labels only)."""
        for lev in self.levels:  # summaries stay valid: the OR of two rows' summaries
            lev[dst] |= lev[src]
            lev[src] = 0

    def count(self, row: int | None = None) -> int:
        w = self.levels[0] if row is None else self.levels[0][row]
        return int(K.popcount64(w.reshape(-1)).sum().item())

    def first_k(self, order: torch.Tensor, k: int) -> torch.Tensor:
        """First ``k`` slots over rows ``order`` (LongTensor of row ids), rows in that order.

        Top-down: at each level only words flagged non-zero by the level above are read, and
        at most ``k`` of them (each holds >= 1 member), so the work is O(k + top level).
        """
        if k <= 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if self._dirty:
            self.rebuild_summaries()
        nlev = len(self.levels)
        top = self.levels[-1].index_select(0, order).reshape(-1)
        # Flat word indices into the (order-permuted) level, row-major.
        idx = K.expand_first_k(top, k)
        for lev in range(nlev - 2, -1, -1):
            # idx: flat bit positions at level lev+1 == flat word indices at level lev.
            wl = self.level_words[lev]
            row_pos, word = idx // wl, idx % wl
            words = self.levels[lev].view(-1).index_select(0, order.index_select(0, row_pos) * wl + word)
            pos = K.expand_first_k(words, k)
            # pos = i*64 + bit where i indexes ``words``; convert to flat bit index at lev.
            i, bit = pos >> 6, pos & 63
            idx = (row_pos.index_select(0, i) * wl + word.index_select(0, i)) * 64 + bit
        return idx % (self.level_words[0] * 64)
