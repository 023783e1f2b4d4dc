"""The order free-but-cached pages leave the arena's prefix cache (``arena.cache``, no vLLM):
units of one request's pages, least recently released first, each from the end of its prompt
backwards with every kind together; running requests' pages after every released unit;
speculative pages first."""
from __future__ import annotations

import pytest

from ulacache_vllm.arena.cache import CachedPages

KB = 1024


def _release(cache: CachedPages, owner, pages, info=None):
    """``pages``: (vid, bytes, end token) released by ``owner`` together."""
    for vid, nbytes, end in pages:
        cache.add(vid, nbytes, end, owner)
    return cache.close(owner, info)


def test_units_leave_least_recently_released_first_each_from_its_end_backwards():
    c = CachedPages()
    # Request A: full pages ending at 32..128 (2 KiB) and window pages ending at 96, 128
    # (8 KiB): released first. Then B.
    a = _release(c, "A", [(1, 2 * KB, 32), (2, 2 * KB, 64), (3, 2 * KB, 96), (4, 2 * KB, 128),
                          (10, 8 * KB, 96), (11, 8 * KB, 128)], info="hashes of A")
    b = _release(c, "B", [(5, 2 * KB, 32), (6, 2 * KB, 64)])
    assert len(c) == 8 and c.nbytes == 28 * KB
    order = [(stamp, vids) for stamp, vids in c.units()]
    assert [s for s, _ in order] == [a, b]
    # Highest end token first, both kinds of a position together.
    assert [c.end_token(v) for v in order[0][1]] == [128, 128, 96, 96, 64, 32]
    assert set(order[0][1][:2]) == {4, 11} and set(order[0][1][2:4]) == {3, 10}
    assert c.info[a] == "hashes of A" and b not in c.info


def test_victims_take_just_the_bytes_needed_never_a_kept_page():
    c = CachedPages()
    a = _release(c, "A", [(1, 2 * KB, 32), (2, 2 * KB, 64), (3, 2 * KB, 96), (4, 2 * KB, 128)])
    _release(c, "B", [(5, 2 * KB, 32)])
    assert c.victims(0) == ([], None, 0)
    vids, cut, lowest = c.victims(3 * KB)  # two pages of A, from its end; A is cut
    assert vids == [4, 3] and cut == a and lowest == 96
    vids, cut, _ = c.victims(3 * KB, keep={4})  # a page this admission hits stays
    assert vids == [3, 2] and cut == a
    vids, cut, _ = c.victims(8 * KB)  # all of A: not cut (nothing of it left)
    assert vids == [4, 3, 2, 1] and cut is None
    vids, cut, _ = c.victims(9 * KB)  # into B, taken whole
    assert vids == [4, 3, 2, 1, 5] and cut is None
    assert c.victims(99 * KB)[0] == [4, 3, 2, 1, 5]  # all there is
    assert sorted(c.remaining(a, 64)) == [3, 4]  # what a 64-token hit of A cannot use


def test_a_running_requests_pages_leave_after_every_released_unit():
    c = CachedPages()
    c.add(20, 2 * KB, 96, "R")  # R is running: a window page slid out of its window
    a = _release(c, "A", [(1, 2 * KB, 32)])
    assert [s for s, _ in c.units()] == [a, None]
    assert c.victims(2 * KB) == ([1], None, 0)
    assert c.victims(4 * KB)[0] == [1, 20]
    # R is done: its window page joins its other pages, the most recently released unit.
    r = _release(c, "R", [(21, 2 * KB, 128)])
    assert [(s, v) for s, v in c.units()] == [(a, [1]), (r, [21, 20])]


def test_speculative_pages_leave_before_anything_else_oldest_first():
    c = CachedPages()
    a = _release(c, "A", [(1, 2 * KB, 32)])
    c.add(30, 8 * KB, 64, "R", first=True)  # running or not: first to go
    c.add(31, 8 * KB, 96, None, first=True)
    assert [(s, v) for s, v in c.units()] == [(None, [30, 31]), (a, [1])]
    assert c.victims(9 * KB) == ([30, 31], None, 0)
    assert c.close("R") is None  # R had no other page: no unit
    assert c.remove(30) and not c.remove(30)
    assert [(s, v) for s, v in c.units()] == [(None, [31]), (a, [1])]


def test_a_hit_takes_a_page_out_and_its_next_release_puts_it_in_the_new_unit():
    c = CachedPages()
    a = _release(c, "A", [(1, 2 * KB, 32), (2, 2 * KB, 64)], info="A")
    assert c.remove(1)  # B hits page 1 (and holds it)
    assert c.nbytes == 2 * KB and 1 not in c and 2 in c
    b = _release(c, "B", [(1, 2 * KB, 32), (7, 2 * KB, 64)])
    assert [(s, v) for s, v in c.units()] == [(a, [2]), (b, [7, 1])]
    assert c.remove(2) and a not in c.info  # A's last page gone: its unit and info too
    with pytest.raises(KeyError):
        c.add(7, 2 * KB, 64, "C")  # already cached free
    assert sorted(c.clear()) == [1, 7] and len(c) == 0 and c.nbytes == 0
