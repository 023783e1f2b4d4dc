"""Virtual page ids: stable handles for callers, with the v2p / p2v tables that change on moves.

Callers (block tables, prefix cache, connectors) hold virtual ids only; compaction and relayout
rewrite ``v2p`` and ``p2v`` here and nowhere else. Freed ids are recycled. ``version`` counts
the changes of the tables (allocate, release, move).
"""

from __future__ import annotations

import numpy as np

UNMAPPED = -1


def as_ids(ids) -> np.ndarray:
    """Ids (virtual page ids, byte offsets) as int64; non-integers are refused, not truncated."""
    arr = np.asarray(ids)
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"ids must be integers, got {arr.dtype} values {arr.ravel()[:8].tolist()}")
    return arr.astype(np.int64, copy=False)


class VirtualIds:
    def __init__(self, capacity: int = 1024) -> None:
        self._v2p = np.full(capacity, UNMAPPED, dtype=np.int64)
        self._kind = np.full(capacity, -1, dtype=np.int32)
        self._p2v: dict[int, int] = {}
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self.version = 0

    def copy(self) -> "VirtualIds":
        new = object.__new__(VirtualIds)
        new._v2p, new._kind = self._v2p.copy(), self._kind.copy()
        new._p2v, new._free = dict(self._p2v), list(self._free)
        new.version = self.version
        return new

    def __len__(self) -> int:
        return len(self._p2v)

    def _grow(self, need: int) -> None:
        old = len(self._v2p)
        new = max(2 * old, old + need)
        self._v2p = np.concatenate([self._v2p, np.full(new - old, UNMAPPED, np.int64)])
        self._kind = np.concatenate([self._kind, np.full(new - old, -1, np.int32)])
        self._free[:0] = range(new - 1, old - 1, -1)

    def allocate(self, offsets: list[int], kind: int) -> list[int]:
        """Vids for pages of ``kind`` at byte ``offsets`` (recycled ids first)."""
        n = len(offsets)
        if n > len(self._free):
            self._grow(n - len(self._free))
        self.version += 1
        free, v2p, kinds, p2v = self._free, self._v2p, self._kind, self._p2v
        vids = free[len(free) - n:][::-1]
        del free[len(free) - n:]
        for v, p in zip(vids, offsets):
            v2p[v] = p
            kinds[v] = kind
            p2v[p] = v
        return vids

    def release(self, vids: np.ndarray) -> np.ndarray:
        offs = self.v2p(vids)
        self.version += 1
        for p in offs.tolist():
            del self._p2v[p]
        self._v2p[vids] = UNMAPPED
        self._kind[vids] = -1
        self._free.extend(np.asarray(vids).tolist()[::-1])
        return offs

    def release_list(self, vids: list[int]) -> tuple[list[int], list[int]] | None:
        """:meth:`release` for a few plain-int vids, in lists: (offsets, kinds); None (nothing
        changed) if one is not a plain int (:meth:`release` checks those)."""
        v2p, kinds, n = self._v2p, self._kind, len(self._v2p)
        offs, ks = [], []
        for v in vids:
            if type(v) is not int:
                return None
            if not 0 <= v < n:
                raise KeyError("virtual page id out of range")
            p = int(v2p[v])
            if p == UNMAPPED:
                raise KeyError(f"unmapped virtual page ids {[v]}")
            offs.append(p)
            ks.append(int(kinds[v]))
        self.version += 1
        p2v = self._p2v
        for p in offs:
            del p2v[p]
        for v in vids:
            v2p[v] = UNMAPPED
            kinds[v] = -1
        self._free.extend(vids[::-1])
        return offs, ks

    def move(self, vids: np.ndarray, new_offsets: np.ndarray) -> None:
        old = self.v2p(vids)
        self.version += 1
        for p in old.tolist():
            del self._p2v[p]
        for v, p in zip(np.asarray(vids).tolist(), np.asarray(new_offsets).tolist()):
            if p in self._p2v:
                raise AssertionError(f"physical page {p} already mapped")
            self._p2v[p] = v
        self._v2p[vids] = new_offsets

    def v2p(self, vids) -> np.ndarray:
        vids = as_ids(vids)
        if vids.size and (vids.min() < 0 or vids.max() >= len(self._v2p)):
            raise KeyError("virtual page id out of range")
        offs = self._v2p[vids]
        if (offs == UNMAPPED).any():
            raise KeyError(f"unmapped virtual page ids {vids[offs == UNMAPPED][:8].tolist()}")
        return offs

    def p2v(self, offsets) -> np.ndarray:
        return np.array([self._p2v[int(p)] for p in as_ids(offsets).ravel()], dtype=np.int64)

    def check_mapped(self, offsets: list[int]) -> None:
        """Raises KeyError for any byte offset that is no live page's."""
        p2v = self._p2v
        for p in offsets:
            if p not in p2v:
                raise KeyError(p)

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """Views of (v2p, kind) over every vid (UNMAPPED / -1 where unmapped)."""
        return self._v2p.view(), self._kind.view()

    def kind_of(self, vids) -> np.ndarray:
        return self._kind[as_ids(vids)]

    def live(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(vids, offsets, kind index) of every mapped page."""
        vids = np.flatnonzero(self._v2p != UNMAPPED)
        return vids, self._v2p[vids], self._kind[vids]
