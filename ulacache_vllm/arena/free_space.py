"""Free byte extents of the arena and the two band boundaries.

Low-band objects (live pages and fenced, not yet reusable extents) all lie below
``low_top``; high-band objects all lie at or above ``high_bottom``; ``[low_top, high_bottom)``
is the free middle, always a single coalesced extent. Free extents below ``low_top`` are holes
of the low band, those above ``high_bottom`` holes of the high band.
"""

from __future__ import annotations

import bisect

from .kinds import Band


class FreeSpace:
    def __init__(self, total: int) -> None:
        self.total = total
        self._starts: list[int] = [0] if total else []
        self._end: dict[int, int] = {0: total} if total else {}
        self._start_of_end: dict[int, int] = {total: 0} if total else {}
        self.low_top = 0
        self.high_bottom = total
        self.free_bytes = total

    def copy(self) -> "FreeSpace":
        new = object.__new__(FreeSpace)
        new.__dict__.update(self.__dict__)
        new._starts, new._end = list(self._starts), dict(self._end)
        new._start_of_end = dict(self._start_of_end)
        return new

    # -- queries -----------------------------------------------------------------------------
    def extents(self) -> list[tuple[int, int]]:
        return [(s, self._end[s]) for s in self._starts]

    def holes(self, band: Band) -> list[tuple[int, int]]:
        """Free extents of one band, nearest to that band's base first."""
        if band is Band.LOW:
            i = bisect.bisect_left(self._starts, self.low_top)
            return [(s, self._end[s]) for s in self._starts[:i]]
        i = bisect.bisect_right(self._starts, self.high_bottom)
        return [(s, self._end[s]) for s in reversed(self._starts[i:])]

    @property
    def middle(self) -> int:
        return self.high_bottom - self.low_top

    def largest(self) -> int:
        return max((self._end[s] - s for s in self._starts), default=0)

    # -- updates -----------------------------------------------------------------------------
    def add(self, start: int, nbytes: int) -> None:
        """Return ``[start, start+nbytes)`` to the free set, coalescing with neighbours."""
        end = start + nbytes
        i = bisect.bisect_left(self._starts, start)
        if (i < len(self._starts) and self._starts[i] < end) or (
                i > 0 and self._end[self._starts[i - 1]] > start):
            raise AssertionError(f"double free of [{start}, {end})")
        a, b = start, end
        if start in self._start_of_end:  # an extent ends exactly where this one starts
            a = self._start_of_end.pop(start)
            del self._end[a]
            i -= 1
            del self._starts[i]
        if end in self._end:
            b = self._end.pop(end)
            del self._start_of_end[b]
            del self._starts[i]
        self._starts.insert(i, a)
        self._end[a] = b
        self._start_of_end[b] = a
        self.free_bytes += nbytes
        # Anything that touches the middle (or the meeting point when it is empty) becomes it.
        if a <= self.low_top and b >= self.high_bottom:
            self.low_top, self.high_bottom = a, b

    def remove(self, start: int, nbytes: int, band: Band) -> None:
        """Take ``[start, start+nbytes)`` (must be free) for an object of ``band``."""
        end = start + nbytes
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0 or self._end[self._starts[i]] < end:
            raise AssertionError(f"[{start}, {end}) is not free")
        a = self._starts[i]
        b = self._end.pop(a)
        del self._start_of_end[b]
        del self._starts[i]
        if end < b:
            self._starts.insert(i, end)
            self._end[end] = b
            self._start_of_end[b] = end
        if a < start:
            self._starts.insert(i, a)
            self._end[a] = start
            self._start_of_end[start] = a
        self.free_bytes -= nbytes
        if a == self.low_top and b == self.high_bottom:  # carved out of the middle
            if band is Band.LOW:
                if start != a:
                    raise AssertionError("low object must extend the low band end")
                self.low_top = end
                if end == b:
                    self.high_bottom = end
            else:
                if end != b:
                    raise AssertionError("high object must extend the high band end")
                self.high_bottom = start
                if start == a:
                    self.low_top = start
        elif band is Band.LOW and start >= self.high_bottom or (
                band is Band.HIGH and end <= self.low_top):
            raise AssertionError(f"{band} object placed in the other band")
