"""TP mode end to end in the core: token-sharded tiered mappings (TokenShard gives each rank its
addresses and their local addresses) plus each rank's buffer of recently fetched remote rows,
on real row tensors (every read checked against what was written for that logical address,
also after addresses are freed and reused)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.policies import NAMES as POLICIES
from lab.policies import factory
from _locations import tier_and_slot
from lab.row_store import RowStore
from ulacache_vllm.core import DEVICE, HOST, RemoteRowBuffer, TieredMapping, TokenShard


class Cluster:
    """P simulated TP ranks: rank r owns entries t % P == r (``TokenShard``; rows in its
    mapping's tiers, at local address t // P) and buffers the remote rows it reads (hits from
    the buffer; misses read from their owner during the step and kept by ``settle`` between
    steps, as the worker store does)."""

    def __init__(self, P, N, dev, host, buf, lru):
        self.P, self.N = P, N
        self.shards = [TokenShard(r, P) for r in range(P)]
        self.maps = [TieredMapping(s.local_count(N), dev, host, lru=factory(lru))
                     for s in self.shards]
        self.stores = [RowStore(dev, host) for _ in range(P)]
        self.bufs = [RemoteRowBuffer(N, buf, rank=r, world_size=P, lru=factory(lru))
                     for r in range(P)]
        self.rows = [torch.full((buf, 1), -1, dtype=torch.int64) for _ in range(P)]
        self.value = {}  # live address -> the value written for it
        self.version = 0
        self.fetched = 0

    def _read_owned(self, r, addrs):
        assert bool(self.shards[r].owned(addrs).all()), "read from a rank that does not own it"
        t, s = tier_and_slot(self.maps[r], self.shards[r].local(addrs))
        assert set(t.tolist()) <= {DEVICE, HOST}, "an owner's row is missing"
        out = torch.empty(addrs.numel(), dtype=torch.int64)
        for tier in (DEVICE, HOST):
            sel = t == tier
            if sel.any():
                out[sel] = self.stores[r].read(tier, s[sel]).reshape(-1)
        return out

    def _fetch(self, r, addrs):
        out = torch.empty(addrs.numel(), dtype=torch.int64)
        assert not bool(self.shards[r].owned(addrs).any()), "a rank fetched a row it owns"
        done = torch.zeros(addrs.shape, dtype=torch.bool)
        for o, shard in enumerate(self.shards):
            sel = shard.owned(addrs)
            if sel.any():
                out[sel] = self._read_owned(o, addrs[sel])
            done |= sel
        assert bool(done.all()), "an address without an owner"
        self.fetched += addrs.numel()
        return out

    def append(self, addrs):
        for r in range(self.P):
            slots, plan = self.maps[r].assign(self.shards[r].local(addrs))
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
            self.maps[r].free(self.shards[r].local(addrs))
            self.bufs[r].invalidate(addrs)
        for a in addrs.tolist():
            self.value.pop(a, None)

    def read(self, r, addrs):
        """Rank r reads the rows of ``addrs``: its own through its mapping, buffered remote
        rows from its buffer, the other remote rows from their owners; then settles."""
        m, b = self.maps[r], self.bufs[r]
        slots, plan = m.ensure_resident(self.shards[r].local(addrs))
        m.apply(plan, self.stores[r].copy_fn)
        bslots = b.slots_of(addrs)
        own = slots >= 0
        assert torch.equal(own, self.shards[r].owned(addrs))
        remote = (addrs >= 0) & ~own
        hit = remote & (bslots >= 0)
        miss = remote & (bslots < 0)
        assert not bool((own & (bslots >= 0)).any()), "an owned row in the buffer"
        out = torch.full((addrs.numel(),), -1, dtype=torch.int64)
        if own.any():
            out[own] = self.stores[r].read(DEVICE, slots[own]).reshape(-1)
        if hit.any():
            out[hit] = self.rows[r][bslots[hit], 0]
        missed = addrs[miss].unique()
        got = self._fetch(r, missed) if missed.numel() else missed
        if miss.any():
            out[miss] = got[torch.searchsorted(missed, addrs[miss])]
        keep, kslots = b.settle(addrs, insertable=missed)
        assert bool(torch.isin(keep, missed).all())
        if keep.numel():
            self.rows[r][kslots, 0] = got[torch.searchsorted(missed, keep)]
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
    assert c.fetched == 3 and b.stats.hits == 0 and b.stats.inserted == 3  # 0 is rank 0's
    c.advance()
    assert c.read(0, sel).tolist() == [1, 3, 5, 0]
    assert c.fetched == 3 and b.stats.hits == 3  # served from the buffer
    c.free(torch.tensor([3]))
    assert b.stats.invalidated == 1
    c.append(torch.tensor([3]))  # address 3 reused for a new token
    c.advance()
    assert c.read(0, sel).tolist() == [1, 8, 5, 0]  # the new value, not the buffered one
    assert c.fetched == 4


@pytest.mark.parametrize("lru", POLICIES)
def test_a_round_larger_than_the_buffer_keeps_a_prefix_and_never_evicts_this_round(lru):
    b = RemoteRowBuffer(64, 4, rank=0, world_size=2, lru=factory(lru))
    keep, slots = b.settle(torch.tensor([1, 3, 5]))
    assert keep.tolist() == [1, 3, 5] and b.used == 3
    # Same round: 1, 3, 5 were read in it and may not be evicted; one free slot is left.
    keep, _ = b.settle(torch.tensor([7, 9]))
    assert keep.tolist() == [7] and b.stats.evicted == 0
    assert b.slots_of(torch.tensor([1, 3, 5, 7])).ge(0).all()
    b.advance_round()
    keep, slots = b.settle(torch.tensor([9, 11]))  # now earlier rows make room
    assert keep.tolist() == [9, 11] and b.stats.evicted == 2 and b.used == 4
    assert b.slots_of(keep).tolist() == slots.tolist()


def test_only_insertable_misses_are_kept_and_owned_or_padding_are_ignored():
    b = RemoteRowBuffer(16, 8, rank=1, world_size=2)
    keep, _ = b.settle(torch.tensor([[0, 2, 4, -1], [1, 3, 2, 2]]), insertable=torch.tensor([2]))
    assert keep.tolist() == [2]  # 1 and 3 are rank 1's own; 0, 4 were not fetched
    assert b.stats.lookups == 3 and b.stats.hits == 0
    keep, _ = b.settle(torch.tensor([0, 2]))
    assert keep.tolist() == [0] and b.stats.hits == 1
    assert b.table.dtype == torch.int32  # 4 bytes per logical token


@pytest.mark.parametrize("P", [1, 2, 3, 5])
def test_buffer_ownership_is_token_shards(P):
    """A rank's buffer keeps exactly the in-range addresses TokenShard says it does not own
    (padding and addresses past the space never); replicated, every in-range address."""
    N = 30
    addrs = torch.arange(-2, N + 3)
    in_range = (addrs >= 0) & (addrs < N)
    for r in range(P):
        shard = TokenShard(r, P)
        b = RemoteRowBuffer(N, 64, rank=r, world_size=P)
        assert b.shard == shard
        keep, _ = b.settle(addrs)
        assert keep.tolist() == addrs[in_range & ~shard.owned(addrs)].tolist()
        assert torch.equal(b.slots_of(addrs) >= 0, in_range & ~shard.owned(addrs))
        rep = RemoteRowBuffer(N, 64, rank=r, world_size=P, replicated=True)
        keep, _ = rep.settle(addrs)
        assert keep.tolist() == addrs[in_range].tolist()


def test_bad_input():
    with pytest.raises(ValueError):
        RemoteRowBuffer(16, 0, rank=0, world_size=2)
    for rank, world in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="outside a world"):
            RemoteRowBuffer(16, 4, rank=rank, world_size=world)
    b = RemoteRowBuffer(16, 4, rank=0, world_size=2)
    assert b.invalidate(torch.tensor([99, -1])) == 0
    assert b.slots_of(torch.tensor([99, -1, 1])).tolist() == [-1, -1, -1]
    keep, _ = b.settle(torch.tensor([], dtype=torch.int64))
    assert keep.numel() == 0 and b.used == 0
    # World size 1: nothing is remote.
    one = RemoteRowBuffer(16, 4, rank=0, world_size=1)
    keep, _ = one.settle(torch.arange(8))
    assert keep.numel() == 0 and bool((one.slots_of(torch.arange(8)) == -1).all())


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


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(1, 24), st.integers(0, 6), st.integers(0, 2**31)),
                      min_size=1, max_size=30),
       lru=st.sampled_from(POLICIES), buf=st.integers(2, 12))
def test_settle_read_matches_settle(steps, lru, buf):
    """The TP worker's settle (`settle_read`: the read's own misses, less frees, instead of a
    second lookup and an isin) leaves the replicated directory exactly as `settle(insertable=)`
    does: same kept addresses and slots, same table, same counters, step after step, with
    frees between the read and the settle and padding in the reads."""
    N = 48
    a = RemoteRowBuffer(N, buf, rank=0, world_size=2, lru=factory(lru), replicated=True)
    b = RemoteRowBuffer(N, buf, rank=0, world_size=2, lru=factory(lru), replicated=True)
    for n, nfree, seed in steps:
        g = torch.Generator().manual_seed(seed)
        reads = torch.randint(-1, N, (n,), generator=g)
        # The forward: misses are the unique in-range addresses the directory lacks.
        v = a.slots_of(reads)
        assert torch.equal(v, b.slots_of(reads))
        fetched = torch.unique(reads.masked_select((reads >= 0) & (v < 0)))
        freed = torch.randint(0, N, (nfree,), generator=g)
        a.invalidate(freed)
        b.invalidate(freed)
        insertable = fetched.masked_select(~torch.isin(fetched, freed))
        ka, sa = a.settle(reads, insertable=insertable)
        kb, sb = b.settle_read(reads, insertable)
        assert ka.tolist() == kb.tolist() and sa.tolist() == sb.tolist()
        assert torch.equal(a.table, b.table)
        assert (a.stats.lookups, a.stats.hits, a.stats.inserted, a.stats.evicted) == (
            b.stats.lookups, b.stats.hits, b.stats.inserted, b.stats.evicted)
        a.advance_round()
        b.advance_round()
    with pytest.raises(ValueError, match="replicated"):
        RemoteRowBuffer(N, 4, rank=0, world_size=2).settle_read(reads, fetched)


def test_fill_control_skips_while_reads_seldom_hit_and_probes():
    """`fill_due`: True while the running hit rate (note_read, halved weight per read) is at
    least min_hit_rate; below it, True only every probe_every-th step, and a probe that finds
    reuse again brings every step back. min_hit_rate 0 always fills; bad values refused."""
    b = RemoteRowBuffer(64, 8, rank=0, world_size=2, replicated=True, min_hit_rate=0.1,
                        probe_every=4)
    assert b.hit_rate == 1.0 and b.fill_due()  # starts by filling
    due = []
    for _ in range(12):
        b.note_read(32, 0)
        due.append(b.fill_due())
    # 1.0 halves per read: 0.5, 0.25, 0.125 fill, then below 0.1: a probe every 4th step.
    assert due == [True, True, True, False, False, False, True, False, False, False, True,
                   False], due
    assert b.stats.skipped_fills == 7
    b.note_read(32, 32)  # reuse came back: 0.5 * ~0 + 0.5
    assert b.hit_rate > 0.5 and all(b.fill_due() for _ in range(5))
    b.note_read(0, 0)  # an empty read changes nothing
    assert b.hit_rate > 0.5
    always = RemoteRowBuffer(64, 8, rank=0, world_size=2, replicated=True)
    for _ in range(10):
        always.note_read(32, 0)
        assert always.fill_due()
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="min_hit_rate"):
            RemoteRowBuffer(64, 8, rank=0, world_size=2, min_hit_rate=bad)
    with pytest.raises(ValueError, match="probe_every"):
        RemoteRowBuffer(64, 8, rank=0, world_size=2, probe_every=0)
