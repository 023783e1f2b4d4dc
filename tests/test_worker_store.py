"""UlaWorkerStore without an engine: the worker contract clause by clause. Row contents encode
their logical address and layer, so any misplaced read or write is caught.

- outside the forward (`begin_step`): frees, settle (last step's selections made resident:
  hits touched, host rows promoted), round, this step's write slots;
- inside the forward: resolve + stage only (no move, no table change), padding to a trash row;
- identity fast path, adoption on overflow, a selection larger than the device pool."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ulacache_vllm.engine.config import UlaSettings
from ulacache_vllm.engine.dsa.sizing import UlaLayout
from ulacache_vllm.engine.wiring import LRU_CHOICES
from ulacache_vllm.engine.dsa.store import UlaWorkerStore

HEAD = 8
BS = 16


def make_store(device_slots=64, host_slots=512, layers=("l.0", "l.1"), leaders=("l.0", "l.1"),
               lru="pblru", host_in_view=None, promote_after=1):
    """A store of two float32 layers; ``promote_after`` 1 (promote every host row read) unless
    a test is about the promotion admission (the product default is 2)."""
    layout = UlaLayout(block_size=BS, device_slots=device_slots, host_slots=host_slots,
                       num_logical=device_slots + host_slots,
                       num_blocks=(device_slots + host_slots) // BS + 1,
                       mla_layers=list(layers), leaders=list(leaders),
                       mla_row_bytes={n: HEAD * 4 for n in layers}, mla_head_size=HEAD,
                       mla_dtype="float32", indexer_bytes_per_token=0)
    mods = {n: SimpleNamespace(kv_cache=None, impl=SimpleNamespace()) for n in layers}
    settings = UlaSettings(lru=lru, promote_after=promote_after)
    return UlaWorkerStore(layout, settings, mods, torch.device("cpu"),
                          host_in_view=host_in_view), mods


def step(store, mods, addrs, freed=()):
    """One engine step's pre-forward half and its KV writes: every layer writes rows whose
    value is (address, layer) through its translator, as the sparse-MLA impl does."""
    store.begin_step(list(freed), {name: addrs for name in mods})
    for li, (name, mod) in enumerate(mods.items()):
        slots = mod.impl.translator.write_slots(name, addrs)
        mod.kv_cache.view(-1, HEAD).index_copy_(0, slots, _row(addrs, li))


def _row(addrs, li):
    return (addrs.float() * 10 + li).unsqueeze(1).expand(-1, HEAD).contiguous()


def read_all(mods, logical, req_of_token):
    """What attention reads for ``logical`` in each layer: rows of its view of the pool(s)
    (the device pool, and the host pool where it is in that view), host rows staged."""
    out = {}
    for name, mod in mods.items():
        t = mod.impl.translator
        dev, staged = t.resolve(name, logical, req_of_token)
        got = torch.full((*logical.shape, HEAD), -1.0)
        on_dev = dev >= 0
        got[on_dev] = mod.kv_cache.view(-1, HEAD).index_select(0, dev[on_dev])
        for ids, rows in zip(staged, t.staged_rows(name)):
            there = ids >= 0
            assert not bool((on_dev & there).any()), "a row in two places"
            got[there] = rows.view(-1, HEAD).index_select(0, ids[there])
        out[name] = got
    return out


def _tables(store):
    return [(g.mapping.loc.clone(), g.mapping.device_used, g.mapping.host_used)
            for g in store.groups]


def test_every_layer_gets_its_translator_explicitly():
    store, mods = make_store(layers=("l.0", "l.1", "l.2"), leaders=("l.0", "l.2"))
    t = [mods[n].impl.translator for n in mods]
    assert t[0] is t[1] and t[2] is not t[0]  # one translator per layer group
    assert [mods[n].impl.layer_name for n in mods] == list(mods)


def test_identity_fast_path_then_adopt_on_overflow():
    store, mods = make_store()
    a = torch.arange(16, 48)  # below the device pool size: identity placement
    step(store, mods, a)
    assert store.identity
    assert torch.equal(mods["l.0"].impl.translator.write_slots("l.0", a), a)
    b = torch.arange(200, 240)  # beyond the device range: mapped placement, before the forward
    step(store, mods, b)
    assert not store.identity
    assert store.counters.fast_path_exits == 1
    u = store.usage()
    assert u["device_used"] + u["host_used"] == 2 * (a.numel() + b.numel())
    sel = torch.cat([a[:16], b[:24]]).unsqueeze(0)  # adopted entries kept their data in place
    got = read_all(mods, sel, torch.zeros(1, dtype=torch.int64))
    for li, name in enumerate(mods):
        assert torch.equal(got[name][0], _row(sel[0], li))


def test_padding_writes_go_to_the_trash_row_not_a_live_slot():
    store, mods = make_store()
    step(store, mods, torch.arange(0, 16))
    before = mods["l.0"].kv_cache.view(-1, HEAD)[:64].clone()
    t = mods["l.0"].impl.translator
    padded = torch.tensor([16, -1, 17])
    store.begin_step([], {n: padded for n in mods})
    slots = t.write_slots("l.0", padded)
    assert slots[1].item() == t.trash_slot == 64 and slots[0].item() >= 0
    mods["l.0"].kv_cache.view(-1, HEAD).index_copy_(0, slots, torch.full((3, HEAD), 7.0))
    after = mods["l.0"].kv_cache.view(-1, HEAD)
    assert torch.equal(after[:16], before[:16])  # nothing live was overwritten


def _host_reads(store, mods, picks) -> int:
    """How many of a read's entries come from the host pool (staged, or in place)."""
    n = 0
    for name, mod in mods.items():
        dev, staged = mod.impl.translator.resolve(name, picks, None)
        n += sum(int((x >= 0).sum()) for x in staged)
        if store.host_base is not None:
            n += int((dev >= store.host_base).sum())
    return n


@pytest.mark.parametrize("lru,host_in_view,promote_after", [
    (x, True, 1) for x in LRU_CHOICES] + [("pblru", False, 1), ("pblru", True, 2),
                                           ("pblru", False, 2)])
def test_forward_only_resolves_and_stages_and_the_next_step_settles(lru, host_in_view,
                                                                    promote_after):
    """The contract's two halves; with ``promote_after`` k the host rows read are promoted
    by the settle after their k-th read in a row, and read where they are until then."""
    store, mods = make_store(device_slots=64, host_slots=512, lru=lru,
                             host_in_view=host_in_view, promote_after=promote_after)
    assert (store.host_base is not None) == host_in_view
    live = []
    for s in range(10):  # 10 steps x 40 new tokens = 400 entries >> 64 device slots
        a = torch.arange(16 + s * 40, 16 + (s + 1) * 40)
        step(store, mods, a)
        live.append(a)
    live = torch.cat(live)
    u = store.usage()
    assert u["host_used"] > 0 and u["device_used"] <= 2 * 64
    assert u["device_used"] + u["host_used"] == 2 * live.numel()
    store.begin_step([], {})
    # 4 tokens select 8 old entries each (32 < 64 device slots), padding included.
    g = torch.Generator().manual_seed(0)
    picks = torch.stack([live[torch.randperm(live.numel(), generator=g)[:8]] for _ in range(4)])
    picks[3, 6:] = -1
    before, counters = _tables(store), dict(vars(store.counters))
    got = read_all(mods, picks, torch.arange(4))
    valid = picks >= 0
    for li, name in enumerate(mods):  # exact rows, host ones staged
        assert torch.equal(got[name][valid], _row(picks[valid], li))
        assert bool((got[name][~valid] == -1).all())
    # Inside the forward nothing moved and no table changed.
    for (loc0, d0, h0), (loc1, d1, h1) in zip(before, _tables(store)):
        assert torch.equal(loc0, loc1) and (d0, h0) == (d1, h1)
    assert vars(store.counters) == counters
    assert _host_reads(store, mods, picks) > 0, "the test must read some host rows"
    if host_in_view:  # read in place: nothing staged, the view spans both pools
        assert all(not t.resolve(n, picks, None)[1] for n, t in
                   ((n, mods[n].impl.translator) for n in mods))
    # The next step's pre-forward half settles the read: with promote_after 1 the picks are
    # device-resident now; with k > 1 they stay where they are until their k-th read in a row.
    store.begin_step([], {})
    for _ in range(promote_after - 1):
        assert store.counters.promotions == 0
        assert store.counters.deferred == store.counters.lookups - store.counters.hits > 0
        assert _host_reads(store, mods, picks) > 0
        got = read_all(mods, picks, torch.arange(4))  # read again (exactly, where they are)
        for li, name in enumerate(mods):
            assert torch.equal(got[name][valid], _row(picks[valid], li))
        store.begin_step([], {})
    assert store.counters.promotions > 0 and store.counters.lookups > store.counters.hits > 0
    for name, mod in mods.items():
        dev, staged = mod.impl.translator.resolve(name, picks, None)
        assert bool((dev[valid] >= 0).all()) and all(bool((x < 0).all()) for x in staged)
    assert _host_reads(store, mods, picks) == 0
    assert {getattr(g.mapping.policy, "inner", g.mapping.policy).name for g in store.groups} == {lru}
    # Freeing every block returns both pools to empty and re-enables identity placement.
    store.begin_step(sorted(set((live // BS).tolist())), {})
    assert store.usage()["device_used"] == 0 and store.usage()["host_used"] == 0
    assert store.identity


@pytest.mark.parametrize("host_in_view", [True, False])
def test_a_selection_larger_than_the_device_pool_is_read_exactly_and_settled_in_part(
        host_in_view):
    store, mods = make_store(device_slots=64, host_slots=512, host_in_view=host_in_view)
    live = []
    for s in range(10):
        a = torch.arange(16 + s * 40, 16 + (s + 1) * 40)
        step(store, mods, a)
        live.append(a)
    live = torch.cat(live)
    store.begin_step([], {})
    g = torch.Generator().manual_seed(1)
    picks = torch.stack([live[torch.randperm(live.numel(), generator=g)[:24]] for _ in range(8)])
    got = read_all(mods, picks, torch.arange(8))  # 192 distinct-ish rows > 64 device slots
    assert _host_reads(store, mods, picks) > 0
    for li, name in enumerate(mods):
        assert torch.equal(got[name].reshape(-1, HEAD), _row(picks.reshape(-1), li))
    store.begin_step([], {})
    assert store.counters.fallback_chunks > 0  # only part of the working set was promoted
    assert store.counters.promotions > 0
    got = read_all(mods, picks, torch.arange(8))  # still exact after the partial settle
    for li, name in enumerate(mods):
        assert torch.equal(got[name].reshape(-1, HEAD), _row(picks.reshape(-1), li))


def test_impl_without_a_translator_raises():
    from ulacache_vllm.engine.dsa.cpu_sparse_mla import CpuSparseMLAImpl

    impl = SimpleNamespace(translator=None, layer_name="model.layers.3.self_attn.attn")
    with pytest.raises(RuntimeError, match="layers.3.*no KV translator"):
        CpuSparseMLAImpl._translator(impl)


# ------------------------------------------------------------ failed and stalled moves
def _fill(store, mods, steps=10, width=40):
    live = []
    for s in range(steps):  # 400 entries >> 64 device slots: demotions, host rows
        a = torch.arange(16 + s * width, 16 + (s + 1) * width)
        step(store, mods, a)
        live.append(a)
    return torch.cat(live)


def _check_tables(store, mods, live):
    """Pools and tables agree, every entry of ``live`` (and nothing else) is mapped, no slot
    is shared, and every live row reads back exactly (the rows encode address and layer)."""
    for g in store.groups:
        m = g.mapping
        assert torch.equal(m.loc, m.visible), "no plan outstanding: the tables agree"
        for pool in (m.dev, m.host):
            assert int((pool.owner >= 0).sum()) == pool.num_used
            assert bool((pool.owner.index_select(0, pool.stack[:pool.num_free]) < 0).all())
        mapped = torch.nonzero(m.loc >= 0).flatten()
        assert torch.equal(mapped, torch.unique(live)), "mapped entries != live entries"
        assert m.dev.num_used + m.host.num_used == mapped.numel()
        assert m.loc[mapped].unique().numel() == mapped.numel(), "two entries share a slot"
    got = read_all(mods, live.unsqueeze(0), torch.zeros(1, dtype=torch.int64))
    for li, name in enumerate(mods):
        assert torch.equal(got[name][0], _row(live, li))


def _unmapped(store, live):
    return live[store.groups[0].mapping.loc.index_select(0, live) < 0]


def test_a_failed_demotion_drops_only_its_victims_and_reports_their_blocks():
    """A demotion copy that raises while this step's writes get slots (the assign path):
    the victims' entries are dropped (never read half-moved) and their logical blocks
    reported for the scheduler to fail their requests; this step's new rows are assigned
    again and written; every other entry still reads exactly; the tables stay consistent and
    the store keeps working once the lost blocks are freed."""
    from ulacache_vllm.engine.faults import MoveFaults

    store, mods = make_store(device_slots=64, host_slots=512, layers=("l.0",), leaders=("l.0",))
    live = _fill(store, mods, steps=5)
    assert store.take_lost_blocks() == set()
    store.faults = MoveFaults(fault="raise", moves=("demote",), count=1)
    new = torch.arange(16 + 5 * 40, 16 + 6 * 40)
    step(store, mods, new)  # does not raise
    assert store.faults.fired == 1
    assert store.take_counters().failed_copies == 1  # (/metrics: vllm:ulacache_failed_copies_total)
    lost = _unmapped(store, live)
    assert lost.numel() > 0 and store.lost_entries == lost.numel()
    assert store.take_lost_blocks() == set((lost // BS).tolist())
    assert store.take_lost_blocks() == set()  # reported once
    assert not bool(torch.isin(new, lost).any())
    survivors = torch.cat([live[~torch.isin(live, lost)], new])
    _check_tables(store, mods, survivors)
    # The scheduler fails the owners: their blocks come back freed (whole blocks: the other
    # entries of a lost block go too); later steps move rows again, without faults.
    blocks = sorted(set((lost // BS).tolist()))
    store.begin_step(blocks, {})
    survivors = survivors[~torch.isin(survivors // BS, torch.tensor(blocks))]
    for s in (6, 7):
        more = torch.arange(16 + s * 40, 16 + (s + 1) * 40)
        step(store, mods, more)
        survivors = torch.cat([survivors, more])
    assert store.counters.demotions > 0
    _check_tables(store, mods, survivors)
    store.begin_step(sorted(set((survivors // BS).tolist())), {})
    assert store.usage()["device_used"] == 0 and store.usage()["host_used"] == 0


@pytest.mark.parametrize("move", ["promote", "demote"])
def test_a_failed_settle_drops_the_plan_and_reports_it(move):
    """A copy that raises while the previous step's host reads are promoted (the settle
    path: promotions and the demotions making room for them): the plan's entries are dropped
    and reported, the rest reads exactly, and the next settle works."""
    from ulacache_vllm.engine.faults import MoveFaults

    store, mods = make_store(device_slots=64, host_slots=512)
    live = _fill(store, mods)
    store.begin_step([], {})
    g = torch.Generator().manual_seed(2)
    picks = torch.stack([live[torch.randperm(live.numel(), generator=g)[:8]] for _ in range(4)])
    read_all(mods, picks, torch.arange(4))  # some host rows: promoted at the next settle
    store.faults = MoveFaults(fault="raise", moves=(move,), count=1)
    store.begin_step([], {})
    assert store.faults.fired == 1
    lost = _unmapped(store, live)
    assert lost.numel() > 0
    if move == "promote":
        assert bool(torch.isin(lost, picks).any())
    blocks = store.take_lost_blocks()
    assert blocks == set((lost // BS).tolist())
    # Every group dropped the same kind of plan; the tables hold exactly the other entries.
    survivors = live[~torch.isin(live, lost)]
    for gr in store.groups:
        gl = live[gr.mapping.loc.index_select(0, live) < 0]
        assert set((gl // BS).tolist()) <= blocks
    store.begin_step(sorted(blocks), {})
    survivors = survivors[~torch.isin(survivors // BS, torch.tensor(sorted(blocks)))]
    _check_tables(store, mods, survivors)


def test_a_stalled_copy_delays_the_step_and_changes_nothing(monkeypatch):
    """Stalled copies (every move sleeps) take longer and read the same rows."""
    import ulacache_vllm.engine.faults as mf

    slept = []
    monkeypatch.setattr(mf.time, "sleep", slept.append)
    store, mods = make_store(device_slots=64, host_slots=512, layers=("l.0",), leaders=("l.0",))
    store.faults = mf.MoveFaults(fault="stall", count=-1, seconds=0.25)
    live = _fill(store, mods, steps=6)
    store.begin_step([], {})
    picks = live[::5].unsqueeze(0)
    read_all(mods, picks, torch.zeros(1, dtype=torch.int64))
    store.begin_step([], {})
    assert store.faults.fired > 0 and slept == [0.25] * store.faults.fired
    assert store.totals()["failed_copies"] == 0 and store.take_lost_blocks() == set()
    _check_tables(store, mods, live)


def test_move_faults_are_off_by_default_and_armed_from_the_control_file(tmp_path, monkeypatch):
    from ulacache_vllm.engine.faults import ENV, MoveFaultError, MoveFaults

    monkeypatch.delenv(ENV, raising=False)
    assert MoveFaults.from_env() is None
    assert make_store()[0].faults is None
    ctl = tmp_path / "faults.json"
    monkeypatch.setenv(ENV, str(ctl))
    f = MoveFaults.from_env()
    f.poll()  # no file yet: disarmed
    f.before_copy("demote", 4)
    ctl.write_text('{"fault": "raise", "moves": ["promote"], "skip": 1, "count": 1}')
    f.poll()
    f.before_copy("demote", 4)  # not a qualifying move
    f.before_copy("promote", 4)  # skipped
    with pytest.raises(MoveFaultError, match="promote copy of 4 rows"):
        f.before_copy("promote", 4)
    f.before_copy("promote", 4)  # count spent
    f.poll()  # same text: not re-armed
    f.before_copy("promote", 4)
    ctl.write_text('{"fault": "raise", "moves": ["promote"], "skip": 1, "count": 1, "nonce": 2}')
    f.poll()
    f.before_copy("promote", 4)
    with pytest.raises(MoveFaultError):
        f.before_copy("promote", 4)
    ctl.write_text("")
    f.poll()
    f.before_copy("promote", 4)
    with pytest.raises(ValueError, match="unknown moves"):
        MoveFaults(moves=("teleport",))


@pytest.mark.parametrize("fault", [None, "demote", "promote"])
def test_a_steps_settle_and_writes_move_as_one_plan(fault):
    """Decode steps that each read host rows and then write new rows: the next step's settle
    (promotions) and writes (slots) come from ONE plan per group (`settle_and_assign`: one
    victim selection, one set of copies), and every row still reads exactly. A copy failing
    in that plan drops only the entries it moved, never the step's new rows (assigned again
    and written); their blocks are reported, and once freed the tables are consistent."""
    from ulacache_vllm.engine.faults import MoveFaults

    store, mods = make_store(device_slots=64, host_slots=512)
    live = _fill(store, mods)
    g = torch.Generator().manual_seed(3)
    nxt = int(live.max()) + 1
    base = store.counters.merged_plans
    for s in range(6):
        picks = torch.stack([live[torch.randperm(live.numel(), generator=g)[:8]]
                             for _ in range(4)])
        mapped = store.groups[0].mapping.loc.index_select(0, picks.flatten()).view_as(picks) >= 0
        got = read_all(mods, picks, torch.arange(4))
        for li, name in enumerate(mods):
            assert torch.equal(got[name][mapped], _row(picks[mapped], li))
        if fault and s == 2:
            store.faults = MoveFaults(fault="raise", moves=(fault,), count=1)
        new = torch.arange(nxt, nxt + 4)
        nxt += 4
        step(store, mods, new)
        live = torch.cat([live, new])
        if fault and s == 2:
            assert store.faults.fired == 1
            for gr in store.groups:  # the new rows survived the failed plan, and read back
                assert bool((gr.mapping.loc.index_select(0, new) >= 0).all())
            got = read_all(mods, new.unsqueeze(0), torch.zeros(1, dtype=torch.int64))
            for li, name in enumerate(mods):
                assert torch.equal(got[name][0], _row(new, li))
    assert store.counters.merged_plans - base == 6 * len(store.groups)
    assert store.counters.promotions > 0 and store.counters.demotions > 0
    blocks = store.take_lost_blocks()
    assert bool(blocks) == bool(fault)
    if blocks:
        store.begin_step(sorted(blocks), {})
        live = live[~torch.isin(live // BS, torch.tensor(sorted(blocks)))]
    _check_tables(store, mods, live)
