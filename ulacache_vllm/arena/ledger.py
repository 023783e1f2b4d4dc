"""Page-use ledger: in-flight users of physical pages and the fences that end their use.

A user of a physical page (a forward step, a tier copy, a transfer) registers the page with a
fence. A page freed or moved while a fence on it is unpassed is logically free at once (its
virtual id is gone), but its bytes are withheld and handed back to the arena only when the last
fence on them passes. Pages with an unpassed fence are also pinned: compaction and relayout do
not move them, since a fenced user may still be writing them.
"""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np


class Fence:
    """Completion marker of one user. ``query`` (e.g. a CUDA event's ``query``) lets
    :meth:`Ledger.poll` complete it without the caller calling :meth:`complete`."""

    _ids = itertools.count()

    def __init__(self, ledger: "Ledger", label: str = "", query: Callable[[], bool] | None = None):
        self.id = next(self._ids)
        self.label = label
        self.query = query
        self.passed = False
        self._ledger = ledger

    def complete(self) -> None:
        if not self.passed:
            self.passed = True
            self._ledger._on_complete(self)

    def __repr__(self) -> str:
        return f"Fence({self.id}, {self.label!r}, passed={self.passed})"


class Ledger:
    def __init__(self, check_live: Callable[[list[int]], None],
                 release: Callable[[int, int, object], None],
                 on_pass: Callable[[], None] | None = None) -> None:
        self._check_live = check_live  # raises KeyError for any byte offset that is no live page
        self._release = release
        self._on_pass = on_pass  # told when a fence passes (its pages may move again)
        self._count: dict[int, int] = {}
        self._pages_of: dict[int, list[int]] = {}
        self._open: dict[int, Fence] = {}
        self._pending: dict[int, tuple[int, object]] = {}  # offset -> (nbytes, band)

    def fence(self, label: str = "", query: Callable[[], bool] | None = None) -> Fence:
        return Fence(self, label, query)

    def register(self, phys_pages, fence: Fence) -> None:
        """Record that ``fence``'s user reads or writes the live pages at these byte offsets."""
        if not isinstance(fence, Fence) or fence._ledger is not self:
            # Another ledger's fence would complete there and never release these bytes.
            raise ValueError(f"{fence!r} was not made by this arena's ledger: use arena.fence()")
        if fence.passed:
            return
        offs = np.asarray(phys_pages, dtype=np.int64).ravel().tolist()
        self._check_live(offs)
        for p in offs:
            self._count[p] = self._count.get(p, 0) + 1
        self._pages_of.setdefault(fence.id, []).extend(offs)
        self._open[fence.id] = fence

    def busy(self, offset: int) -> bool:
        return offset in self._count

    def busy_mask(self, offsets: np.ndarray) -> np.ndarray:
        if not self._count:
            return np.zeros(len(offsets), dtype=bool)
        return np.isin(np.asarray(offsets, dtype=np.int64),
                       np.fromiter(self._count, np.int64, len(self._count)))

    def withhold(self, offset: int, nbytes: int, band) -> bool:
        """Called when a page is freed; True if its bytes must wait for fences."""
        if offset in self._count:
            self._pending[offset] = (nbytes, band)
            return True
        return False

    def pending(self) -> dict[int, tuple[int, object]]:
        return dict(self._pending)

    @property
    def pending_bytes(self) -> int:
        return sum(n for n, _ in self._pending.values())

    def open_fences(self) -> list[Fence]:
        return list(self._open.values())

    @property
    def num_open(self) -> int:
        return len(self._open)

    def poll(self) -> int:
        """Complete every open fence whose query says it has passed; returns how many."""
        done = [f for f in self._open.values() if f.query is not None and f.query()]
        for f in done:
            f.complete()
        return len(done)

    def _on_complete(self, fence: Fence) -> None:
        self._open.pop(fence.id, None)
        if self._on_pass is not None:
            self._on_pass()
        for p in self._pages_of.pop(fence.id, []):
            c = self._count[p] - 1
            if c:
                self._count[p] = c
                continue
            del self._count[p]
            if p in self._pending:
                nbytes, band = self._pending.pop(p)
                self._release(p, nbytes, band)
