"""The v4 line's CSA row store (`engine/v4/rows.py`), without an engine: every logical row's
bytes survive demotions and promotions (moves copy, then commit), reads resolve through the
committed table to the row's current pool row (device or host), repeated reads promote,
dead blocks free their rows, and a working set larger than the device pool is left where
it is instead of failing the step."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from ulacache_vllm.engine.v4.rows import CsaRows, CsaRowsPlan

RPB, ROW = 4, 16  # small rows and blocks: the same code as 64 x 584


def _plan(device_rows: int, host_rows: int, layers: int = 2) -> CsaRowsPlan:
    return CsaRowsPlan(group=3, layer_names=tuple(f"model.layers.{i}.attn" for i in range(layers)),
                       rows_per_block=RPB, row_bytes=ROW, device_rows=device_rows,
                       host_rows=host_rows, num_blocks=(device_rows + host_rows) // RPB + 1)


def _write(store: CsaRows, slots: torch.Tensor, content: dict, gen) -> None:
    """One step's writes as the compressor makes them: bytes at the fixed write slots."""
    store.begin(slots)
    for name, rows in store.layers.items():
        ok = slots >= 0
        data = torch.randint(0, 256, (int(ok.sum()), ROW), dtype=torch.uint8, generator=gen)
        rows.rows2d[rows.write_slots[ok]] = data
        for s, d in zip(slots[ok].tolist(), data):
            content[(name, s)] = d


def _check(store: CsaRows, content: dict) -> None:
    for name, rows in store.layers.items():
        mine = [(s, d) for (n, s), d in content.items() if n == name]
        logical = torch.tensor([s for s, _ in mine])
        got = rows.rows2d[rows.resolve(logical)]
        assert torch.equal(got, torch.stack([d for _, d in mine])), name
        rows.selected.clear()


@settings(max_examples=20, deadline=None)
@given(device=st.integers(8, 24), steps=st.integers(2, 8), seed=st.integers(0, 2**31 - 1))
def test_rows_keep_their_bytes_through_demotions_and_promotions(device, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    store = CsaRows(_plan(device, 256), "pblru", promote_after=2)
    content: dict = {}
    block = 1
    for _ in range(steps):
        # a step writes a few rows of new blocks (-1: tokens that complete no row)
        n = int(torch.randint(1, min(8, device) + 1, (1,), generator=gen))
        slots = torch.arange(block * RPB, block * RPB + n)
        block += -(-n // RPB)
        slots = torch.cat([slots, torch.tensor([-1, -1])])[torch.randperm(n + 2, generator=gen)]
        _write(store, slots, content, gen)
        # the attention reads some written rows (twice in a row: promotions)
        for rows in store.layers.values():
            live = torch.tensor(sorted(s for (nm, s) in content if nm == rows.name))
            pick = live[torch.randint(0, len(live), (min(6, len(live)),), generator=gen)]
            rows.resolve(pick.view(2, -1) if pick.numel() % 2 == 0 else pick)
        _check(store, content)
    c = store.counters()
    assert c["assigned"] == len(content)
    if len(content) // 2 > device:  # (per layer) more rows than the device pool holds
        assert c["demotions"] > 0 and c["host_used"] > 0, c


def test_repeated_reads_promote_a_host_row():
    gen = torch.Generator().manual_seed(0)
    store = CsaRows(_plan(4, 64, layers=1), "pblru", promote_after=2)
    content: dict = {}
    for b in (1, 2):  # 8 rows over two steps, 4 device slots
        _write(store, torch.arange(b * RPB, (b + 1) * RPB), content, gen)
    rows = next(iter(store.layers.values()))
    dev, host = rows.mapping.locate(torch.arange(RPB, 3 * RPB))
    on_host = torch.arange(RPB, 3 * RPB)[host >= 0][:1]
    assert on_host.numel() == 1
    for _ in range(2):  # read in two settles in a row
        rows.resolve(on_host)
        store.begin(None)
    dev, _ = rows.mapping.locate(on_host)
    assert int(dev[0]) >= 0 and store.counters()["promotions"] >= 1
    _check(store, content)


def test_dead_blocks_free_their_rows_and_overflows_stay_on_the_host():
    gen = torch.Generator().manual_seed(1)
    store = CsaRows(_plan(4, 64, layers=1), "pblru", promote_after=1)
    content: dict = {}
    for b in range(1, 5):  # 16 rows (a step's writes fit the device): 12 on the host
        _write(store, torch.arange(b * RPB, (b + 1) * RPB), content, gen)
    rows = next(iter(store.layers.values()))
    rows.resolve(torch.arange(RPB, 5 * RPB))  # a working set of 16 > 4 device rows
    store.begin(None)
    assert store.settle_overflows == 1  # left where it is, read in place
    _check(store, content)
    store.free([1, 2])
    c = store.counters()
    assert c["freed"] == 2 * RPB and c["device_used"] + c["host_used"] == 2 * RPB, c
    store.free([3, 4])
    c = store.counters()
    assert c["device_used"] == c["host_used"] == 0, c


def _faulted_store(fault_moves, count=1):
    """One layer, 4 device rows, two blocks written (4 rows on the host), a fault armed."""
    from ulacache_vllm.engine.faults import MoveFaults

    gen = torch.Generator().manual_seed(2)
    store = CsaRows(_plan(4, 64, layers=1), "pblru", promote_after=1)
    content: dict = {}
    for b in (1, 2):
        _write(store, torch.arange(b * RPB, (b + 1) * RPB), content, gen)
    store.faults = MoveFaults("raise", moves=fault_moves, count=count)
    return store, next(iter(store.layers.values())), content, gen


def _mapped(rows, logical) -> torch.Tensor:
    dev, host = rows.mapping.locate(logical)
    return (dev >= 0) | (host >= 0)


def test_a_failed_demotion_loses_only_the_victims_rows_and_places_the_new_rows_again(caplog):
    """A demotion that fails while a step's new rows need device rows: the victims' rows are
    dropped and their logical blocks reported lost (once: `take_lost` empties it); the new
    rows, which hold no data yet, get rows anyway; every other row keeps its bytes."""
    import logging

    store, rows, content, gen = _faulted_store(("demote",))
    # (on this module's logger itself: an in-process engine earlier in the session may have
    # stopped "vllm" from propagating, and a test may have raised "vllm.ulacache"'s level)
    log = logging.getLogger("vllm.ulacache.v4_rows")
    level = log.level
    log.setLevel(logging.ERROR)
    log.addHandler(caplog.handler)
    try:
        _write(store, torch.arange(3 * RPB, 4 * RPB), content, gen)  # 4 new rows: 4 victims
    finally:
        log.removeHandler(caplog.handler)
        log.setLevel(level)
    lost = store.take_lost()
    assert store.take_lost() == set() and store.counters()["failed_copies"] == 1
    assert lost == {2}, lost  # the device held block 2's rows only: the victims
    c = store.counters()  # moves that did not happen are not counted; new rows once
    assert c["demotions"] == RPB and c["assigned"] == 3 * RPB, c
    assert "a CSA row copy failed" in caplog.text
    dropped = torch.tensor([s for (_, s) in content if s // RPB in lost])
    assert not bool(_mapped(rows, dropped).any())
    assert bool((rows.physical(dropped) == -1).all())  # a read of them resolves to -1
    for (name, s) in [k for k in content if k[1] // RPB in lost]:
        del content[(name, s)]
    assert bool(_mapped(rows, torch.arange(3 * RPB, 4 * RPB)).all())
    _check(store, content)  # the new rows and every row not lost hold their bytes


def test_a_failed_promotion_loses_the_rows_its_plan_moved():
    """A promotion that fails in a settle drops the rows its plan moved (the promoted rows
    and the victims demoted for them): their blocks are lost, every other row keeps its
    bytes and the next step places its new rows."""
    store, rows, content, gen = _faulted_store(("promote", "stage"))
    on_host = torch.arange(RPB, 3 * RPB)[rows.mapping.locate(torch.arange(RPB, 3 * RPB))[1] >= 0]
    store.begin(None)  # a round without writes: the newest rows may be victims again
    rows.resolve(on_host[:2])
    store.begin(None)  # the settle promotes the two rows: the copy fails
    lost = store.take_lost()  # the promoted rows' blocks (and the plan's victims')
    assert set((on_host[:2] // RPB).tolist()) <= lost <= {1, 2}, lost
    assert not bool(_mapped(rows, on_host[:2]).any())
    written = torch.arange(RPB, 3 * RPB)
    kept = _mapped(rows, written)
    assert int((~kept).sum()) == 4  # the two promoted rows and the plan's two victims
    assert set((written[~kept] // RPB).tolist()) == lost
    _check(store, {k: d for k, d in content.items() if k[1] in written[kept].tolist()})

    new = torch.arange(4 * RPB, 5 * RPB)
    store.begin(new)
    assert store.take_lost() == set() and bool((rows.write_slots >= 0).all())
    assert store.counters()["failed_copies"] == 1
