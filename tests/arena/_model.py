"""Shared checks for arena tests: byte-buffer shadow of an Arena and its invariants."""

from __future__ import annotations

import numpy as np
import torch

from ulacache_vllm.arena import Arena, Band, CopyPlan
from ulacache_vllm.arena.copy_plan import check_step


def overlaps(a0, a1, ranges) -> bool:
    return any(a0 < b1 and b0 < a1 for b0, b1 in ranges)


class Shadow:
    """A real byte tensor the arena's plans are applied to, and what each page must hold."""

    def __init__(self, arena: Arena, seed: int = 0) -> None:
        self.arena = arena
        self.buf = torch.zeros(arena.total_bytes, dtype=torch.uint8)
        self.expect: dict[int, torch.Tensor] = {}
        self.rng = np.random.default_rng(seed)
        self.fenced: dict[int, list[tuple[int, int]]] = {}  # fence id -> byte ranges

    def fenced_ranges(self) -> list[tuple[int, int]]:
        return [r for f in self.arena.ledger.open_fences() for r in self.fenced.get(f.id, [])]

    def apply(self, plan: CopyPlan) -> None:
        fenced = self.fenced_ranges()
        for step in plan.steps:
            assert check_step(step), f"copies of one step overlap: {step}"
            for s, d, n in step.tolist():
                assert not overlaps(d, d + n, fenced), "copy writes bytes under an unpassed fence"
                assert not overlaps(s, s + n, fenced), "a fenced (pinned) page was moved"
        plan.apply(self.buf)

    def write_new(self, vids: dict[str, np.ndarray]) -> None:
        fenced = self.fenced_ranges()
        for name, vs in vids.items():
            size = self.arena.page_bytes[self.arena.kind_index(name)]
            for v, p in zip(vs.tolist(), self.arena.v2p(vs).tolist()):
                assert not overlaps(p, p + size, fenced), "handed out bytes under an unpassed fence"
                data = torch.from_numpy(self.rng.integers(0, 256, size, dtype=np.uint8))
                self.buf[p:p + size] = data
                self.expect[v] = data

    def forget(self, vids) -> None:
        for v in np.asarray(vids).tolist():
            del self.expect[v]

    def register(self, vids, fence) -> None:
        offs = self.arena.v2p(vids)
        sizes = [self.arena.page_bytes[self.arena.kind_index(self.arena._ids.kind_of([v])[0])]
                 for v in np.asarray(vids).tolist()]
        self.arena.register_use(vids, fence)
        self.fenced.setdefault(fence.id, []).extend(
            (int(o), int(o) + s) for o, s in zip(offs.tolist(), sizes))

    def check(self) -> None:
        a = self.arena
        vids, offs, sizes = a.live_pages()
        # Live pages never overlap; live + free + withheld bytes tile the arena exactly.
        spans = sorted([(int(o), int(o + s), "live") for o, s in zip(offs, sizes)]
                       + [(s, e, "free") for s, e in a.free_extents()]
                       + [(o, o + n, "held") for o, (n, _) in a.ledger.pending().items()])
        pos = 0
        for s, e, what in spans:
            assert s == pos, f"gap or overlap at {pos}..{s} ({what})"
            pos = e
        assert pos == a.total_bytes
        assert a.free_bytes == sum(e - s for s, e in a.free_extents())
        # Bands: every low object below every high object, the middle free.
        lo, hi = a.band_bounds
        kinds = a._ids.kind_of(vids)
        for o, s, k in zip(offs.tolist(), sizes.tolist(), kinds.tolist()):
            if a.kinds[k].band is Band.LOW:
                assert o + s <= lo
            else:
                assert o >= hi
        assert lo <= hi and (lo == hi or (lo, hi) in a.free_extents())
        # v2p and p2v are inverse bijections over live pages.
        assert len(set(offs.tolist())) == len(offs)
        assert np.array_equal(a.p2v(offs), vids)
        assert np.array_equal(a.v2p(vids), offs)
        assert set(vids.tolist()) == set(self.expect)
        held = [v for r in a.requests() for k in range(len(a.kinds)) for v in a.pages(r, k).tolist()]
        assert sorted(held) == sorted(vids.tolist())
        # Bytes written through a virtual id read back identical wherever the page now lives.
        for v, o, s in zip(vids.tolist(), offs.tolist(), sizes.tolist()):
            assert torch.equal(self.buf[o:o + s], self.expect[v]), f"page {v} corrupted"


def demand_fits_reference(arena: Arena, demands: dict[int, int]) -> bool:
    """Could a packer place ``demands`` in the current free extents (bands respected, nothing
    moved)? Greedy per band, largest pages first, with the middle shared: exact when each band
    holds one page size."""
    lo, hi = arena.band_bounds
    ext = arena.free_extents()
    low_holes = [e - s for s, e in ext if e <= lo]
    high_holes = [e - s for s, e in ext if s >= hi]
    mid_need = 0
    for band, holes in ((Band.LOW, low_holes), (Band.HIGH, high_holes)):
        holes = sorted(holes)
        for k in sorted((k for k in demands if arena.kinds[k].band is band),
                        key=lambda k: -arena.page_bytes[k]):
            size, left = arena.page_bytes[k], demands[k]
            for i, h in enumerate(holes):
                take = min(left, h // size)
                holes[i] -= take * size
                left -= take
            mid_need += left * size
    return mid_need <= hi - lo
