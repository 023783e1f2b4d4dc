"""PB-LRU: parallel bucketed LRU over the device pool of one layer group (the default policy).

Representation (a choice against the design doc's per-bucket bitmaps; see below):

* ``qslot`` -- one preallocated append-only queue of touched slots (int64, capacity ``~8 S``).
  Every touch appends its slots at the tail, so the queue is ordered by time of touch. The
  queue is cut into per-round *buckets* by position: the current round's bucket is
  ``[cur_start, tail)``, older rounds lie before it, oldest first. The ring of recent buckets
  and the cold bucket are just position ranges: folding a bucket into cold costs nothing.
* ``qpos[slot]`` -- the queue position of the slot's latest entry (``UNTRACKED`` = int64 max:
  free, released or just evicted). An entry ``(position p, slot s)`` is *live* iff ``qpos[s] == p``;
  older entries of a re-touched slot, released slots and consumed victims become stale by
  that rule alone, with no removal.

Per-step cost is a constant handful of tensor ops, independent of the pool size (small pools
take a timestamp scan instead, see the end):

* touch (hit, promotion, new entry) = ``queue_push``: one slice write of the slots at the tail
  plus one ``scatter_`` of their positions into ``qpos`` (a Triton kernel on CUDA);
* release / eviction = one ``scatter_`` (``index_fill_`` under 1024 slots) of ``UNTRACKED``
  into ``qpos``;
* advance_round = move ``cur_start`` to the tail (no tensor op);
* victim selection = ``queue_take`` over a window at the queue head, never past ``cur_start``
  (never the current round): gather ``qpos`` of the window's slots, compare with the window
  positions (the stale filter), keep the first ``k`` live ones (oldest first). The window is
  sized from the observed live fraction (at least ``_MIN_WINDOW`` entries, and the whole rest
  of ``[head, cur_start)`` when under twice that: one wider scan is cheaper than another round
  of ops), so the work is proportional to the victims needed, not to the pool; the head then
  skips everything consumed, so each stale entry is read about once (small windows that hold
  more live entries than needed may leave the head in place: a rescan of < 2048 entries is
  cheaper than the ops locating the k-th live one; in large windows its position is read off
  ``qpos`` of the k-th live slot). The window views are reused while ``(head, size)`` holds.
  Fixed cost per call (CPU, batch 1): select 5-7 ops (2 window slices unless cached,
  gather, compare, compact, first-k slice, untrack fill), touch 3 ops (positions slice, queue
  write, ``qpos`` scatter), hit_touch = ``hit_touch_push``: hit detection and the touch of
  the hits in one kernel call (CPU: 3 shared hit-detection ops + a touch; CUDA: a flag
  kernel, a prefix sum and one scatter kernel, no boolean compaction).
  Free slots are taken from the pool's free stack before the policy is asked; a round whose
  misses fit in the free slots never calls the selection at all (the fast path when little
  replacement is needed).
* the queue is compacted (live entries moved to the front, in order) when the tail reaches the
  capacity: O(queue) but at most once per ~7 S appended entries, i.e. amortised O(1) per touch.

Victim order is exact LRU at touch granularity (oldest touch first, within one touch call in
slot order: the order of ``ListLRU``), so hit rates match the exact LRU up to tie-breaking.
The published design keeps one bitmap per bucket with summary levels; it is implemented as
``lru="pblru_bitmap"`` (pblru_bitmap.py) and replayed beside this one by
``benchmarks/pblru_vs_lru.py``. Bitmaps pay a per-touch bit move (clear in every row, set in
the current one) and a multi-level expansion per search, and order slots by index inside a
bucket; the stale filter over a position-ordered queue finds the oldest live members with one
gather/compare/compact and skips dead segments by advancing the head. Measured on CPU (full
sweep), the queue is up to 4x faster than the bitmaps (most at small batches; about even at
batch 256 with the smallest pools) and matches exact LRU's hit rate exactly, where the bitmaps
differ by up to 2.1 pp (cold bucket in slot order). ``ring_size`` / ``cold_buckets`` are
accepted for interface compatibility; they do not change the victim order.

Small pools (``<= SMALL_POOL_SLOTS``, env ``ULACACHE_PBLRU_SMALL_POOL_SLOTS``): the queue's
fixed handful of ops per selection costs more than one top-k over the whole pool, so such a
pool runs the exact timestamp scan instead (same victims; ``victim_path`` says which). This
is the batch-1 fast path the published PB-LRU lacks.
"""

from __future__ import annotations

import os

import torch

from ulacache_vllm import kernels as K

from .exact_lru import TimestampLRU
from .policy import EvictionPolicy
from .pools import CapacityError

UNTRACKED = torch.iinfo(torch.int64).max
# Pools up to this many slots run the exact timestamp scan instead (the small-pool fast path:
# a whole-pool top-k is then one op of a few microseconds, cheaper than a queue window's
# handful; on CPU the queue already wins from ~6k slots in the benchmark's traces).
SMALL_POOL_SLOTS = int(os.environ.get("ULACACHE_PBLRU_SMALL_POOL_SLOTS", "4096"))
_MIN_LIVE = 1.0 / 64  # floor of the live-fraction estimate used to size the scan window
# Scan windows: at least _MIN_WINDOW entries (a wider window costs far less than another
# round of ~7 ops), else the victims still needed / the estimated live fraction * _OVERSCAN.
_MIN_WINDOW = 1024
_OVERSCAN = 1.1


class PBLRU(EvictionPolicy):
    name = "pblru"

    def __init__(self, num_slots: int, device: torch.device, ring_size: int = 8,
                 cold_buckets: int = 8, queue_capacity: int | None = None,
                 small_pool_slots: int | None = None):
        if ring_size < 1:
            raise ValueError("ring_size must be >= 1")
        if cold_buckets < 0:
            raise ValueError("cold_buckets must be >= 0")
        self.ring_size, self.cold_buckets = ring_size, cold_buckets
        self.device = torch.device(device)
        self.num_slots = S = num_slots
        # Live entries never exceed S and one push adds at most S, so 2 S always fits after a
        # compaction; more room makes compactions (O(queue)) rarer: one per >= 7 S pushes.
        self.cap = Q = 8 * S + 4096 if queue_capacity is None else queue_capacity
        if Q < 2 * S:
            raise ValueError("queue_capacity must be >= 2 * num_slots")
        # The small-pool fast path: same victims (exact LRU), one top-k per selection.
        small = SMALL_POOL_SLOTS if small_pool_slots is None else small_pool_slots
        self._small = TimestampLRU(S, self.device) if S <= small else None
        if self._small is not None:
            S = Q = 0  # the queue is never used
        self.qslot = torch.zeros(Q, dtype=torch.int64, device=self.device)
        self.qpos = torch.full((S,), UNTRACKED, dtype=torch.int64, device=self.device)
        self.iota = torch.arange(Q, dtype=torch.int64, device=self.device)  # positions
        self.head = 0        # queue entries before head are consumed or stale
        self.cur_start = 0   # first position of the current round's bucket
        self.tail = 0
        self.round = 0
        self._live = 0.5     # estimated live fraction at the head (window sizing)
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._wkey, self._win = None, None  # (head, size) -> cached window views
        self._k = K.impl(self.qpos)  # Triton on CUDA, the torch reference on CPU

    @property
    def victim_path(self) -> str:
        """How victims are found: ``"queue"`` windows, or the small-pool ``"scan"``."""
        return "scan" if self._small is not None else "queue"

    # ------------------------------------------------------------------ queue upkeep
    def _push(self, slots: torch.Tensor, n: int) -> None:
        t = self.tail
        e = t + n
        if e > self.cap:
            self._compact()
            t = self.tail
            e = t + n
        self._k.queue_push(slots, self.qslot, self.qpos, t, self.iota[t:e])
        self.tail = e

    def _compact(self) -> None:
        """Move the live entries to the front of the queue, keeping their order."""
        h, c, t = self.head, self.cur_start, self.tail
        qs, qp, io = self.qslot, self.qpos, self.iota
        past = self._k.queue_take(qs[h:c], io[h:c], qp, c - h)[0]
        cur = self._k.queue_take(qs[c:t], io[c:t], qp, t - c)[0]
        live = torch.cat([past, cur])
        n = live.numel()
        self._k.queue_push(live, qs, qp, 0, io[:n])
        self.head, self.cur_start, self.tail = 0, past.numel(), n
        self._wkey = None

    # ------------------------------------------------------------------ policy API
    def hit_touch(self, loc_vals):
        if self._small is not None:
            return self._small.hit_touch(loc_vals)
        bound = min(loc_vals.numel(), self.num_slots)  # hits are distinct device slots
        if self.tail + bound > self.cap:
            self._compact()
        hit, hs = self._k.hit_touch_push(loc_vals, self.qslot, self.qpos, self.tail, self.iota)
        self.tail += hs.numel()
        return hit, hs

    def touch(self, slots):
        if self._small is not None:
            return self._small.touch(slots)
        n = slots.numel()
        if n:
            self._push(slots, n)

    def release(self, slots):
        if self._small is not None:
            return self._small.release(slots)
        if slots.numel():
            K.reference.fill_at(self.qpos, slots, UNTRACKED)

    def select_victims(self, k: int) -> torch.Tensor:
        if self._small is not None:
            return self._small.select_victims(k)
        if k <= 0:
            return self._empty
        qp = self.qpos
        h, end = self.head, self.cur_start
        parts, need = None, k
        while True:
            avail = end - h
            if avail <= 0:
                got = k - need
                raise CapacityError(
                    f"need {k} device victims but only {got} slots are outside the current "
                    "round (the round's working set exceeds the device pool)")
            m = max(_MIN_WINDOW, int(need / self._live * _OVERSCAN) + 64)
            if 2 * m >= avail:  # a short remainder would cost another round of ops
                m = avail
            if self._wkey == (h, m):  # window views are reused while the head stays put
                ws, wp = self._win
            else:
                ws, wp = self.qslot[h:h + m], self.iota[h:h + m]
                self._wkey, self._win = (h, m), (ws, wp)
            vic, used, n_live = self._k.queue_take(ws, wp, qp, need)
            g = vic.numel()
            self._live = max(_MIN_LIVE, n_live / m)
            h += used
            need -= g
            if need == 0:
                break
            if parts is None:
                parts = []
            parts.append(vic)
        if parts is not None:
            parts.append(vic)
            vic = torch.cat(parts)
        K.reference.fill_at(qp, vic, UNTRACKED)  # untracked until touched again
        self.head = h
        return vic

    def advance_round(self) -> None:
        if self._small is not None:
            return self._small.advance_round()
        self.cur_start = self.tail
        self.round += 1

    # ------------------------------------------------------------------ introspection
    def bucket_of(self) -> torch.Tensor:
        """Per slot: 1 = current round's bucket, 0 = an older bucket, -1 untracked.

        O(S), tests only; checks the queue invariants on the way.
        """
        if self._small is not None:
            last, rs = self._small.last, self._small.round_start
            out = torch.full_like(last, -1)
            tracked = last != UNTRACKED
            out[tracked] = (last[tracked] >= rs).to(torch.int64)
            return out
        qp = self.qpos
        tracked = qp != UNTRACKED
        pos = qp.masked_select(tracked)
        sl = tracked.nonzero().squeeze(1)
        if pos.numel():
            if int(pos.min()) < self.head or int(pos.max()) >= self.tail:
                raise AssertionError("live entry outside [head, tail)")
            if not torch.equal(self.qslot.index_select(0, pos), sl):
                raise AssertionError("qpos and the queue disagree")
        if not self.head <= self.cur_start <= self.tail <= self.cap:
            raise AssertionError("queue bounds out of order")
        out = torch.full_like(qp, -1)
        out.masked_scatter_(tracked, (pos >= self.cur_start).to(torch.int64))
        return out
