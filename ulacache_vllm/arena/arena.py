"""The arena: one byte range per rank holding every kind's pages at their natural size.

Full-attention kinds grow down from the top (HIGH band), window and recurrent-state kinds up
from byte 0 (LOW band), the free middle between them; no ratio or partition is fixed. Callers
hold virtual page ids (stable across moves) and ask :meth:`Arena.v2p` for byte offsets; every
move comes back as a :class:`~.copy_plan.CopyPlan`. The arena never touches the bytes itself.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Mapping
from typing import Callable

import numpy as np

from . import bands
from .admission import COMPACT, MAX_PASSES, RELAYOUT, REUSE, SHORTFALL, AdmitResult
from .copy_plan import CopyPlan
from .free_space import FreeSpace
from .kinds import Band, KindSpec
from .ledger import Fence, Ledger
from .virtual_ids import VirtualIds, as_ids

def _count(value, what: str) -> int:
    """``value`` as an int if it is an integer (numpy ones too), else a ValueError naming it."""
    if type(value) is int:  # (the common case, without the ABC check)
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return int(value)


class Arena:
    """``alignment``: page sizes and offsets are multiples of it, raised if need be to a
    multiple of the largest row item size, so every row can be viewed as its dtype."""

    def __init__(self, total_bytes: int, kinds: list[KindSpec], *, alignment: int = 256) -> None:
        total_bytes, alignment = _count(total_bytes, "total_bytes"), _count(alignment, "alignment")
        if alignment <= 0:
            raise ValueError("alignment must be positive")
        if total_bytes < 0:
            raise ValueError(f"total_bytes must be >= 0, got {total_bytes}")
        kinds = list(kinds)
        if not all(isinstance(k, KindSpec) for k in kinds):
            raise ValueError("kinds must be KindSpec objects")
        names = [k.name for k in kinds]
        if len(set(names)) != len(names) or not kinds:
            raise ValueError(f"kinds must be non-empty with unique names: {names}")
        alignment = math.lcm(alignment, *(k.itemsize for k in kinds))
        self.alignment = alignment
        self.total_bytes = total_bytes // alignment * alignment
        self.kinds = list(kinds)
        self.page_bytes = [k.page_bytes(alignment) for k in kinds]
        self._kind_index = {k.name: i for i, k in enumerate(kinds)}
        self._by_band = {band: sorted((i for i, k in enumerate(kinds) if k.band is band),
                                      key=lambda i: -self.page_bytes[i]) for band in Band}
        self._band_of = [k.band for k in kinds]
        self._space = FreeSpace(self.total_bytes)
        self._ids = VirtualIds()
        self.ledger = Ledger(self._check_live, self._release_bytes, on_pass=self._changed)
        # Bumped by every change that can let a refused demand fit (allocation, free, move,
        # a fence passing); the last refused demand and the version it was refused at.
        self._version = 0
        self._failed = None
        self._requests: dict[Hashable, dict[int, list[int]]] = {}
        self.stats = {"admitted": 0, "grown": 0, "shortfalls": 0, "compactions": 0,
                      "relayouts": 0, "bytes_copied": 0, "pages_moved": 0}

    # -- kinds & queries ------------------------------------------------------------------------
    def kind_index(self, kind) -> int:
        if type(kind) is int and 0 <= kind < len(self.kinds):  # (the common cases first)
            return kind
        if type(kind) is str and kind in self._kind_index:
            return self._kind_index[kind]
        if isinstance(kind, KindSpec):
            kind = kind.name
        if isinstance(kind, (bool, np.bool_)):  # (an int subclass: True would mean kind #1)
            raise KeyError(kind)
        if isinstance(kind, (int, np.integer)):
            if not 0 <= kind < len(self.kinds):
                raise KeyError(kind)
            return int(kind)
        return self._kind_index[kind]

    @property
    def free_bytes(self) -> int:
        """Bytes free now (excludes bytes withheld by the ledger)."""
        return self._space.free_bytes

    @property
    def pending_bytes(self) -> int:
        return self.ledger.pending_bytes

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.free_bytes - self.pending_bytes

    @property
    def band_bounds(self) -> tuple[int, int]:
        """(low_top, high_bottom): the free middle is the byte range between them."""
        return self._space.low_top, self._space.high_bottom

    def free_extents(self) -> list[tuple[int, int]]:
        return self._space.extents()

    def largest_free_extent(self) -> int:
        return self._space.largest()

    def requests(self) -> list[Hashable]:
        return list(self._requests)

    def pages(self, request_id: Hashable, kind) -> np.ndarray:
        """Virtual page ids a request holds for ``kind``, in allocation order."""
        return np.asarray(self._requests[request_id].get(self.kind_index(kind), []), dtype=np.int64)

    def v2p(self, vids) -> np.ndarray:
        """Physical byte offsets of virtual page ids."""
        return self._ids.v2p(vids)

    def p2v(self, offsets) -> np.ndarray:
        return self._ids.p2v(offsets)

    def placement(self) -> tuple[np.ndarray, np.ndarray]:
        """Read-only views of the whole vid tables: (byte offset, kind index) per vid; -1 for
        unmapped vids. For callers that mirror the placement elsewhere (a worker's vid ->
        position table) and diff it in one vector operation."""
        v2p, kind = self._ids.tables()
        v2p.flags.writeable = False
        kind.flags.writeable = False
        return v2p, kind

    @property
    def version(self) -> int:
        """Bumped by every change of the placement, the free bytes or the withheld bytes
        (allocation, free, move, a fence passing; a failed ladder's undo brings back the
        tables and the version they had). ``stats`` counts shortfalls without a bump."""
        return self._version

    @property
    def placement_version(self) -> int:
        """Changes with every change of :meth:`placement` (allocation, release, move, a failed
        ladder's undo) and never comes back: while it is unchanged, so is the placement (a
        mirror of the tables can skip its diff)."""
        return self._ids.version

    @property
    def num_pages(self) -> int:
        """Live pages (every kind)."""
        return len(self._ids)

    def live_pages(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(vids, offsets, page bytes) of every live page."""
        vids, offs, kinds = self._ids.live()
        return vids, offs, np.asarray(self.page_bytes, dtype=np.int64)[kinds]

    def usage_by_kind(self) -> dict[str, int]:
        _, _, kinds = self._ids.live()
        counts = np.bincount(kinds, minlength=len(self.kinds))
        return {k.name: int(c) * self.page_bytes[i] for i, (k, c) in enumerate(zip(self.kinds, counts))}

    # -- ledger ---------------------------------------------------------------------------------
    def fence(self, label: str = "", query: Callable[[], bool] | None = None) -> Fence:
        return self.ledger.fence(label, query)

    def register_use(self, vids, fence: Fence) -> None:
        """A user (forward step, tier copy, transfer) of these pages until ``fence`` passes."""
        self.ledger.register(self.v2p(vids), fence)

    # -- request operations ---------------------------------------------------------------------
    def admit(self, request_id: Hashable, demands: Mapping) -> AdmitResult:
        """All-or-nothing: ``demands`` maps kind -> pages. On success the request holds them."""
        if request_id in self._requests:
            raise KeyError(f"request {request_id!r} already admitted")
        dem = self._demands(demands)
        res = self._ladder(dem)
        if res.ok:
            self._requests[request_id] = {k: v.tolist() for k, v in self._by_index(res).items()}
            self.stats["admitted"] += 1
        return res

    def allocate(self, demands: Mapping) -> AdmitResult:
        """All-or-nothing placement of ``demands`` (kind -> pages) without request bookkeeping:
        the caller (an engine's block manager) owns the returned virtual ids and gives them
        back through :meth:`release`."""
        return self._ladder(self._demands(demands))

    def take(self, demands: Mapping[int, int]) -> dict[int, list[int]] | None:
        """:meth:`allocate`'s first rung for a few pages, in lists: ``demands`` maps kind
        index -> pages (> 0); the pages go where :meth:`allocate` puts them first (the
        default packing into holes and band ends, no page moved), with the same vids. None:
        they do not fit so (nothing changed; :meth:`allocate` runs the whole ladder)."""
        self.ledger.poll()
        placed, _ = self._place_with(demands, *_PACKINGS[0])
        if placed is None:
            return None
        self._changed()
        return {k: self._ids.allocate(offs, k) for k, offs in placed.items()}

    def release(self, vids) -> None:
        """Give back pages :meth:`allocate` handed out (bytes withheld while fenced)."""
        if type(vids) is list:  # (a request's few pages: plain ints, no arrays)
            if not vids:
                return
            got = self._ids.release_list(vids)
            if got is not None:
                self._changed()
                self._free_pages(*got)
                return
        self._release(as_ids(vids).ravel())

    def grow(self, request_id: Hashable, kind, n: int) -> AdmitResult:
        """Add ``n`` pages of ``kind`` to an admitted request (all or nothing)."""
        held = self._requests[request_id]
        k = self.kind_index(kind)
        res = self._ladder(self._demands({kind: n}))
        if res.ok:
            held.setdefault(k, []).extend(self._by_index(res).get(k, np.zeros(0, np.int64)).tolist())
            self.stats["grown"] += 1
        return res

    def shrink(self, request_id: Hashable, kind, vids) -> None:
        """Release some pages of a request (e.g. window pages that slid out of the window)."""
        held = self._requests[request_id].setdefault(self.kind_index(kind), [])
        drop = set(as_ids(vids).ravel().tolist())
        if not drop <= set(held):
            raise KeyError(f"request {request_id!r} does not hold {sorted(drop - set(held))[:8]}")
        held[:] = [v for v in held if v not in drop]
        self._release(np.fromiter(drop, np.int64, len(drop)))

    def free(self, request_id: Hashable) -> None:
        held = self._requests.pop(request_id)
        vids = [v for vs in held.values() for v in vs]
        self._release(np.asarray(vids, dtype=np.int64))

    # -- movement -------------------------------------------------------------------------------
    def compact(self) -> CopyPlan:
        """Step 2: fill each band's holes with that band's farthest movable pages (one step)."""
        rows, srcs = [], []
        vids_all, offs_all, kinds_all = self._ids.live()
        for band in (Band.LOW, Band.HIGH):
            holes = [self._b(band, a, b) for a, b in self._space.holes(band)]
            for k in self._band_kinds(band):
                size = self.page_bytes[k]
                sel = kinds_all == k
                vids, offs = vids_all[sel], offs_all[sel]
                movable = ~self.ledger.busy_mask(offs)
                vids, offs = vids[movable], offs[movable]
                if not len(vids) or not holes:
                    continue
                boffs = bands.to_band(band, self.total_bytes, offs, size)
                idx, bdst, taken, holes = bands.plan_fill_holes(holes, boffs, size)
                if not len(idx):
                    continue
                for a, nbytes in taken:
                    start = a if band is Band.LOW else self.total_bytes - a - nbytes
                    self._space.remove(start, nbytes, band)
                dst = bands.to_band(band, self.total_bytes, bdst, size)
                src = offs[idx]
                self._ids.move(vids[idx], dst)
                rows.append(np.stack([src, dst, np.full(len(src), size, np.int64)], axis=1))
                srcs.extend((int(s), size) for s in src)
        # Sources become free only now, so no copy of this step writes bytes another reads.
        for s, size in srcs:
            self._space.add(s, size)
        plan = CopyPlan([np.concatenate(rows)] if rows else [])
        self._count_moves(plan, "compactions", len(srcs))  # one copy row per page here
        return plan

    def relayout(self) -> CopyPlan:
        """Step 3: slide every movable page of each band to the band's base (ordered steps)."""
        vids_all, offs_all, kinds_all = self._ids.live()
        sizes_all = np.asarray(self.page_bytes, dtype=np.int64)[kinds_all] if len(kinds_all) else \
            np.zeros(0, np.int64)
        band_of = np.array([k.band is Band.HIGH for k in self.kinds])
        per_band_steps, pages = [], 0
        pending = self.ledger.pending()
        for band in (Band.LOW, Band.HIGH):
            sel = band_of[kinds_all] == (band is Band.HIGH) if len(kinds_all) else np.zeros(0, bool)
            vids, offs, sizes = vids_all[sel], offs_all[sel], sizes_all[sel]
            movable = ~self.ledger.busy_mask(offs)
            wo = [(o, n) for o, (n, b) in pending.items() if b is band]
            objs = np.concatenate([offs, np.array([o for o, _ in wo], np.int64)])
            osz = np.concatenate([sizes, np.array([n for _, n in wo], np.int64)])
            mov = np.concatenate([movable, np.zeros(len(wo), bool)])
            moves, steps = bands.plan_slide(bands.to_band(band, self.total_bytes, objs, osz), osz, mov)
            pages += len(moves)
            for i, bdst in moves:
                n = int(osz[i])
                dst = bdst if band is Band.LOW else self.total_bytes - bdst - n
                self._space.add(int(objs[i]), n)
                self._space.remove(dst, n, band)
                self._ids.move(vids[i:i + 1], np.array([dst], np.int64))
            per_band_steps.append([bands.mirror_copies(band, self.total_bytes, s) for s in steps])
        low, high = per_band_steps
        # The bands never share bytes, so their k-th steps can run together.
        merged = [np.concatenate([s for s in pair if s is not None and len(s)])
                  for pair in _zip_longest(low, high)]
        plan = CopyPlan(merged)
        self._count_moves(plan, "relayouts", pages)  # (a slid page may take several chunk copies)
        return plan

    # -- internals ------------------------------------------------------------------------------
    def _b(self, band: Band, a: int, b: int) -> tuple[int, int]:
        return (a, b) if band is Band.LOW else (self.total_bytes - b, self.total_bytes - a)

    def _band_kinds(self, band: Band) -> list[int]:
        # Largest pages first: they have the fewest holes that fit them (kinds are fixed).
        return self._by_band[band]

    def _demands(self, demands: Mapping) -> dict[int, int]:
        dem: dict[int, int] = {}
        for k, n in demands.items():
            n = _count(n, f"the demand for {k!r}")
            if n < 0:
                raise ValueError(f"negative demand for {k!r}")
            dem[self.kind_index(k)] = dem.get(self.kind_index(k), 0) + n
        return dem

    def _try_place(self, demands: dict[int, int]) -> tuple[dict[int, list[int]] | None, int]:
        """Place every demanded page without moving any, all or nothing: the first of a few
        greedy packings that fits (packing pages of several sizes into holes is bin packing;
        one greedy order misses fits another finds). Returns (offsets per kind, 0) or (None,
        bytes the first packing left unplaced)."""
        first_unplaced = None
        for largest_first, best_fit in _PACKINGS:
            placed, unplaced = self._place_with(demands, largest_first, best_fit)
            if placed is not None:
                return placed, 0
            if first_unplaced is None:
                first_unplaced = unplaced
        return None, first_unplaced

    def _place_with(self, demands: dict[int, int], largest_first: bool, best_fit: bool):
        done: list[tuple[int, int, Band]] = []
        placed: dict[int, list[int]] = {}
        for band in (Band.LOW, Band.HIGH):
            kinds = self._band_kinds(band)
            for k in (kinds if largest_first else kinds[::-1]):
                n = demands.get(k, 0)
                if not n:
                    continue
                got = bands.place(self._space, band, n, self.page_bytes[k], best_fit)
                if got is None:
                    for start, nbytes, b in reversed(done):
                        self._space.add(start, nbytes)
                    unplaced = sum(demands[j] * self.page_bytes[j] for j in demands
                                   if j not in placed)
                    return None, unplaced
                placed[k], taken = got
                done.extend((s, nb, band) for s, nb in taken)
        return placed, 0

    def _snapshot(self):
        """The tables a move changes (free space, v2p / p2v, stats, version), to undo a
        failed ladder. The ledger is not among them: moves never touch fenced pages or
        withheld bytes."""
        return self._space.copy(), self._ids.copy(), dict(self.stats), self._version

    def _restore(self, saved) -> None:
        version = self._ids.version
        self._space, self._ids, self.stats, self._version = saved
        self._ids.version = version + 1  # a version never names two different tables

    def _changed(self) -> None:
        self._version += 1

    def _ladder(self, dem: dict[int, int]) -> AdmitResult:
        placed, plan, step, shortfall = self._run_ladder(dem)
        if placed is None:
            self.stats["shortfalls"] += 1
            return AdmitResult(False, {}, plan, shortfall, step)
        self._changed()
        vids = {self.kinds[k].name: np.asarray(self._ids.allocate(offs, k), np.int64)
                for k, offs in placed.items()}
        for k, n in dem.items():
            vids.setdefault(self.kinds[k].name, np.zeros(0, np.int64))
        return AdmitResult(True, vids, plan, 0, step)

    def _run_ladder(self, demands: dict[int, int]) -> tuple[dict[int, list[int]] | None, CopyPlan, str, int]:
        """Place ``demands`` (kind index -> pages). Returns (physical offsets per kind or None,
        copy plan, step, shortfall bytes)."""
        self.ledger.poll()
        placed, unplaced = self._try_place(demands)
        if placed is not None:
            return placed, CopyPlan(), REUSE, 0
        need = sum(n * self.page_bytes[k] for k, n in demands.items())
        if need > self.free_bytes:  # nothing short of freeing can help: move nothing
            return None, CopyPlan(), SHORTFALL, need - self.free_bytes
        # A scheduler retries its head request every step: the same demand on an unchanged
        # arena (no allocation, free, move or fence passed since) fails the same way.
        key = (self._version, tuple(sorted(demands.items())))
        if self._failed is not None and self._failed[0] == key:
            return None, CopyPlan(), SHORTFALL, self._failed[1]
        saved = self._snapshot()
        plan = CopyPlan()
        try:
            for step, moves in ((COMPACT, (self.compact,)), (RELAYOUT, (self.relayout, self.compact))):
                for _ in range(MAX_PASSES):
                    moved = False
                    for move in moves:
                        more = move()
                        if not more:
                            continue  # nothing moved: the last placement attempt stands
                        plan.extend(more)
                        moved = True
                        placed, unplaced = self._try_place(demands)
                        if placed is not None:
                            return placed, plan, step, 0
                    if not moved:
                        break
        except BaseException:
            self._restore(saved)  # tables as before the call: nothing half-moved
            raise
        self._restore(saved)
        self._failed = (key, unplaced)
        return None, CopyPlan(), SHORTFALL, unplaced

    def _by_index(self, res: AdmitResult) -> dict[int, np.ndarray]:
        return {self._kind_index[name]: v for name, v in res.virtual_page_ids.items()}

    def _release(self, vids: np.ndarray) -> None:
        if not len(vids):
            return
        self._changed()
        kinds = self._ids.kind_of(vids)
        offs = self._ids.release(vids)
        self._free_pages(offs.tolist(), kinds.tolist())

    def _free_pages(self, offs: list[int], kinds: list[int]) -> None:
        """Released pages' bytes back to the free space, or withheld while fenced."""
        page, band_of, withhold = self.page_bytes, self._band_of, self.ledger.withhold
        free = sorted((off, page[k]) for off, k in zip(offs, kinds)
                      if not withhold(off, page[k], band_of[k]))
        # Adjacent pages (a request's pages mostly are) go back as one extent.
        start, end = None, None
        for off, size in free:
            if off == end:
                end += size
                continue
            if start is not None:
                self._space.add(start, end - start)
            start, end = off, off + size
        if start is not None:
            self._space.add(start, end - start)

    def _release_bytes(self, offset: int, nbytes: int, band) -> None:
        self._space.add(offset, nbytes)
        self._changed()

    def _check_live(self, offsets: list[int]) -> None:
        self._ids.check_mapped(offsets)  # (``_ids`` is swapped by a failed ladder's undo)

    def _count_moves(self, plan: CopyPlan, counter: str, pages: int) -> None:
        if plan:
            self._changed()
            self.stats[counter] += 1
            self.stats["bytes_copied"] += plan.nbytes
            self.stats["pages_moved"] += pages


# Greedy packings ``_try_place`` tries in turn, as (largest kinds first, best-fit holes): the
# default fills the holes nearest each band's base; best-fit takes the smallest hole (or the
# middle) that holds a kind's pages; smallest-first leaves the big holes to small pages.
_PACKINGS = ((True, False), (True, True), (False, False))


def _zip_longest(a: list, b: list):
    for i in range(max(len(a), len(b))):
        yield (a[i] if i < len(a) else None, b[i] if i < len(b) else None)
