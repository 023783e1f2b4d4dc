"""TP shard mode's buffer of recently fetched remote rows (one per rank and layer group).

Rank ``r`` owns the entries ``t`` with ``t % P == r`` (`placement.TokenShard`, the one
implementation of that rule), yet attention on every rank reads every selected row, so rows
owned by other ranks are fetched; consecutive DSA top-k sets overlap heavily, so a buffer of
recently fetched rows turns most fetches into hits.

The contract matches `TieredMapping`'s: inside the forward only `slots_of` runs (one gather:
buffer slot or -1); a miss is fetched into staging for that step. Between steps, `settle`
touches the step's hits and inserts its fetched rows (free slots first, then eviction
victims, never one used in the current round; when a round's misses exceed what can be
evicted, only a prefix is kept and the rest is fetched again when read). `invalidate` runs
with every free on every rank, so a reused logical address is never served stale bytes.

Tables are int32 over the global address space (4 bytes per logical token per group).
With ``replicated=True`` the buffer is a directory every rank keeps identically: it tracks
every address, and since every rank makes the same calls (the same selections and frees),
every rank knows which addresses all others hold, so a step's misses need no request
exchange (the TP shard worker uses it this way).

Filling pays only when fetched rows are read again. ``note_read`` keeps a running average of
the share of reads the directory held; while it is below ``min_hit_rate``, `fill_due` says to
skip the settle (no touches, no inserts, no row copies) except every ``probe_every``-th step,
whose fill shows whether reuse came back. Skipping changes what is buffered, never what is
read: a skipped row is fetched again. Both calls see only rank-independent figures, so the
replicated directory stays identical on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .placement import TokenShard
from .policies import make_policy
from .pools import CapacityError, SlotPool


@dataclass
class RemoteBufferStats:
    lookups: int = 0       # unique remote addresses read (per settle)
    hits: int = 0          # ... already in the buffer
    inserted: int = 0      # fetched rows kept
    evicted: int = 0       # buffered rows dropped to make room
    invalidated: int = 0   # buffered rows dropped because their entry was freed
    skipped_fills: int = 0  # settles skipped while reads seldom hit (`fill_due`)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class RemoteRowBuffer:
    def __init__(self, num_logical: int, num_slots: int, *, rank: int, world_size: int,
                 device: torch.device | str = "cpu", lru="pblru", ring_size: int = 8,
                 replicated: bool = False, min_hit_rate: float = 0.0, probe_every: int = 16):
        if num_slots < 1:
            raise ValueError(f"a remote-row buffer needs at least one slot, got {num_slots}")
        if not 0.0 <= min_hit_rate <= 1.0:
            raise ValueError(f"min_hit_rate must be in [0, 1], got {min_hit_rate}")
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        self.min_hit_rate, self.probe_every = float(min_hit_rate), probe_every
        self.hit_rate = 1.0  # running average of note_read's shares: start by filling
        self._since_fill = 0
        self.shard = TokenShard(rank, world_size)  # ValueError for a rank outside the group
        self.device = torch.device(device)
        self.rank, self.world = rank, world_size
        # replicated: a directory every rank keeps identically (same calls in the same order
        # on every rank give the same slots), so it tracks every address whatever its owner;
        # a rank simply leaves the slots of its own addresses unused.
        self.replicated = replicated
        self.num_logical = num_logical
        # One entry past the space stays -1 forever: `slots_of` maps padding and addresses out
        # of range there (clamp + remainder) instead of masking before and after the gather.
        self.table = torch.full((num_logical + 1,), -1, dtype=torch.int32, device=self.device)
        # (unique remote addresses, buffered?) of the last `settle`, for callers' counters.
        self.last_lookup: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pool = SlotPool(num_slots, self.device)  # owner = the buffered address
        self.policy = (lru(num_slots, self.device, ring_size) if callable(lru)
                       else make_policy(lru, num_slots, self.device, ring_size))
        self.stats = RemoteBufferStats()

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    @property
    def used(self) -> int:
        return self.pool.num_used

    def _remote(self, a: torch.Tensor) -> torch.Tensor:
        ok = (a >= 0) & (a < self.num_logical)
        return ok if self.replicated else ok & ~self.shard.owned(a)

    def _unique_remote(self, addrs: torch.Tensor) -> torch.Tensor:
        a = torch.as_tensor(addrs, device=self.device).reshape(-1).long()
        if self.replicated:  # unique first (sorted), then drop what is out of range
            u = torch.unique(a)
            return u.masked_select((u >= 0) & (u < self.num_logical))
        return torch.unique(a.masked_select(self._remote(a)))

    def _lookup(self, a: torch.Tensor) -> torch.Tensor:
        """Table value (int32) of each address; -1 for padding and addresses out of range
        (they read the sentinel entry past the space)."""
        n = self.num_logical
        idx = a.reshape(-1).clamp(-1, n).remainder(n + 1)
        return self.table.index_select(0, idx).view(a.shape)

    def slots_of(self, addrs: torch.Tensor) -> torch.Tensor:
        """Buffer slot of each buffered remote entry, -1 elsewhere (any shape; the forward's
        one gather)."""
        a = addrs.long()
        v = self._lookup(a).long()
        if self.replicated:
            return v
        return v.masked_fill(self.shard.owned(a), -1)

    def settle(self, addrs: torch.Tensor, insertable: torch.Tensor | None = None):
        """Between steps: the remote entries a step read (``addrs``; duplicates, owned entries
        and padding are ignored). Buffered ones are touched; the others get slots (only those
        in ``insertable``, if given: e.g. the fetched ones not freed since). Returns (new
        addresses, their slots): copy their rows in, then they are buffered."""
        u = self._unique_remote(addrs)
        v = self.table.index_select(0, u).long()
        hit = v >= 0
        self.last_lookup = (u, hit)
        nhit = int(hit.sum())
        self.stats.lookups += u.numel()
        self.stats.hits += nhit
        if nhit:
            self.policy.touch(v.masked_select(hit))
        miss = u.masked_select(~hit) if nhit else u
        if insertable is not None:
            miss = miss.masked_select(torch.isin(miss, insertable.to(miss.device)))
        return self._insert(miss)

    def settle_read(self, addrs: torch.Tensor, fetched: torch.Tensor):
        """`settle` for the replicated directory when the caller kept the read's misses:
        ``fetched`` = the unique addresses the step read and did not find here (ascending),
        less those freed since. Only the hits are looked up again (one gather of the unique
        read addresses, one hit-touch); the misses take slots in ``fetched``'s order, as
        `settle` would give them. Returns (new addresses, their slots) like `settle`."""
        if not self.replicated:
            raise ValueError("settle_read needs the replicated directory (replicated=True)")
        u = torch.unique(addrs.reshape(-1))  # ascending; padding (-1) first, if any
        hit = self.policy.hit_touch(self._lookup(u).long())  # -1 (padding, freed, fetched)
        self.last_lookup = (u, hit)
        self.stats.lookups += u.numel() - int(u.numel() > 0 and bool(u[0] < 0))
        self.stats.hits += int(hit.sum())
        return self._insert(fetched)

    def _insert(self, miss: torch.Tensor):
        """Slots for the unique, unbuffered addresses ``miss``: free slots first, then eviction
        victims (none used this round); a prefix when not all fit."""
        n = miss.numel()
        f = min(n, self.pool.num_free)
        k = min(n - f, self.pool.num_used)
        victims = None
        while k:
            try:
                victims = self.policy.select_victims(k)
                break
            except CapacityError:  # the rest were used this round: keep only what fits
                k //= 2
        k = 0 if victims is None else victims.numel()
        keep = miss[:f + k]
        slots = self.pool.alloc(keep[:f])
        if k:
            old = self.pool.owner.index_select(0, victims)
            self.table.index_fill_(0, old, -1)
            self.pool.take(victims, keep[f:])
            slots = torch.cat([slots, victims])
            self.stats.evicted += k
        if keep.numel():
            self.table.index_copy_(0, keep, slots.to(torch.int32))
            self.policy.touch(slots)
        self.stats.inserted += keep.numel()
        return keep, slots

    def note_read(self, reads: int, hits: int) -> None:
        """A read of ``reads`` entries, ``hits`` of them held here: updates the running hit
        rate (halved weight per read). Pass figures every rank shares (for the replicated
        directory: all valid entries, own ones included)."""
        if reads > 0:
            self.hit_rate = 0.5 * self.hit_rate + 0.5 * (hits / reads)

    def fill_due(self) -> bool:
        """Whether this step's settle should run: while the running hit rate is at least
        ``min_hit_rate``, and on every ``probe_every``-th step after the last fill. A False
        counts a skipped fill; the caller then skips the settle."""
        self._since_fill += 1
        if self.hit_rate >= self.min_hit_rate or self._since_fill >= self.probe_every:
            self._since_fill = 0
            return True
        self.stats.skipped_fills += 1
        return False

    def invalidate(self, addrs) -> int:
        """Drop the buffered rows of freed entries; returns how many were buffered."""
        a = torch.as_tensor(addrs, device=self.device).reshape(-1).long()
        if a.numel() == 0:
            return 0
        held = self._lookup(a) >= 0
        if self.replicated:  # usually nothing is held (new rows): one lookup, no unique
            if not bool(held.any()):
                return 0
            u = torch.unique(a.masked_select(held))
        else:
            u = self._unique_remote(a)
        v = self.table.index_select(0, u).long()
        held = v >= 0
        slots = v.masked_select(held)
        if slots.numel():
            self.table.index_fill_(0, u.masked_select(held), -1)
            self.policy.release(slots)
            self.pool.release(slots)
        self.stats.invalidated += slots.numel()
        return slots.numel()

    def advance_round(self) -> None:
        """End of a step: rows read before it may be evicted again."""
        self.policy.advance_round()
