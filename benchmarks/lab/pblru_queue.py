"""PB-LRU on a position-ordered queue of touches (``lru="pblru_queue"``): exact LRU order.

``qslot`` is a ring of touched slots in time order, cut into per-round buckets by position
(the current round is ``[cur_start, tail)``); ``qpos[slot]`` is the ring index of the slot's
latest entry, so an entry is live iff ``qpos[slot] == its index`` and stale entries need no
removal. Invariants: ``tail - head <= capacity`` (no live entry is overwritten); victims are
taken from the head, oldest touch first, never past ``cur_start`` (never the current round);
the stash holds the oldest live entries and is taken first. Per-step work is a constant
handful of tensor ops plus work proportional to the entries touched; a ring 3/4 full is
compacted incrementally. Small pools get the exact timestamp scan instead
(``policies.make_policy``). The default PB-LRU (``pblru.py``) replaced this one; detail and
measurements: ``benchmarks/results/pblru_designs.md``.
"""

from __future__ import annotations

import torch

from ulacache_vllm import kernels as K
from ulacache_vllm.core.policy import EvictionPolicy
from ulacache_vllm.core.pools import CapacityError

from . import queue_kernels

# The queue, its positions and ``qpos`` are int32: ring indices are below ``cap`` (< 2^31), and
# half-width entries halve the bytes the stale filter and the touches move (the filter's
# random ``qpos`` reads then stay in cache far more often): 12-20 % less policy time per step
# at batch 32-128 than int64 in an A/B replay. Slots leave the policy as int64.
IDX = torch.int32
UNTRACKED = torch.iinfo(IDX).max  # qpos of a slot with no live entry
# Pools up to this many slots run the exact timestamp scan instead (the small-pool fast path:
# a whole-pool top-k is then one op of a few microseconds, cheaper than a queue window's
# handful. On CPU, batch 1, the two are even near 7k slots with 40-80 % top-k overlap, but with
# 60-95 % overlap the queue -- whose cost follows the touches, not the pool -- was 0.81-0.97x
# at ~10k slots: a 16k threshold keeps batch-1 pools on the scan).
SMALL_POOL_SLOTS = 16384


def default_queue_capacity(num_slots: int) -> int:
    """``8 S + 4096`` entries, capped below int32's end for pools of 2^28 slots and more (the
    ring needs at least ``2 S``: pools of 2^30 slots or more do not fit int32 positions)."""
    return min(8 * num_slots + 4096, max(2 * num_slots, UNTRACKED - 1))


_MIN_LIVE = 1.0 / 64  # floor of the live-fraction estimate used to size the scan window
# Scan windows: at least _MIN_WINDOW entries (a wider window costs far less than another
# round of ~7 ops), else the victims still needed / the estimated live fraction * _OVERSCAN.
_MIN_WINDOW = 1024
_OVERSCAN = 1.1
_PASS_MIN = 4096  # entries a compaction pass advances at least per push


class QueuePBLRU(EvictionPolicy):
    name = "pblru_queue"

    def __init__(self, num_slots: int, device: torch.device, ring_size: int = 8,
                 cold_buckets: int = 8, queue_capacity: int | None = None):
        if ring_size < 1:
            raise ValueError("ring_size must be >= 1")
        if cold_buckets < 0:
            raise ValueError("cold_buckets must be >= 0")
        self.ring_size, self.cold_buckets = ring_size, cold_buckets
        self.device = torch.device(device)
        self.num_slots = S = num_slots
        # Live entries never exceed S and one push adds at most S, so 2 S always fits after a
        # compaction; a larger ring keeps compactions (O(queue)) to pools that evict little.
        self.cap = Q = default_queue_capacity(S) if queue_capacity is None else queue_capacity
        if Q < 2 * S:
            raise ValueError("queue_capacity must be >= 2 * num_slots")
        if Q >= UNTRACKED:
            raise ValueError(f"queue_capacity must be < 2^31 (int32 ring indices), got {Q}"
                             + ("" if queue_capacity is not None else
                                f": a queue PB-LRU holds at most 2^30 - 1 slots, got {S}"))
        # Slot S is a dummy that is never tracked: it pads the queue's end when a push wraps.
        self.qslot = torch.zeros(Q, dtype=IDX, device=self.device)
        self.qpos = torch.full((S + 1 if Q else 0,), UNTRACKED, dtype=IDX, device=self.device)
        self.iota = torch.arange(Q, dtype=IDX, device=self.device)  # positions
        # head <= cur_start <= tail are absolute (ever-growing) positions; the queue is a ring,
        # position p lives at index p % cap, and qpos holds those indices. Entries before head
        # are consumed or stale; tail - head <= cap, so no live entry is ever overwritten.
        self.head = 0
        self.cur_start = 0   # first position of the current round's bucket
        self.tail = 0
        self.round = 0
        self.compactions = 0  # counters, for tests and benchmarks
        self.wraps = 0
        self.passes = 0       # incremental compaction passes finished
        # An incremental compaction pass over the older rounds, ``[cc, ps, end]`` (absolute
        # positions): ``[head, cc)`` not yet processed, ``[cc, ps)`` dead (every entry stale),
        # ``[ps, end)`` the live entries of the processed part, packed, in order.
        self._pass = None
        self.pass_budget_min = _PASS_MIN
        self._live = 0.5     # estimated live fraction at the head (window sizing)
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        # Live entries a victim window found beyond the ones it needed, the oldest live entries
        # of all: (slots, queue indices, the absolute position of the first). They are
        # taken first by the next selection, after a stale filter (re-touched or released ones
        # drop out), instead of rescanning their window.
        self._stash = None
        self._k = queue_kernels.impl(self.qpos)  # Triton on CUDA, the torch reference on CPU

    victim_path = "queue"  # (a small pool gets the scan instead: policies.make_policy)

    # ------------------------------------------------------------------ queue upkeep
    def _lo(self) -> int:
        """The oldest position still in use (the stash's first, else the head)."""
        return self.head if self._stash is None else self._stash[2]

    def _room(self, n: int) -> int:
        """Make room for ``n`` entries at the tail without splitting them across the ring's end;
        returns the index of the tail. Wrapping pads the ring's end with the dummy slot (stale
        entries, skipped by the filter). A ring 3/4 full (a large pool that evicts little, so
        stale entries pile up behind the head) is compacted incrementally: each push advances
        a pass by 4x its own size (a pass covers at most 3/4 of the ring, so it ends after at
        most 3/16 of a ring of pushes, before the ring is full) and no single step pays an
        O(ring) compaction. Only a ring that fills anyway is compacted at once."""
        if self._pass is None and self.tail + n - self._lo() > self.cap * 3 // 4 \
                and self.cur_start > self.head:
            self._pass = [self.cur_start] * 3
        if self._pass is not None:
            self._pass_step(max(4 * n, self.pass_budget_min))
        t = self.tail % self.cap
        pad = self.cap - t if t + n > self.cap else 0
        lo = self._lo()
        if self.tail + pad + n - lo > self.cap:
            self._compact()
            return self.tail
        if pad:
            self.qslot[t:].fill_(self.num_slots)
            self.tail += pad
            self.wraps += 1
            t = 0
        return t

    def _push(self, slots: torch.Tensor, n: int) -> None:
        t = self._room(n)
        self._k.queue_push(slots, self.qslot, self.qpos, t, self.iota[t:t + n])
        self.tail += n

    def _spans(self, a: int, b: int):
        """Index ranges of the absolute positions ``[a, b)``: one, or two across the ring's end."""
        if b <= a:
            return []
        i, j = a % self.cap, (b - 1) % self.cap + 1
        return [(i, j)] if i < j else [(i, self.cap), (0, j)]

    def _live_in(self, a: int, b: int) -> list:
        qs, qp, io = self.qslot, self.qpos, self.iota
        return [self._k.queue_take(qs[i:j], io[i:j], qp, j - i)[0] for i, j in self._spans(a, b)]

    def _stash_live(self) -> torch.Tensor:
        """The stash's entries still live (not re-touched, released or evicted), in order."""
        st = self._stash
        return self._k.queue_take(st[0], st[1], self.qpos, st[0].numel())[0]

    def _pass_step(self, budget: int) -> None:
        """Advance the compaction pass by about ``budget`` entries, from its cursor towards the
        head: each window's live entries move, in order, to just before the packed part (their
        old entries turn stale by the ``qpos`` rule). When the cursor meets the head, the head
        jumps to the packed part and the positions before it are free."""
        cc, ps, _ = self._pass
        cap = self.cap
        while budget > 0 and cc > self.head:
            j = (cc - 1) % cap + 1  # one past the window's last ring index
            m = min(budget, cc - self.head, j)  # a window never crosses the ring's end
            i = j - m
            live = self._k.queue_take(self.qslot[i:j], self.iota[i:j], self.qpos, m)[0]
            g = live.numel()
            if g and not (g == m and ps == cc):  # (all live, nothing dead after: in place)
                off = 0
                for a, b in self._spans(ps - g, ps):
                    self._k.queue_push(live[off:off + b - a].long(), self.qslot, self.qpos, a,
                                       self.iota[a:b])
                    off += b - a
            cc, ps, budget = cc - m, ps - g, budget - m
        if cc <= self.head:
            self.head, self._pass = ps, None
            self.passes += 1
        else:
            self._pass[:2] = cc, ps

    def _compact(self) -> None:
        """Move the live entries to the front of the queue, keeping their order."""
        past = self._live_in(self.head, self.cur_start)
        if self._stash is not None:
            past.insert(0, self._stash_live())
            self._stash = None
        n_past = sum(x.numel() for x in past)
        live = torch.cat(past + self._live_in(self.cur_start, self.tail))
        n = live.numel()
        self._k.queue_push(live.long(), self.qslot, self.qpos, 0, self.iota[:n])
        self.head, self.cur_start, self.tail = 0, n_past, n
        self._pass = None  # (its dead stretch held only stale entries: the scan skipped them)
        self.compactions += 1

    # ------------------------------------------------------------------ policy API
    def hit_touch(self, loc_vals):
        bound = min(loc_vals.numel(), self.num_slots)  # hits are distinct device slots
        t = self._room(bound)
        hit, hs = self._k.hit_touch_push(loc_vals, self.qslot, self.qpos, t, self.iota)
        self.tail += hs.numel()
        return hit

    def touch(self, slots):
        n = slots.numel()
        if n:
            self._push(slots, n)

    def release(self, slots):
        if slots.numel():
            K.reference.fill_at(self.qpos, slots, UNTRACKED)

    def select_victims(self, k: int) -> torch.Tensor:
        if k <= 0:
            return self._empty
        qp = self.qpos
        parts, need = [], k
        stash, new_stash = self._stash, None
        if stash is not None:  # the oldest live entries: they go first
            live = self._stash_live()
            g = live.numel()
            parts.append(live[:need])
            if g > need:
                rest = live[need:]
                rpos = qp.index_select(0, rest)
                # The first stashed position, exactly: a stale lower bound would make the
                # ring look fuller than it is and compact early.
                new_stash = (rest, rpos, stash[2] + (int(rpos[0]) - stash[2]) % self.cap)
            need = max(0, need - g)
        h, end = self.head, self.cur_start
        while need:
            if self._pass is not None and h >= self._pass[0]:
                h, self._pass = self._pass[1], None  # skip the dead stretch: the pass is over
                self.passes += 1
            avail = end - h
            if avail <= 0:
                got = k - need
                raise CapacityError(
                    f"need {k} device victims but only {got} slots are outside the current "
                    "round (the round's working set exceeds the device pool)")
            m = max(_MIN_WINDOW, int(need / self._live * _OVERSCAN) + 64)
            if 2 * m >= avail:  # a short remainder would cost another round of ops
                m = avail
            i = h % self.cap
            m = min(m, self.cap - i)  # a window never crosses the ring's end
            if self._pass is not None:
                m = min(m, self._pass[0] - h)  # ... nor the pass's cursor
            live, _, g = self._k.queue_take(self.qslot[i:i + m], self.iota[i:i + m], qp, m)
            # Up at once, down at most 1.2x per window: a dead stretch (e.g. a finished
            # request's entries) must not size the next windows for it. Too small a window
            # costs another window (~6 ops); too large reads dead entries (with a 4x limit,
            # 2-3x oversized windows after dead stretches cost 10-15 % of the selection time
            # at 25 % pools, batch 32-128).
            self._live = max(_MIN_LIVE, g / m, self._live / 1.2)
            parts.append(live[:need])
            if g <= need:
                need -= g
                h += m
                continue
            # Stash up to a selection's worth of the live entries beyond those needed; the head
            # passes the window, or stops after the last one stashed.
            keep = min(g - need, max(need, _MIN_WINDOW))
            rest = live[need:need + keep]
            rpos = qp.index_select(0, rest)
            new_stash = (rest, rpos, h + int(rpos[0]) - i)
            h += m if need + keep == g else int(rpos[-1]) - i + 1
            need = 0
        vic = (parts[0] if len(parts) == 1 else torch.cat(parts)).long()
        K.reference.fill_at(qp, vic, UNTRACKED)  # untracked until touched again
        self.head, self._stash = h, new_stash
        return vic

    def advance_round(self) -> None:
        self.cur_start = self.tail
        self.round += 1

    # ------------------------------------------------------------------ introspection
    def bucket_of(self) -> torch.Tensor:
        """Per slot: 1 = current round's bucket, 0 = an older bucket, -1 untracked.

        O(S), tests only; checks the queue invariants on the way.
        """
        qp = self.qpos[:self.num_slots]
        tracked = qp != UNTRACKED
        pos = qp.masked_select(tracked)
        sl = tracked.nonzero().squeeze(1)
        if not self.head <= self.cur_start <= self.tail <= self.head + self.cap:
            raise AssertionError("queue bounds out of order")
        if self._pass is not None:
            cc, ps, pend = self._pass
            if not self.head <= cc <= ps <= pend <= self.cur_start:
                raise AssertionError(f"compaction pass out of order: {self._pass}")
            dead = torch.cat([self.iota[i:j] for i, j in self._spans(cc, ps)] or [self.iota[:0]])
            if dead.numel() and bool((self.qpos.index_select(0, self.qslot.index_select(0, dead).long())
                                      == dead).any()):
                raise AssertionError("a live entry in the compaction pass's dead stretch")
        if int(self.qpos[self.num_slots]) != UNTRACKED:
            raise AssertionError("the dummy slot is tracked")
        rel = (pos - self.head % self.cap) % self.cap  # distance from the head
        stashed = torch.zeros_like(tracked)
        if self._stash is not None:  # live stash entries lie before the head
            st = self._stash
            stashed[self._stash_live()] = True
            if not (st[2] <= self.head and self.tail - st[2] <= self.cap
                    and st[2] % self.cap == int(st[1][0])):
                raise AssertionError("stash position out of the ring")
        if pos.numel():
            if bool((rel >= self.tail - self.head).logical_and_(~stashed.masked_select(tracked)).any()):
                raise AssertionError("live entry outside [head, tail) and the stash")
            if not torch.equal(self.qslot.index_select(0, pos).long(), sl):
                raise AssertionError("qpos and the queue disagree")
        out = torch.full_like(qp, -1, dtype=torch.int64)
        cur = (rel >= self.cur_start - self.head) & (rel < self.tail - self.head)
        out.masked_scatter_(tracked, cur.to(torch.int64))
        return out
