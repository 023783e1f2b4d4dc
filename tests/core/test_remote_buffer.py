"""TP mode end to end in the core: token-sharded tiered mappings plus each rank's buffer of
recently fetched remote rows, on real row tensors (every read checked against what was
written for that logical address, also after addresses are freed and reused)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.policies import NAMES as POLICIES
from lab.policies import factory
from lab.row_store import RowStore
from ulacache_vllm.core import (DEVICE, HOST, CapacityError, ManualEvent, RemoteRowBuffer,
                                TieredMapping, unpack)


class Cluster:
    """P simulated TP ranks: rank r owns entries t % P == r (rows in its mapping's tiers) and
    buffers the remote rows it reads."""

    def __init__(self, P, N, dev, host, buf, lru):
        self.P, self.N = P, N
        self.maps = [TieredMapping(N, dev, host, placement="tp", rank=r, world_size=P,
                                   lru=factory(lru))
                     for r in range(P)]
        self.stores = [RowStore(dev, host) for _ in range(P)]
        self.bufs = [RemoteRowBuffer(N, buf, rank=r, world_size=P, lru=factory(lru))
                     for r in range(P)]
        self.rows = [torch.full((buf, 1), -1, dtype=torch.int64) for _ in range(P)]
        self.value = {}  # live address -> the value written for it
        self.version = 0

    def _read_owned(self, r, addrs):
        t, _, s = unpack(self.maps[r].resolve(addrs))
        assert set(t.tolist()) <= {DEVICE, HOST}, "an owner's row is missing or pending"
        out = torch.empty(addrs.numel(), dtype=torch.int64)
        for tier in (DEVICE, HOST):
            sel = t == tier
            if sel.any():
                out[sel] = self.stores[r].read(tier, s[sel]).reshape(-1)
        return out

    def fetch_fn(self, r):
        def fetch(owners, addrs, slots):
            for o in owners.unique().tolist():
                assert o != r, "a rank fetched a row it owns"
                sel = owners == o
                self.rows[r][slots[sel], 0] = self._read_owned(o, addrs[sel])
        return fetch

    def append(self, addrs):
        for r in range(self.P):
            slots, plan = self.maps[r].assign(addrs)
            self.maps[r].apply(plan, self.stores[r].copy_fn)
            own = slots >= 0
            vals = torch.arange(self.version, self.version + addrs.numel())
            if own.any():
                self.stores[r].write(DEVICE, slots[own], vals[own])
        for a, v in zip(addrs.tolist(), range(self.version, self.version + addrs.numel())):
            self.value[a] = v
        self.version += addrs.numel()

    def free(self, addrs):
        for r in range(self.P):
            self.maps[r].free(addrs)
            self.bufs[r].invalidate(addrs)
        for a in addrs.tolist():
            self.value.pop(a, None)

    def read(self, r, addrs):
        """Rank r reads the rows of ``addrs``: its own through its mapping, the rest through
        its buffer; returns the values."""
        m, b = self.maps[r], self.bufs[r]
        slots, plan = m.ensure_resident(addrs)
        m.apply(plan, self.stores[r].copy_fn)
        bslots, fplan = b.lookup(addrs)
        b.apply(fplan, self.fetch_fn(r))
        fplan.fence.wait()
        assert fplan.fence.completed
        own = slots >= 0
        remote = bslots >= 0
        assert torch.equal(own ^ remote, addrs >= 0), "an address neither owned nor buffered"
        assert torch.equal(b.resolve(addrs), bslots), "a fetched row is not visible"
        out = torch.empty(addrs.numel(), dtype=torch.int64)
        if own.any():
            out[own] = self.stores[r].read(DEVICE, slots[own]).reshape(-1)
        if remote.any():
            out[remote] = self.rows[r][bslots[remote], 0]
        return out

    def advance(self):
        for r in range(self.P):
            self.maps[r].advance_round()
            self.bufs[r].advance_round()


op = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 10)),
    st.tuples(st.just("read"), st.integers(1, 12), st.integers(0, 2**31)),
    st.tuples(st.just("free"), st.integers(1, 8), st.integers(0, 2**31)),
)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(op, min_size=1, max_size=40), P=st.integers(1, 4),
       lru=st.sampled_from(POLICIES), buf=st.integers(4, 16))
def test_every_rank_reads_what_was_written(ops, P, lru, buf):
    """Random append / read / free over P ranks: each rank reads every selected row (own and
    remote) with the value last written for that address; freed addresses are reused with new
    values and must never be served from a stale buffered row."""
    N = 40
    c = Cluster(P, N, dev=12, host=64, buf=buf, lru=lru)
    g = torch.Generator().manual_seed(0)
    for o in ops:
        if o[0] == "append":
            free = [a for a in range(N) if a not in c.value][:o[1]]
            if free:
                c.append(torch.tensor(free))
        elif o[0] == "read" and c.value:
            live = torch.tensor(sorted(c.value))
            g.manual_seed(o[2])
            sel = live[torch.randperm(live.numel(), generator=g)[:min(o[1], buf)]]
            sel = torch.cat([sel, sel[:2], torch.tensor([-1])])  # duplicates and padding
            for r in range(P):
                got = c.read(r, sel)
                want = torch.tensor([c.value.get(a, -1) if a >= 0 else -1 for a in sel.tolist()])
                ok = sel >= 0
                assert torch.equal(got[ok], want[ok]), f"rank {r} read wrong rows"
        elif o[0] == "free" and c.value:
            live = torch.tensor(sorted(c.value))
            g.manual_seed(o[2])
            c.free(live[torch.randperm(live.numel(), generator=g)[:o[1]]])
        c.advance()  # one scheduling round per op
        for b in c.bufs:  # buffer bookkeeping stays consistent
            assert b.used == int((b.table >= 0).sum()) <= b.num_slots
            assert b.pool.num_free + b.used == b.num_slots
    c.free(torch.arange(N))
    for b in c.bufs:
        assert b.used == 0 and int((b.table >= 0).sum()) == 0


def test_repeated_selection_hits_and_reused_address_is_refetched():
    c = Cluster(2, 16, dev=8, host=16, buf=8, lru="pblru")
    c.append(torch.arange(8))
    b = c.bufs[0]
    sel = torch.tensor([1, 3, 5, 0])
    assert c.read(0, sel).tolist() == [1, 3, 5, 0]
    assert b.stats.fetched == 3 and b.stats.hits == 0  # 0 is rank 0's own row
    c.advance()
    assert c.read(0, sel).tolist() == [1, 3, 5, 0]
    assert b.stats.fetched == 3 and b.stats.hits == 3  # served from the buffer
    c.free(torch.tensor([3]))
    assert b.stats.invalidated == 1
    c.append(torch.tensor([3]))  # address 3 reused for a new token
    c.advance()
    assert c.read(0, sel).tolist() == [1, 8, 5, 0]  # the new value, not the buffered one
    assert b.stats.fetched == 4


def test_fetch_in_flight_is_invisible_until_done():
    b = RemoteRowBuffer(16, 4, rank=0, world_size=2)
    slots, plan = b.lookup(torch.tensor([1, 3, 2]))
    assert slots[2] == -1 and bool((slots[:2] >= 0).all())
    assert plan.addrs.tolist() == [1, 3] and plan.owners.tolist() == [1, 1]
    assert b.resolve(torch.tensor([1, 3])).tolist() == [-1, -1]  # not fetched yet
    ev = ManualEvent()
    b.apply(plan, lambda owners, addrs, dst: ev)
    assert not plan.fence.completed
    assert b.resolve(torch.tensor([1, 3])).tolist() == [-1, -1]  # fetch still in flight
    ev.set()
    assert b.resolve(torch.tensor([1, 3])).tolist() == slots[:2].tolist()
    assert plan.fence.completed


def test_plans_apply_in_creation_order():
    b = RemoteRowBuffer(16, 8, rank=0, world_size=2)
    _, p1 = b.lookup(torch.tensor([1]))
    _, p2 = b.lookup(torch.tensor([3]))
    with pytest.raises(RuntimeError, match="creation order"):
        b.apply(p2, lambda *a: None)
    b.apply(p1, lambda *a: None)
    b.apply(p2, lambda *a: None)
    assert b.resolve(torch.tensor([1, 3])).ge(0).all()
    foreign = RemoteRowBuffer(16, 8, rank=0, world_size=2).lookup(torch.tensor([5]))[1]
    with pytest.raises(ValueError, match="another"):
        b.apply(foreign, lambda *a: None)


@pytest.mark.parametrize("lru", POLICIES)
def test_round_larger_than_buffer_changes_nothing(lru):
    b = RemoteRowBuffer(64, 4, rank=0, world_size=2, lru=factory(lru))
    _, p = b.lookup(torch.tensor([1, 3, 5]))
    b.apply(p, lambda *a: None)
    table, used, fetched = b.table.clone(), b.used, b.stats.fetched
    with pytest.raises(CapacityError, match="remote-row buffer"):
        b.lookup(torch.tensor([7, 9]))  # same round: 1, 3, 5 may not be evicted
    assert torch.equal(b.table, table) and b.used == used and b.stats.fetched == fetched
    b.advance_round()
    slots, p = b.lookup(torch.tensor([7, 9]))  # now the least recent rows make room
    b.apply(p, lambda *a: None)
    assert b.stats.evicted == 1 and b.used == 4
    assert b.resolve(torch.tensor([1, 7, 9])).tolist()[1:] == slots.tolist()
    assert b.resolve(torch.tensor([1])).item() == -1  # 1 was the least recent
    b.advance_round()
    _, p = b.lookup(torch.tensor([1]))  # an evicted row is fetched again, not "hit"
    assert p.addrs.tolist() == [1] and b.stats.hits == 0


def test_bad_input():
    with pytest.raises(ValueError):
        RemoteRowBuffer(16, 0, rank=0, world_size=2)
    with pytest.raises(ValueError):
        RemoteRowBuffer(16, 4, rank=2, world_size=2)
    b = RemoteRowBuffer(16, 4, rank=0, world_size=2)
    with pytest.raises(KeyError, match="outside"):
        b.lookup(torch.tensor([1, 99]))
    with pytest.raises(TypeError):
        b.lookup(torch.tensor([1.0]))
    assert b.used == 0
    assert b.invalidate(torch.tensor([99, -1])) == 0
    # World size 1: nothing is remote.
    one = RemoteRowBuffer(16, 4, rank=0, world_size=1)
    slots, plan = one.lookup(torch.arange(8))
    assert plan.empty and bool((slots == -1).all())


class LazyCopy:
    """An asynchronous fetch that finishes only when somebody waits for it."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


def test_hit_on_a_row_in_flight_waits_for_its_fetch():
    b = RemoteRowBuffer(16, 4, rank=0, world_size=2)
    s1, p1 = b.lookup(torch.tensor([1]))
    ev = LazyCopy()
    b.apply(p1, lambda *a: ev)
    b.advance_round()
    s2, p2 = b.lookup(torch.tensor([1]))  # a hit, but its bytes are still on the way
    assert p2.empty and torch.equal(s1, s2)
    assert ev.done and p1.fence.completed, "a hit returned a slot whose fetch was in flight"
    assert b.resolve(torch.tensor([1])).tolist() == s1.tolist()


def test_late_fetch_of_an_evicted_row_stays_invisible():
    b = RemoteRowBuffer(16, 1, rank=0, world_size=2)
    s1, p1 = b.lookup(torch.tensor([1]))
    ev = ManualEvent()
    b.apply(p1, lambda *a: ev)
    b.advance_round()
    s3, p3 = b.lookup(torch.tensor([3]))  # evicts 1 while its fetch is still in flight
    assert torch.equal(s1, s3) and b.stats.evicted == 1
    b.apply(p3, lambda *a: None)
    ev.set()
    b.poll()
    assert b.resolve(torch.tensor([1, 3])).tolist() == [-1, s3.item()]


def test_tp_benchmark_replay_saves_fetches():
    """benchmarks/tp_remote_buffer.py on a small DSA trace: with 60-95 % step-to-step overlap
    the buffer must cut the remote fetches, and never fetch more than no buffer."""
    import importlib.util
    import pathlib

    from lab.trace import generate_dsa_trace

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "tp_remote_buffer.py"
    spec = importlib.util.spec_from_file_location("tp_remote_buffer", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tr = generate_dsa_trace(num_steps=12, batch=3, topk=32, prompt_len=(64, 128),
                            decode_len=(6, 12), overlap=(0.6, 0.95), seed=3)
    for P in (2, 4):
        demand = bench.remote_demand(tr, P)
        r = bench.replay(tr, P, demand)  # a round's remote rows always fit
        assert 0 < r["fetched"] < r["unbuffered"] and r["hit_rate"] > 0


def test_a_miss_does_not_wait_for_an_old_fetch_of_the_same_address():
    """Only rows the buffer holds wait for their fetch: an address evicted while its old fetch
    is still in flight is a plain miss (waiting would block on an unrelated copy)."""
    b = RemoteRowBuffer(16, 1, rank=0, world_size=2)
    _, p1 = b.lookup(torch.tensor([1]))
    ev = ManualEvent()
    b.apply(p1, lambda *a: ev)  # in flight
    b.advance_round()
    _, p3 = b.lookup(torch.tensor([3]))  # evicts 1 while its fetch is in flight
    b.apply(p3, lambda *a: None)
    b.advance_round()
    slots, p1b = b.lookup(torch.tensor([1]))  # ManualEvent.synchronize() would raise here
    assert p1b.addrs.tolist() == [1] and not p1.fence.completed
    assert b.invalidate(torch.tensor([3])) == 0  # evicted: nothing held, nothing to wait for
    b.apply(p1b, lambda *a: None)
    ev.set()
    b.sync()
    assert b.resolve(torch.tensor([1, 3])).tolist() == [slots.item(), -1]


@pytest.mark.parametrize("lru", POLICIES)
def test_old_fetch_never_publishes_a_slot_a_later_fetch_rewrites(lru):
    """Evicted and fetched back into the same slot while the first fetch is in flight: the
    first fetch's completion must not make the address visible (the slot is still being
    rewritten by the later fetches on the in-order stream)."""
    b = RemoteRowBuffer(16, 1, rank=0, world_size=2, lru=factory(lru))
    evs = []
    for a in (1, 3, 1):  # 1 -> slot 0, 3 evicts it, 1 evicts 3: all into slot 0
        _, p = b.lookup(torch.tensor([a]))
        evs.append(ManualEvent())
        b.apply(p, lambda *x, e=evs[-1]: e)
        b.advance_round()
    evs[0].set()
    assert b.resolve(torch.tensor([1, 3])).tolist() == [-1, -1]
    evs[1].set()
    assert b.resolve(torch.tensor([1, 3])).tolist() == [-1, -1]
    evs[2].set()
    assert b.resolve(torch.tensor([1, 3])).tolist() == [0, -1]


def test_empty_lists_huge_addresses_and_foreign_plans():
    b = RemoteRowBuffer(16, 4, rank=0, world_size=2)
    slots, plan = b.lookup([])
    assert slots.numel() == 0 and plan.empty
    assert b.invalidate([]) == 0 and b.resolve([]).numel() == 0
    with pytest.raises(KeyError, match="outside"):
        b.lookup([2**63])
    m = TieredMapping(16, 4, 4)
    m.assign(torch.arange(4))
    m.advance_round()
    _, mplan = m.assign(torch.arange(4, 8))  # a move plan (victims to host), not a fetch plan
    assert not mplan.empty
    with pytest.raises(ValueError, match="another"):
        b.apply(mplan, lambda *a: None)
    _, fplan = b.lookup([5])
    with pytest.raises(ValueError, match="another"):  # a fetch plan is no move plan either
        m.apply(fplan, lambda *a: None)
    b.apply(fplan, lambda *a: None)
    assert b.invalidate([5, 2**63]) == 1  # past int64: ignored, as documented
    _, p = b.lookup([1, 3])
    evs = (ManualEvent(), ManualEvent())
    b.apply(p, lambda *a: evs)  # several events (a tuple): visible once all are done
    evs[0].set()
    assert b.resolve([1]).item() == -1
    evs[1].set()
    assert b.resolve([1]).item() >= 0
