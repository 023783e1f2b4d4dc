"""PB-LRU: parallel bucketed LRU over the device pool of one layer group.

Buckets are rows of one int64 bitmap ``words`` [rows, W] (one bit per slot) with a member
count per row:

* row 0: the cold bucket (oldest);
* rows ``1 .. R``: the ring of recent buckets, round ``t`` in row ``t % R + 1``;
* rows ``R+1 .. R+C``: age-ordered cold sub-buckets ("coarse" buckets), one per epoch of ``R``
  rounds, epoch ``e`` in row ``R + 1 + e % C``. Advancing the ring folds the bucket about to be
  reused into its epoch's coarse bucket; when a coarse bucket is reused it is folded into cold
  (labels only: a row OR, no data moves). So victims come out in age order at round
  granularity for ``R`` rounds and at epoch granularity for ``R * C`` more;
* the last row: untracked slots (free / released), never a victim source.

Victims: cold, then coarse oldest to newest, then ring oldest to newest, never the current
bucket (free slots are taken before the policy is asked); within a bucket, slot order.

Touch is one scatter: ``stamp[slot] = round`` (the bucket label; hit detection + touch is one
kernel). The bitmaps follow the labels lazily: touched slots are queued and moved between rows
in one sparse batch (``move_bits``: only the touched words change) right before a victim
search, and folds are queued until then too. A round that needs no victims -- free slots
suffice, or pure hits -- costs the label scatter only (the fast path). The victim search reads
the row counts (the summary above the rows), then only the words of the rows it needs, only
their non-zero words, and expands bits of at most ``k`` words.
"""

from __future__ import annotations

import torch

from ulacache_vllm import kernels as K

from .policy import EvictionPolicy
from .pools import CapacityError

_NONE = 1 << 62  # label of untracked slots: "in the future", so their age clamps to 0


class PBLRU(EvictionPolicy):
    name = "pblru"

    def __init__(self, num_slots: int, device: torch.device, ring_size: int = 8,
                 cold_buckets: int = 8):
        if ring_size < 1:
            raise ValueError("ring_size must be >= 1")
        if cold_buckets < 0:
            raise ValueError("cold_buckets must be >= 0")
        self.ring_size, self.cold_buckets = ring_size, cold_buckets
        self.device = torch.device(device)
        self.num_slots = S = num_slots
        self.rows = 1 + ring_size + cold_buckets + 1
        self.none_row = self.rows - 1
        self.W = W = max(1, -(-S // 64))
        self.words = torch.zeros(self.rows, W, dtype=torch.int64, device=self.device)
        full = torch.arange(S, device=self.device)
        self.words[self.none_row].index_add_(0, full >> 6, K.reference.bit64(self.device).index_select(0, full & 63))
        self.counts = torch.zeros(self.rows, dtype=torch.int64, device=self.device)
        self.counts[self.none_row] = S
        self.stamp = torch.full((S,), _NONE, dtype=torch.int64, device=self.device)  # labels
        self.bstamp = self.stamp.clone()  # the label each slot's bit currently reflects
        self._claim = torch.zeros(S, dtype=torch.int64, device=self.device)
        self.round = 0
        self._queued: list[torch.Tensor] = []  # slots whose label may differ from their bit
        self._queued_n = 0
        self._folds: list[tuple[int, int]] = []
        self._build_lut()

    # ------------------------------------------------------------------ labels -> rows
    def _row_of_round(self, t: int) -> int:
        R, C, c = self.ring_size, self.cold_buckets, self.round
        f = c - R  # newest round already folded out of the ring
        if t > f:
            return t % R + 1
        if C and t // R > f // R - C:
            return R + 1 + (t // R) % C
        return 0

    def _build_lut(self) -> None:
        """Row per age: index ``round + 1 - label`` clamped to [0, L-1]; 0 = untracked."""
        R, C = self.ring_size, self.cold_buckets
        L = R * (C + 2) + 2
        c = self.round
        lut = [self.none_row] + [self._row_of_round(c - a) if c - a >= 0 else 0
                                 for a in range(L - 1)]
        lut[-1] = 0  # anything older is cold
        self._L = L
        self._lut = torch.tensor(lut, dtype=torch.int64, device=self.device)
        f = c - R
        coarse = [R + 1 + (e % C) for e in range(f // R - C + 1, f // R + 1)] if C else []
        ring = [t % R + 1 for t in range(f + 1, c)]
        self.order = [0] + coarse + ring  # victim priority, never the current row
        self._lut_round = c

    def _rows(self, labels: torch.Tensor) -> torch.Tensor:
        age = torch.rsub(labels, self.round + 1).clamp_(0, self._L - 1)
        return self._lut.index_select(0, age)

    # ------------------------------------------------------------------ lazy upkeep
    def _fold(self, src: int, dst: int) -> None:
        w, c = self.words, self.counts
        w[dst] |= w[src]
        w[src].zero_()
        c[dst] += c[src]
        c[src] = 0

    def _sync(self) -> None:
        """Apply queued folds, then move queued slots to the rows of their labels."""
        if self._folds:
            for src, dst in self._folds:
                self._fold(src, dst)
            self._folds.clear()
        if self._lut_round != self.round:
            self._build_lut()
        if not self._queued:
            return
        q = self._queued
        P = q[0] if len(q) == 1 else torch.cat(q)
        self._queued, self._queued_n = [], 0
        if len(q) > 1:  # dedup in O(n): one claim per slot (slots within one call are unique)
            pos = torch.arange(P.numel(), device=self.device)
            self._claim.index_copy_(0, P, pos)
            P = P.masked_select(self._claim.index_select(0, P) == pos)
        new = self.stamp.index_select(0, P)
        old = self.bstamp.index_select(0, P)
        K.move_bits(self.words, self.counts, P, self._rows(old), self._rows(new))
        self.bstamp.index_copy_(0, P, new)

    def _queue(self, slots: torch.Tensor) -> None:
        self._queued.append(slots)
        self._queued_n += slots.numel()
        if self._queued_n > 4 * self.num_slots:  # bound the queue when no search comes
            self._sync()

    # ------------------------------------------------------------------ policy API
    def hit_touch(self, loc_vals):
        hit, slots, hs = K.hit_touch(loc_vals, self.stamp, self.round)
        if hs.numel():
            self._queue(hs)
        return hit, slots

    def touch(self, slots):
        if slots.numel():
            self.stamp.index_fill_(0, slots, self.round)
            self._queue(slots)

    def release(self, slots):
        if slots.numel():
            self.stamp.index_fill_(0, slots, _NONE)
            self._queue(slots)

    def select_victims(self, k: int) -> torch.Tensor:
        if k <= 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        self._sync()
        cnt = self.counts.tolist()
        rows, got = [], 0
        for r in self.order:
            if cnt[r]:
                rows.append(r)
                got += cnt[r]
                if got >= k:
                    break
        if got < k:
            raise CapacityError(
                f"need {k} device victims but only {got} slots are outside the current "
                "round (the round's working set exceeds the device pool)")
        W = self.W
        if len(rows) == 1:
            w = self.words[rows[0]]
        else:
            w = self.words.index_select(0, torch.tensor(rows, device=self.device)).reshape(-1)
        nz = (w != 0).nonzero().squeeze(1)  # the summary: non-zero words, in priority order
        if nz.numel() > k:
            nz = nz[:k]  # every non-zero word holds >= 1 member
        pos = K.expand_first_k(w.index_select(0, nz), k)
        victims = nz.index_select(0, pos >> 6).remainder_(W).mul_(64).add_(pos & 63)
        # Victims become untracked at once; their bits move on the next sync.
        self.stamp.index_fill_(0, victims, _NONE)
        self._queue(victims)
        return victims

    def advance_round(self) -> None:
        R, C = self.ring_size, self.cold_buckets
        f = self.round + 1 - R  # the round whose bucket the new current round reuses
        if f >= 0:
            src = f % R + 1
            if C:
                e = f // R
                dst = R + 1 + e % C
                if f % R == 0 and e >= C:
                    self._folds.append((dst, 0))  # reuse epoch e-C's coarse bucket
                self._folds.append((src, dst))
            else:
                self._folds.append((src, 0))
        self.round += 1

    # ------------------------------------------------------------------ introspection
    def bucket_of(self) -> torch.Tensor:
        """Row id per slot (-1 if untracked); O(S), tests only. Checks labels == bitmaps."""
        self._sync()
        S = self.num_slots
        shifts = torch.arange(64, device=self.device, dtype=torch.int64)
        bits = ((self.words[:, :, None] >> shifts) & 1).reshape(self.rows, -1)[:, :S]
        if (bits.sum(0) != 1).any():
            raise AssertionError("slot not in exactly one bucket row")
        if not torch.equal(bits.sum(1), self.counts):
            raise AssertionError("row counts disagree with the bitmaps")
        row = bits.argmax(0)
        if not torch.equal(row, self._rows(self.stamp)):
            raise AssertionError("bitmaps disagree with the labels")
        return torch.where(row == self.none_row, torch.full_like(row, -1), row)

    def current_row(self) -> int:
        return self.round % self.ring_size + 1
