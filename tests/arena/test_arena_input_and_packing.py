"""Regressions from black-box testing of the arena: bad input is refused before it changes
anything, a shortfall changes nothing, and admissions that fit are not refused because one
greedy packing or one compaction pass missed them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ulacache_vllm.arena import (COMPACT, SHORTFALL, Arena, Band, KindSpec, RowSpec,
                                 state_kind)

from ._model import Shadow

U = 256


def kind(name, band, nbytes, dtype="uint8"):
    return KindSpec(name, band, (RowSpec("r", (nbytes,), dtype),))


def layout(a: Arena):
    vids, offs, _ = a.live_pages()
    return vids.tolist(), offs.tolist(), a.free_extents(), a.band_bounds, a.free_bytes


def test_grow_refuses_negative_and_fractional_counts():
    a = Arena(8 * U, [kind("full", Band.HIGH, U), kind("swa", Band.LOW, U)], alignment=U)
    a.admit("r", {"swa": 1})
    before = layout(a)
    with pytest.raises(ValueError, match="negative demand"):
        a.grow("r", "swa", -1)
    with pytest.raises(ValueError, match="integer"):
        a.grow("r", "swa", 1.5)
    with pytest.raises(ValueError, match="integer"):
        a.admit("s", {"swa": 1.7})
    assert layout(a) == before and a.requests() == ["r"]
    assert a.grow("r", "swa", np.int64(2)).ok  # numpy integers are integers


def test_bad_kinds_and_arenas_are_refused():
    with pytest.raises(ValueError, match="no bytes"):
        KindSpec("z", Band.LOW, (RowSpec("r", (0,), "uint8"),))
    with pytest.raises(ValueError, match="non-negative"):
        RowSpec("r", (-4,), "uint8")
    with pytest.raises(ValueError, match="unknown dtype"):
        RowSpec("r", (4,), "float7")
    with pytest.raises(ValueError, match="band"):
        KindSpec("k", "middle", (RowSpec("r", (4,), "uint8"),))
    assert KindSpec("k", "high", (RowSpec("r", (4,), "uint8"),)).band is Band.HIGH
    with pytest.raises(ValueError, match="2 shapes but 1 dtypes"):
        state_kind("gdn", 2, ((3,), (4,)), ("float32",))
    with pytest.raises(ValueError, match="total_bytes"):
        Arena(-4096, [kind("f", Band.HIGH, U)])
    with pytest.raises(ValueError, match="integer"):
        Arena(4096.0, [kind("f", Band.HIGH, U)])
    with pytest.raises(ValueError, match="integer"):
        Arena(4096, [kind("f", Band.HIGH, U)], alignment=2.5)
    a = Arena(4 * U, [kind("f", Band.HIGH, U)], alignment=U)
    r = a.admit("x", {"f": 1})
    with pytest.raises(ValueError, match="integers"):
        a.v2p([0.9])
    with pytest.raises(ValueError, match="integers"):
        a.shrink("x", "f", [float(r.vids["f"][0])])


def test_alignment_below_an_item_size_still_aligns_rows():
    odd = KindSpec("state", Band.LOW, (RowSpec("conv", (3,), "uint8"),))
    f32 = KindSpec("swa", Band.LOW, (RowSpec("kv", (4,), "float32"),))
    a = Arena(1024, [odd, f32], alignment=1)
    assert a.alignment == 4
    a.admit("x", {"state": 1})
    r = a.admit("y", {"swa": 1})
    off = int(a.v2p(r.vids["swa"])[0]) + f32.row_offset("kv")
    assert off % 4 == 0
    buf = torch.zeros(a.total_bytes, dtype=torch.uint8)
    buf[off:off + 16].view(torch.float32)[:] = torch.arange(4.0)  # a dtype view works


def test_a_fence_of_another_arena_is_refused():
    a = Arena(4096, [kind("f", Band.HIGH, U)], alignment=U)
    b = Arena(4096, [kind("f", Band.HIGH, U)], alignment=U)
    rb = b.admit("x", {"f": 1})
    with pytest.raises(ValueError, match="not made by this arena"):
        b.register_use(rb.vids["f"], a.fence("a's"))
    b.free("x")
    assert b.free_bytes == b.total_bytes


def test_shortfall_after_moves_rolls_them_back():
    a = Arena(6 * U, [kind("A", Band.LOW, U), kind("H", Band.HIGH, 2 * U)], alignment=U)
    a.admit("r1", {"A": 1})
    r2 = a.admit("r2", {"A": 1})
    r3 = a.admit("r3", {"A": 1})
    a.register_use(r3.vids["A"], a.fence("fwd"))  # pins [2U, 3U)
    a.free("r1")  # hole [0, U): 4U free, but no 4U run the high band can reach
    before, stats = layout(a), dict(a.stats)
    res = a.admit("r4", {"H": 2})
    assert not res.ok and res.step == SHORTFALL and not res.copy_plan
    assert layout(a) == before and a.stats["shortfalls"] == stats["shortfalls"] + 1
    assert a.v2p(r2.vids["A"]).tolist() == [U]


def test_compaction_repeats_while_its_own_moves_merge_holes():
    a = Arena(8 * U, [kind("A", Band.LOW, U), kind("B", Band.LOW, 2 * U),
                      kind("H", Band.HIGH, 2 * U)], alignment=U)
    sh = Shadow(a)
    for rid, dem in (("g1", {"A": 1}), ("P", {"A": 1}), ("g2", {"A": 1}), ("F", {"A": 1}),
                     ("Q", {"B": 1})):
        sh.write_new(a.admit(rid, dem).vids)
    sh.register(a.pages("F", "A"), a.fence("fwd"))  # pins [3U, 4U)
    for rid in ("g1", "g2"):  # holes [0, U) and [2U, 3U); Q at [4U, 6U); middle [6U, 8U)
        sh.forget(a.pages(rid, "A"))
        a.free(rid)
    res = a.admit("r", {"H": 2})  # 4U needed, 4U free: P to [0, U), then Q to [U, 3U)
    assert res.ok and res.step == COMPACT and len(res.copy_plan.steps) == 2
    sh.apply(res.copy_plan)
    sh.write_new(res.vids)
    sh.check()


def test_a_second_packing_places_what_largest_first_into_holes_misses():
    a = Arena(12 * U, [kind("A", Band.LOW, 2 * U), kind("B", Band.LOW, 3 * U),
                       kind("H", Band.HIGH, U)], alignment=U)
    a.admit("r1", {"A": 2})  # [0, 4U)
    r2 = a.admit("r2", {"A": 1})  # [4U, 6U), pinned below
    a.admit("r3", {"H": 3})  # [9U, 12U)
    a.register_use(r2.vids["A"], a.fence("fwd"))
    a.free("r1")  # hole [0, 4U), middle [6U, 9U): A, A in the hole and B in the middle fit
    res = a.admit("r4", {"A": 2, "B": 1})
    assert res.ok and not res.copy_plan
    assert sorted(a.v2p(res.vids["A"]).tolist()) == [0, 2 * U]
    assert a.v2p(res.vids["B"]).tolist() == [6 * U]


def test_a_refused_demand_is_retried_cheaply_until_something_changes(monkeypatch):
    a = Arena(6 * U, [kind("A", Band.LOW, U), kind("H", Band.HIGH, 2 * U)], alignment=U)
    a.admit("r1", {"A": 1})
    a.admit("r2", {"A": 1})
    r3 = a.admit("r3", {"A": 1})
    fence = a.fence("fwd")
    a.register_use(r3.vids["A"], fence)  # pins [2U, 3U)
    a.free("r1")
    assert not a.admit("r4", {"H": 2}).ok
    calls = []
    monkeypatch.setattr(a, "compact", lambda: calls.append(1) or Arena.compact(a))
    res = a.admit("r4", {"H": 2})  # nothing changed: refused without another ladder
    assert not res.ok and res.shortfall_bytes > 0 and not calls
    fence.complete()  # the pinned page may move now
    res = a.admit("r4", {"H": 2})
    assert res.ok and calls and res.copy_plan


def test_an_error_inside_the_ladder_leaves_the_tables_as_they_were(monkeypatch):
    a = Arena(6 * U, [kind("A", Band.LOW, U), kind("H", Band.HIGH, 2 * U)], alignment=U)
    for r in ("r1", "r2", "r3"):
        a.admit(r, {"A": 1})
    a.free("r1")
    before = layout(a)
    real = Arena.relayout

    def broken(self):
        real(self)
        raise RuntimeError("boom")
    monkeypatch.setattr(Arena, "relayout", broken)
    monkeypatch.setattr(Arena, "compact", lambda self: __import__(
        "ulacache_vllm.arena.copy_plan", fromlist=["CopyPlan"]).CopyPlan())
    with pytest.raises(RuntimeError, match="boom"):
        a.admit("r4", {"H": 2})
    assert layout(a) == before


def test_pages_moved_counts_pages_not_chunk_copies():
    """A page slid down over a smaller hole takes several chunk copies but is one page."""
    small = KindSpec("s", Band.LOW, (RowSpec("r", (64,), "uint8"),))
    big = KindSpec("b", Band.LOW, (RowSpec("r", (256,), "uint8"),))
    a = Arena(4096, [small, big], alignment=64)
    a.admit("x", {"s": 1})
    a.admit("y", {"b": 1})
    a.free("x")
    plan = a.relayout()
    assert len(plan) > 1  # chunked slide
    assert a.stats["pages_moved"] == 1 and a.stats["bytes_copied"] == 256


def test_bool_kind_keys_and_negative_rows_are_refused():
    one = lambda n, b: KindSpec(n, b, (RowSpec("r", (64,), "uint8"),))
    a = Arena(1024, [one("w", Band.LOW), one("f", Band.HIGH)], alignment=64)
    with pytest.raises(KeyError):
        a.admit(1, {True: 2})  # not "kind #1"
    assert a.used_bytes == 0
    with pytest.raises(ValueError, match="entries_per_page"):
        KindSpec("k", Band.LOW, (RowSpec("a", (4,), "uint8"),), True)
    k = KindSpec("k", Band.LOW, (RowSpec("a", (4,), "uint8"), RowSpec("b", (4,), "uint8")), 2)
    assert k.row_offset(1) == k.row_offset("b")
    for bad in (-1, 2):
        with pytest.raises(IndexError):
            k.row_offset(bad)


def test_placement_version_names_one_placement():
    """Every change of placement gives a new version (never an earlier one back); fences,
    polls and a refused demand on an unchanged arena leave it."""
    a = Arena(6 * U, [kind("A", Band.LOW, U), kind("H", Band.HIGH, 2 * U)], alignment=U)
    seen = {a.placement_version: a.placement()[0].copy()}

    def step(changed: bool) -> None:
        v, v2p = a.placement_version, a.placement()[0].copy()
        if not changed:
            assert v == max(seen) and np.array_equal(v2p, seen[v])
            return
        assert v > max(seen), (v, sorted(seen))
        seen[v] = v2p

    a.admit("r1", {"A": 1})
    step(True)
    a.admit("r2", {"A": 1})
    step(True)
    r3 = a.admit("r3", {"A": 1})
    step(True)
    a.register_use(r3.vids["A"], a.fence("fwd"))
    a.ledger.poll()
    step(False)
    a.free("r1")
    step(True)
    res = a.admit("r4", {"H": 2})  # moves pages, finds no room, rolls them back
    assert not res.ok
    step(True)  # the same tables as before, under a version of their own
    assert a.admit("r4", {"H": 2}).ok is False  # refused again, nothing tried
    step(False)
    if a.compact():
        step(True)
    a.free("r2")
    step(True)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 3),
                              st.integers(0, 3), st.integers(0, 10 ** 6)),
                    min_size=1, max_size=60))
def test_take_places_as_allocates_first_rung(ops):
    """``take`` (the manager's common path, in lists) puts pages where ``allocate`` does on
    the same arena, with the same vids, whenever ``allocate`` places them without a move;
    where it returns None ``allocate`` needed more than the default packing (a move, another
    packing, or the bytes are missing) and nothing changed. Releases of plain-int lists and
    of arrays leave the same tables (free extents, bands, vids to recycle)."""
    kinds = [kind("null", Band.LOW, U), kind("sw", Band.LOW, 2 * U), kind("st", Band.LOW, 3 * U),
             kind("full", Band.HIGH, 2 * U)]
    a, b = Arena(40 * U, kinds, alignment=U), Arena(40 * U, kinds, alignment=U)
    held: list[int] = []
    for free_some, n1, n2, n3, pick in ops:
        if free_some and held:  # free a few pages, the same on both
            drop = [held.pop(pick % len(held)) for _ in range(min(len(held), 1 + pick % 3))]
            a.release(drop)  # plain ints: the list path
            b.release(np.asarray(drop, np.int64))  # the array path
            continue
        dem = {k: n for k, n in ((1, n1), (2, n2), (3, n3)) if n}
        if not dem:
            continue
        before = layout(a)
        got = a.take(dem)
        res = b.allocate(dem)
        if got is None:
            assert layout(a) == before
            res_a = a.allocate(dem)  # the manager's fallback: the whole ladder
            assert res_a.ok == res.ok
            if res.ok:
                for k in dem:
                    name = kinds[k].name
                    assert res_a.virtual_page_ids[name].tolist() == \
                        res.virtual_page_ids[name].tolist()
                    held.extend(res.virtual_page_ids[name].tolist())
        else:
            assert res.ok and not res.copy_plan, "take placed what allocate had to move for"
            for k in dem:
                assert got[k] == res.virtual_page_ids[kinds[k].name].tolist()
                held.extend(got[k])
        assert layout(a) == layout(b)
        assert a.v2p(held).tolist() == b.v2p(held).tolist()
