"""Deterministic scenarios for the arena: band placement, each ladder step, ledger, kinds."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ulacache_vllm.arena import (COMPACT, RELAYOUT, REUSE, SHORTFALL, Arena, Band, KindSpec,
                                 RowSpec, attention_kind, state_kind)

from ._model import Shadow

U = 64  # bytes per unit in these scenarios


def kinds():
    return [KindSpec("full", Band.HIGH, (RowSpec("kv", (U,), "uint8"),)),
            KindSpec("swa", Band.LOW, (RowSpec("kv", (2 * U,), "uint8"),)),
            KindSpec("state", Band.LOW, (RowSpec("s", (U,), "uint8"),))]


def test_kinds_keep_natural_page_sizes_and_row_layout():
    full = attention_kind("full", Band.HIGH, num_layers=3, num_kv_heads=2, head_size=8,
                          tokens_per_page=16)
    assert full.entry_bytes == 3 * 2 * 16 * 2 and full.natural_page_bytes == 16 * full.entry_bytes
    st = state_kind("gdn", 2, ((3, 5), (2, 4, 4)), ("bfloat16", "float32"))
    # bf16 row of 30 bytes, then an fp32 row aligned to 4 bytes.
    assert st.row_offsets[:2] == (0, 32) and st.entry_bytes == 2 * (32 + 128)
    assert st.page_bytes(256) == 512 and full.page_bytes(256) == full.natural_page_bytes
    assert full.row_offset("layer1", entry=2) == 2 * full.entry_bytes + 64
    arena = Arena(1 << 20, [full, st], alignment=256)
    assert arena.page_bytes == [full.natural_page_bytes, 512]  # no common page size


def test_bands_grow_from_both_ends_and_holes_are_reused_in_place():
    a = Arena(20 * U, kinds(), alignment=U)
    r = a.admit("a", {"full": 2, "swa": 1, "state": 1})
    assert r.ok and r.step == REUSE and not r.copy_plan
    assert sorted(a.v2p(r.vids["full"]).tolist()) == [18 * U, 19 * U]
    assert a.v2p(r.vids["swa"]).tolist() == [0] and a.v2p(r.vids["state"]).tolist() == [2 * U]
    assert a.band_bounds == (3 * U, 18 * U)
    b = a.admit("b", {"state": 1, "full": 1})
    a.shrink("a", "state", r.vids["state"])
    a.shrink("a", "full", r.vids["full"][:1])
    c = a.admit("c", {"state": 1, "full": 1})
    assert c.step == REUSE and not c.copy_plan
    assert a.v2p(c.vids["state"]).tolist() == [2 * U]  # the hole, not the band end
    assert a.v2p(c.vids["full"]).tolist() == [19 * U]
    assert b.ok


def test_compaction_packs_the_ends_and_preserves_bytes():
    a = Arena(12 * U, kinds(), alignment=U)
    sh = Shadow(a)
    for i in range(6):
        r = a.admit(i, {"state": 1, "full": 1})
        sh.write_new(r.vids)
    for i in (0, 2, 4):
        sh.forget(np.concatenate([a.pages(i, 0), a.pages(i, 2)]))
        a.free(i)
    assert a.free_bytes == 6 * U and a.largest_free_extent() == U
    r = a.admit("big", {"full": 6})
    assert r.ok and r.step == COMPACT
    # Two far state pages and two far full pages move into their bands' holes; nothing else.
    assert r.copy_plan.nbytes == 4 * U and len(r.copy_plan.steps) == 1
    sh.apply(r.copy_plan)
    sh.write_new(r.vids)
    sh.check()
    assert a.band_bounds == (3 * U, 3 * U)


def test_relayout_when_holes_are_too_small_for_any_page_above():
    a = Arena(12 * U, kinds(), alignment=U)
    sh = Shadow(a)
    # Low band: [state][swa][state][swa][state][swa] = 9 units; free the states.
    for i in range(3):
        sh.write_new(a.admit(("s", i), {"state": 1}).vids)
        sh.write_new(a.admit(("w", i), {"swa": 1}).vids)
    for i in range(3):
        sh.forget(a.pages(("s", i), "state"))
        a.free(("s", i))
    assert a.band_bounds == (9 * U, 12 * U)
    r = a.admit("new", {"full": 6})
    assert r.ok and r.step == RELAYOUT
    assert len(r.copy_plan.steps) >= 1 and r.copy_plan.nbytes > 0
    sh.apply(r.copy_plan)
    sh.write_new(r.vids)
    sh.check()
    assert sorted(a.v2p(np.concatenate([a.pages(("w", i), "swa") for i in range(3)])).tolist()) \
        == [0, 2 * U, 4 * U]


def test_shortfall_moves_nothing_when_bytes_are_missing():
    a = Arena(10 * U, kinds(), alignment=U)
    a.admit("x", {"swa": 2, "state": 1})
    a.admit("y", {"state": 1})
    a.free("y")
    before = a.v2p(a.pages("x", "swa")).tolist()
    r = a.admit("too-big", {"full": 6})
    assert not r.ok and r.step == SHORTFALL and not r.copy_plan
    assert r.shortfall_bytes == 6 * U - a.free_bytes == U
    assert a.v2p(a.pages("x", "swa")).tolist() == before and "too-big" not in a.requests()
    g = a.grow("x", "full", 5)
    assert g.ok and len(a.pages("x", "full")) == 5


def test_ledger_withholds_freed_bytes_and_pins_fenced_pages():
    a = Arena(8 * U, kinds(), alignment=U)
    r = a.admit("a", {"full": 4})
    f = a.fence("forward")
    a.register_use(r.vids["full"][:2], f)
    pinned = a.v2p(r.vids["full"][:2]).tolist()
    a.free("a")
    assert a.free_bytes == 6 * U and a.pending_bytes == 2 * U
    r2 = a.admit("b", {"full": 7})  # would need the withheld bytes
    assert not r2.ok and r2.shortfall_bytes == U
    used = set(a.v2p(a.admit("c", {"full": 5}).vids["full"]).tolist())
    assert not used & set(pinned)
    f.complete()
    assert a.pending_bytes == 0 and a.free_bytes == 3 * U
    # A polled fence (e.g. a device event) on a live page: the page is never moved meanwhile.
    done = {"v": False}
    g = a.fence("copy", query=lambda: done["v"])
    keep = a.pages("c", "full")[-1:]
    where = a.v2p(keep).tolist()
    a.register_use(keep, g)
    a.shrink("c", "full", a.pages("c", "full")[:-1])
    assert a.compact().nbytes == 0 and a.relayout().nbytes == 0
    assert a.v2p(keep).tolist() == where
    done["v"] = True
    a.ledger.poll()
    assert g.passed and a.relayout().nbytes == U


def test_v2p_rejects_freed_ids_and_admit_rejects_duplicates():
    a = Arena(8 * U, kinds(), alignment=U)
    r = a.admit("a", {"full": 1})
    with pytest.raises(KeyError):
        a.admit("a", {"full": 1})
    a.free("a")
    with pytest.raises(KeyError):
        a.v2p(r.vids["full"])


def test_arena_does_not_import_vllm():
    code = ("import sys, ulacache_vllm.arena as m; "
            "bad = [k for k in sys.modules if k == 'vllm' or k.startswith('vllm.')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
