"""PB-LRU as published: a ring of per-round bucket bitmaps plus one cold bucket.

``lru="pblru_bitmap"``. The default ``lru="pblru"`` (pblru.py) keeps the same rules (victims
never from the current round, oldest rounds first) with one round label per slot instead of
a bitmap per bucket, and ``lru="pblru_queue"`` on a position-ordered queue of touches; this
variant exists to measure those choices against the design they replace
(``benchmarks/pblru_vs_lru.py`` replays all three).

State: one ``HierBitmap`` with ``ring_size`` recent rows and a cold row; row ``round %
ring_size`` is the current bucket. All of it tensor ops:

* touch = build the word mask of the touched slots (one ``index_add_``), clear those bits in
  every row, set them in the current row (a slot sits in exactly one bucket);
* advance_round = the next ring row, which holds slots untouched for ``ring_size`` rounds, is
  folded into cold (an OR of rows: labels only, no slot moves);
* victim selection = first ``k`` members over rows cold, then recent rows oldest to newest,
  never the current one, top-down through the summary levels so empty segments are skipped;
  the victims are then cleared from their rows.

Order inside a bucket is slot order, not touch order, so the hit rate can differ from exact
LRU (the queue variant matches it exactly; the round labels keep every round apart, where
this folds rounds older than the ring into one cold bucket). Summary levels are rebuilt lazily,
once before each search.
"""

from __future__ import annotations

import torch

from ulacache_vllm.core.policy import EvictionPolicy
from ulacache_vllm.core.pools import CapacityError

from . import queue_kernels as QK


class BitmapPBLRU(EvictionPolicy):
    name = "pblru_bitmap"

    def __init__(self, num_slots: int, device: torch.device, ring_size: int = 8):
        if ring_size < 1:
            raise ValueError("ring_size must be >= 1")
        self.device = torch.device(device)
        self.num_slots = num_slots
        self.ring_size = R = ring_size
        self.cold = R
        self.bm = HierBitmap(R + 1, num_slots, self.device)
        self.round = 0
        # Search order per current row: cold, then the other recent rows oldest to newest.
        self._orders = [torch.tensor([R] + [(c + i) % R for i in range(1, R)], dtype=torch.int64,
                                     device=self.device) for c in range(R)]
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)

    @property
    def current(self) -> int:
        return self.round % self.ring_size

    def touch(self, slots):
        self.bm.move_to(self.current, slots)

    def release(self, slots):
        self.bm.remove(slots)

    def select_victims(self, k: int) -> torch.Tensor:
        if k <= 0:
            return self._empty
        vic = self.bm.first_k(self._orders[self.current], k)
        if vic.numel() < k:
            raise CapacityError(
                f"need {k} device victims but only {vic.numel()} slots are outside the current "
                "round (the round's working set exceeds the device pool)")
        self.bm.remove(vic)
        return vic

    def advance_round(self) -> None:
        self.round += 1
        self.bm.move_all(self.current, self.cold)

    def bucket_of(self) -> torch.Tensor:
        """Per slot: 1 = current round's bucket, 0 = an older bucket, -1 untracked (O(S), tests)."""
        S = self.num_slots
        rows = [QK.unpack_bits(self.bm.words[r])[:S] for r in range(self.ring_size + 1)]
        count = torch.stack(rows).to(torch.int64).sum(0)
        if bool((count > 1).any()):
            raise AssertionError("a slot is in two buckets")
        out = torch.full((S,), -1, dtype=torch.int64, device=self.device)
        out[count > 0] = 0
        out[rows[self.current]] = 1
        return out


class HierBitmap:
    """Packed multi-row bitmaps with summary levels (the buckets above).

    Row ``r`` is one set of slots. Level 0 holds one bit per slot; level ``i+1`` holds one bit
    per word of level ``i`` ("that word is non-zero"), so finding the first ``k`` members in a
    priority order of rows only touches non-empty segments. Rows are padded so that every
    level has whole words; the top level has at most 64 words per row. Summary levels are
    rebuilt lazily, once before the next search, however many updates came before it.
    """

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
        return QK.slots_to_words(slots, self.level_words[0])

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
        w = w.reshape(-1)
        return int(QK.impl(w).popcount64(w).sum().item())

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
        idx = QK.impl(top).expand_first_k(top, k)
        for lev in range(nlev - 2, -1, -1):
            # idx: flat bit positions at level lev+1 == flat word indices at level lev.
            wl = self.level_words[lev]
            row_pos, word = idx // wl, idx % wl
            words = self.levels[lev].view(-1).index_select(0, order.index_select(0, row_pos) * wl + word)
            pos = QK.impl(words).expand_first_k(words, k)
            # pos = i*64 + bit where i indexes ``words``; convert to flat bit index at lev.
            i, bit = pos >> 6, pos & 63
            idx = (row_pos.index_select(0, i) * wl + word.index_select(0, i)) * 64 + bit
        return idx % (self.level_words[0] * 64)
