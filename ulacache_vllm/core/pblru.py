"""PB-LRU: parallel bucketed LRU over the device pool of one layer group (the default policy).

A bucket is a round: every slot touched in a scheduling round carries that round's number as
its *label* (``labels[slot]``, int16; ``UNTRACKED`` = free, released or just evicted), so a
touch is one label write and advancing the ring is ``round += 1``. Victims come from the
oldest round first, inside a round in slot order, never from the current round. Invariants:
every label below ``_next`` belongs to the stash (the untaken rest of the oldest bucket); a
round is harvested once; a failed selection restores the labels it took. Labels are rebased
before int16's end, rounds older than ~16k folding into one cold bucket. All per-step work is
tensor ops (numpy views on CPU, one Triton kernel for hit + touch on CUDA). Small pools get the
exact timestamp scan instead (``policies.make_policy``). How it works in detail and what it
was measured against: ``benchmarks/results/pblru_designs.md``.
"""

from __future__ import annotations

import torch

from ulacache_vllm import kernels as K

from .policy import EvictionPolicy
from .pools import CapacityError

# int16 labels: half the bytes of int32 for the label scatters, gathers and scans, which run
# over a table the mapping's own ops keep pushing out of the caches (in-mapping A/B replay at
# batch 32 / 25 % pools: 0.59 against 0.76 ms per step). Rounds are rebased every ~16k.
IDX = torch.int16
UNTRACKED = torch.iinfo(IDX).max  # the label of a slot in no bucket (free, released, evicted)
# Pools up to this many slots take the timestamp scan (measured on CPU at batch 1: at 829-2489
# slots the harvests cost 1.05-1.15x the scan per step, at ~7k and ~10k slots 0.9-0.95x).
SMALL_POOL_SLOTS = 4096


class PBLRU(EvictionPolicy):
    name = "pblru"
    # Rounds are rebased once the current round reaches this (labels must stay below
    # UNTRACKED); an instance attribute may lower it (tests; at least 2).
    label_limit = UNTRACKED - 1
    # Harvests per selection before the rest is taken in one pass (``_oldest``): bounds a
    # selection's scans when it spans many thin rounds (e.g. after a CapacityError's restore).
    max_harvests = 3

    def __init__(self, num_slots: int, device: torch.device, ring_size: int = 8,
                 cold_buckets: int = 8):
        if ring_size < 1:
            raise ValueError("ring_size must be >= 1")
        if cold_buckets < 0:
            raise ValueError("cold_buckets must be >= 0")
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.ring_size, self.cold_buckets = ring_size, cold_buckets
        self.device = torch.device(device)
        self.num_slots = S = num_slots
        # Label S is a dummy: misses of a hit_touch write it, and no scan reads it.
        self.labels = torch.full((S + 1,), UNTRACKED, dtype=IDX, device=self.device)
        self._pool = self.labels[:S]
        self.round = 0
        self._next = 0        # the next round to harvest: labels below it are the stash's
        self._stash = None    # (round, slots): the untaken rest of the oldest bucket
        self._src = torch.empty(0, dtype=IDX, device=self.device)  # `round`, repeated
        self._src_round = None
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self.harvests = 0     # counters, for tests and benchmarks
        self.rebases = 0
        self._k = K.impl(self.labels)  # Triton on CUDA, the reference on CPU

    victim_path = "rounds"  # (a small pool gets the scan instead: policies.make_policy)

    # ------------------------------------------------------------------ helpers
    def _round_src(self, n: int) -> torch.Tensor:
        """``n`` copies of the current round (a buffer refilled once per round)."""
        src = self._src
        if src.numel() < n:
            src = self._src = torch.empty(max(n, 2 * src.numel(), 1024), dtype=IDX,
                                          device=self.device)
            self._src_round = None
        if self._src_round != self.round:
            src.fill_(self.round)
            self._src_round = self.round
        return src[:n]

    def _harvest(self, taken: list):
        """The oldest bucket held, ``(round, its slots in slot order)``, or ``None`` when only
        the current round holds slots (or none are held). Call only with the stash used up;
        ``taken`` are the slots this selection took so far (still labelled)."""
        r = self._next
        if r >= self.round:
            return None
        idx = self._k.label_members(self._pool, r)
        if idx.numel() == 0:
            # Round r holds nothing (idle rounds, or all of it re-touched or freed): jump to
            # the oldest label held.
            self._untrack(taken)
            r = int(self._pool.min()) if self.num_slots else UNTRACKED
            if r >= self.round:  # UNTRACKED, or only the current round left
                return None
            idx = self._k.label_members(self._pool, r)
        self._next = r + 1
        self.harvests += 1
        return r, idx

    def _rebase(self) -> None:
        """Shift every label and the round down by ``round - label_limit // 2`` (O(pool));
        labels older than that fold into round 0, one cold bucket in slot order. The stash is
        dropped (its slots keep their labels, so harvests find them again): a fold may put
        other slots in its round."""
        if self.label_limit < 2:
            raise ValueError(f"label_limit must be >= 2, got {self.label_limit}")
        base = self.round - self.label_limit // 2
        lab = self._pool
        held = lab != UNTRACKED
        lab.copy_(torch.where(held, (lab - base).clamp_(min=0), lab))
        self.round -= base
        self._next, self._stash = 0, None
        self._src_round = None
        self.rebases += 1

    # ------------------------------------------------------------------ policy API
    def hit_touch(self, loc_vals):
        return self._k.label_hit_touch(loc_vals, self.labels, self.num_slots, self.round,
                                       self._round_src(loc_vals.numel()))

    def touch(self, slots):
        n = slots.numel()
        if n:
            self.labels.scatter_(0, slots, self._round_src(n))

    def release(self, slots):
        if slots.numel():
            K.reference.fill_at(self.labels, slots, UNTRACKED)

    def _untrack(self, taken: list) -> None:
        """Before a search of the whole pool: the slots a selection took so far hold the oldest
        labels of all and must not be found again (the final untracking repeats it)."""
        for t in taken:
            K.reference.fill_at(self.labels, t, UNTRACKED)

    def _oldest(self, taken: list, need: int):
        """``(the need oldest slots by (round, slot), the new stash)`` in one pass over the
        pool (the stash: the rest of the last round they reach), or ``(None, count)`` when only
        ``count < need`` lie outside the current round. For selections spanning many thin
        rounds: the result of harvesting them one by one, at a bounded cost (a compare, a
        compaction and a stable sort of the old labels, radix on CPU). ``taken``: slots this
        selection took."""
        self._untrack(taken)
        old, lab = self._k.labels_below(self._pool, self.round)
        if old.numel() < need:
            return None, old.numel()
        order = self._k.stable_argsort(lab)
        lab_sorted = lab.index_select(0, order)
        last = int(lab_sorted[need - 1])
        rest = order[need:need + int((lab_sorted[need:] == last).sum())]  # sorted: a prefix
        self._next = last + 1
        return old.index_select(0, order[:need]), (last, old.index_select(0, rest))

    def select_victims(self, k: int) -> torch.Tensor:
        if k <= 0:
            return self._empty
        lab, parts, rounds, need = self.labels, [], [], k
        bucket, rest = self._stash, None
        self._stash = None
        harvests = have = 0  # have: old slots beyond those taken (known after a failed pass)
        while need:
            if bucket is None:
                if harvests < self.max_harvests:
                    harvests += 1
                    bucket = self._harvest(parts)
                else:  # many thin rounds: one pass for the rest
                    got, stash = self._oldest(parts, need)
                    if got is not None:
                        parts.append(got)
                        rest = stash if stash[1].numel() else None
                        break
                    have = stash
                if bucket is None:
                    # Nothing changed but labels of taken slots (when a harvest or the pass
                    # untracked them) and the harvest hint: put both back, oldest bucket first.
                    for r, t in zip(rounds, parts):
                        lab.index_fill_(0, t, r)
                    if parts:
                        self._stash, self._next = (rounds[0], parts[0]), rounds[0] + 1
                    raise CapacityError(
                        f"need {k} device victims but only {k - need + have} slots are outside "
                        "the current round (the round's working set exceeds the device pool)")
            r, slots = bucket
            live = self._k.label_live(slots, lab, r)
            if live.numel() > need:
                rest, live = (r, live[need:]), live[:need]
            parts.append(live)
            rounds.append(r)
            need -= live.numel()
            bucket = None
        vic = parts[0] if len(parts) == 1 else torch.cat(parts)
        K.reference.fill_at(lab, vic, UNTRACKED)  # untracked until touched again
        self._stash = rest
        return vic

    def advance_round(self) -> None:
        self.round += 1
        if self.round >= self.label_limit:
            self._rebase()

    # ------------------------------------------------------------------ introspection
    def bucket_of(self) -> torch.Tensor:
        """Per slot: 1 = current round's bucket, 0 = an older bucket, -1 untracked.

        O(S), tests only; checks the label invariants on the way.
        """
        lab = self._pool.to(torch.int64)
        held = lab != UNTRACKED
        vals = lab.masked_select(held)
        if bool((vals > self.round).any()) or bool((vals < 0).any()):
            raise AssertionError("a label outside [0, round]")
        st = self._stash
        if st is not None and bool((vals < st[0]).any()):
            raise AssertionError("a bucket older than the stash's")
        low = held & (lab < self._next)
        if bool(low.any()):
            inside = torch.zeros_like(held)
            if st is not None:
                inside[st[1]] = True
            if bool((low & ~inside).any()) or bool((lab.masked_select(low) != st[0]).any()):
                raise AssertionError("a label below the next harvest outside the stash")
        out = torch.where(lab == self.round, 1, 0)
        return out.masked_fill(~held, -1)
