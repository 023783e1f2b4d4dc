"""Free-but-cached pages in the order they leave (no vLLM import).

A prefix cache over the arena keeps a page whose last holder released it (it is hashed: a
later request may hit it) until an admission needs its bytes and no free bytes can serve it.
Pages leave as a cache's do, least recently used first, by *units*:

- a unit is the pages one owner (a request) released together when it finished or was
  preempted, with the cached pages it released while it ran (the window pages that slid out
  of its sliding window, older state checkpoints): a prefix's window pages and its
  full-attention pages leave together, not the window first;
- released units leave least recently released first; a running request's pages (its open
  unit) only after every released unit, oldest request first;
- inside a unit pages leave from the end of the prompt backwards (the page ending at the
  highest token first, every kind together), so a partly evicted unit keeps its longest
  prefix that can still be hit; the caller then drops what of it can no longer be hit
  (:meth:`CachedPages.remaining`);
- pages kept only on speculation (``first``: the extra window pages that let a later sibling
  hit, which stock vLLM would not keep at all) leave before every other page, oldest first:
  they only use bytes stock would leave free, so whatever else stock's cache would keep, this
  one keeps too.

A hit takes a page out (:meth:`CachedPages.remove`); when its new holder releases it, it
joins that holder's unit.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterable


class CachedPages:
    """Free-but-cached pages (vid -> bytes, end token) grouped into units."""

    def __init__(self) -> None:
        # Released units, least recently released first: stamp -> {vid: end token}.
        self._closed: OrderedDict[int, dict[int, int]] = OrderedDict()
        # Speculative pages, oldest first: vid -> end token (they leave first).
        self._first: OrderedDict[int, int] = OrderedDict()
        # Open units (owners still running), oldest first: owner -> {vid: end token}.
        self._open: OrderedDict[Hashable, dict[int, int]] = OrderedDict()
        self._unit: dict[int, tuple] = {}  # vid -> (units, key); speculative: (None, None)
        self._bytes: dict[int, int] = {}
        self.info: dict[int, object] = {}  # released unit -> its owner's info (caller's)
        self.nbytes = 0
        self._stamps = itertools.count()

    def __len__(self) -> int:
        return len(self._unit)

    def __contains__(self, vid) -> bool:
        return vid in self._unit

    def add(self, vid: int, nbytes: int, end_token: int, owner: Hashable = None,
            first: bool = False) -> None:
        """A page became free but stays cached; it joins ``owner``'s open unit (``first``:
        kept on speculation, it leaves before every other page instead)."""
        if vid in self._unit:
            raise KeyError(f"page {vid} is already cached free")
        if first:
            self._first[vid] = end_token
            self._unit[vid] = (None, None)
        else:
            self._open.setdefault(owner, {})[vid] = end_token
            self._unit[vid] = (self._open, owner)
        self._bytes[vid] = nbytes
        self.nbytes += nbytes

    def close(self, owner: Hashable = None, info: object = None) -> int | None:
        """``owner`` released its last pages: its open unit becomes the most recently
        released unit (``info`` kept with it); returns its stamp (None: it had no page)."""
        pages = self._open.pop(owner, None)
        if not pages:
            return None
        stamp = next(self._stamps)
        self._closed[stamp] = pages
        for vid in pages:
            self._unit[vid] = (self._closed, stamp)
        if info is not None:
            self.info[stamp] = info
        return stamp

    def remove(self, vid: int) -> bool:
        """Take a page out (hit, evicted, reset); False if it was not cached free."""
        where = self._unit.pop(vid, None)
        if where is None:
            return False
        units, key = where
        if units is None:
            del self._first[vid]
        else:
            pages = units[key]
            del pages[vid]
            if not pages:
                del units[key]
                if units is self._closed:
                    self.info.pop(key, None)
        self.nbytes -= self._bytes.pop(vid)
        return True

    def units(self) -> Iterable[tuple[int | None, list[int]]]:
        """(stamp, vids in leaving order) of every unit, in the order units leave: the
        speculative pages (oldest first, stamp None), released units by stamp (highest end
        token first), then open ones (stamp None)."""
        if self._first:
            yield None, list(self._first)
        for stamp, pages in list(self._closed.items()):
            yield stamp, sorted(pages, key=lambda v: -pages[v])
        for pages in list(self._open.values()):
            yield None, sorted(pages, key=lambda v: -pages[v])

    def victims(self, short_bytes: int, keep: set[int] = frozenset()
                ) -> tuple[list[int], int | None, int]:
        """The pages to evict for ``short_bytes`` more free bytes, in leaving order (never
        one in ``keep``): (vids, the stamp of the unit the last one cut into or None if it
        was taken whole or is open, the lowest end token taken from that unit)."""
        out: list[int] = []
        if short_bytes <= 0:
            return out, None, 0
        for stamp, vids in self.units():
            for i, vid in enumerate(vids):
                if vid in keep:
                    continue
                out.append(vid)
                short_bytes -= self._bytes[vid]
                if short_bytes <= 0:
                    left = [v for v in vids[i + 1:] if v not in keep]
                    if not left or stamp is None:
                        return out, None, 0
                    return out, stamp, self.end_token(vid)
        return out, None, 0

    def end_token(self, vid: int) -> int:
        units, key = self._unit[vid]
        return self._first[vid] if units is None else units[key][vid]

    def remaining(self, stamp: int, from_token: int) -> list[int]:
        """The pages of released unit ``stamp`` that end after ``from_token`` (those a hit of
        at most ``from_token`` tokens cannot use)."""
        pages = self._closed.get(stamp, {})
        return [v for v, end in pages.items() if end > from_token]

    def clear(self) -> list[int]:
        """Empty the cache; returns the vids it held."""
        vids = list(self._unit)
        self.__init__()
        return vids
