"""Placement and movement plans inside one band, in band coordinates.

Band coordinates put the band's base at 0 and grow away from it: the identity for the low band,
``total - offset - size`` for the high band, so one code path serves both ends. Functions here
are pure (arrays in, plans out); :class:`~.arena.Arena` applies them.
"""

from __future__ import annotations

import numpy as np

from .free_space import FreeSpace
from .kinds import Band


def to_band(band: Band, total: int, offsets, sizes):
    """Map real byte offsets of objects of ``sizes`` into band coordinates (an involution)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    return offsets if band is Band.LOW else total - offsets - np.asarray(sizes, dtype=np.int64)


def place(free: FreeSpace, band: Band, n: int, size: int, best_fit: bool = False,
          ) -> tuple[list[int], list[tuple[int, int]]] | None:
    """Take ``n`` pages of ``size`` bytes for ``band``: holes nearest the base first, then the
    band end; with ``best_fit``, the smallest of the holes and the middle that holds pages
    first. Returns (offsets, removed extents), in lists (a step places a few pages), or None,
    leaving ``free`` untouched."""
    if n == 0:
        return [], []
    taken: list[tuple[int, int]] = []
    out: list[int] = []
    left = n
    low = band is Band.LOW
    holes: list = [*free.holes(band), None]  # None: the middle, at the band end
    if best_fit:
        holes.sort(key=lambda h: free.middle if h is None else h[1] - h[0])
    for h in holes:
        if h is None:  # the band end: pages extend the band into the middle
            k = min(left, free.middle // size)
            if k == 0:
                continue
            start = free.low_top if low else free.high_bottom - k * size
        else:
            a, b = h
            k = min(left, (b - a) // size)
            if k == 0:
                continue
            start = a if low else b - k * size
        free.remove(start, k * size, band)
        taken.append((start, k * size))
        # Pages nearest the base come first so a band's pages stay ordered by distance from it.
        out.extend(range(start, start + k * size, size) if low
                   else range(start + (k - 1) * size, start - 1, -size))
        left -= k
        if left == 0:
            return out, taken
    for start, nbytes in reversed(taken):
        free.add(start, nbytes)
    return None


def plan_fill_holes(holes: list[tuple[int, int]], offs: np.ndarray, size: int):
    """Compaction of one kind (band coordinates): move the pages farthest from the base into
    the holes nearest to it, never outward. Destinations are free bytes only, so the moves
    are independent of one another.

    Returns (indices into ``offs`` of moved pages, their destinations, extents taken,
    holes left)."""
    order = np.argsort(-offs, kind="stable")
    neg = -offs[order]  # ascending
    j, moved, dsts, taken, left = 0, [], [], [], []
    for hi, (a, b) in enumerate(holes):
        cap = (b - a) // size
        if cap == 0:
            left.append((a, b))
            continue
        above = int(np.searchsorted(neg, -b, side="right")) - j  # pages lying wholly above
        if above <= 0:
            left.extend(holes[hi:])
            break
        k = min(cap, above)
        moved.append(order[j:j + k])
        dsts.append(a + size * np.arange(k, dtype=np.int64))
        taken.append((a, k * size))
        j += k
        if a + k * size < b:
            left.append((a + k * size, b))
    if not moved:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), [], left
    return np.concatenate(moved), np.concatenate(dsts), taken, left


def plan_slide(offs: np.ndarray, sizes: np.ndarray, movable: np.ndarray):
    """Relayout of one band (band coordinates): slide every movable object toward the base,
    in address order, over every gap; immovable objects (fenced pages, withheld bytes) stay.

    Returns (moves as (index, dst) pairs in execution order, copy steps). A destination may
    overlap sources of earlier moves or its own source; the steps order those copies (a page
    overlapping itself is copied in chunks of its shift, nearest the base first)."""
    order = np.argsort(offs, kind="stable")
    cursor, moves, steps, cur, cur_src_end = 0, [], [], [], -1
    for i in order.tolist():
        s, n = int(offs[i]), int(sizes[i])
        if not movable[i]:
            cursor = max(cursor, s + n)
            continue
        t, cursor = cursor, cursor + n
        if t == s:
            continue
        moves.append((i, t))
        d = s - t
        chunks = [(s, t, n)] if d >= n else [(s + o, t + o, min(d, n - o)) for o in range(0, n, d)]
        for cs, cd, cn in chunks:
            if cd < cur_src_end:  # would overwrite a source this step still reads
                steps.append(cur)
                cur, cur_src_end = [], -1
            cur.append((cs, cd, cn))
            cur_src_end = max(cur_src_end, cs + cn)
    if cur:
        steps.append(cur)
    return moves, [np.asarray(s, dtype=np.int64) for s in steps]


def mirror_copies(band: Band, total: int, step: np.ndarray) -> np.ndarray:
    if band is Band.LOW or not len(step):
        return step
    n = step[:, 2]
    return np.stack([total - step[:, 0] - n, total - step[:, 1] - n, n], axis=1)
