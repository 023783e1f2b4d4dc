"""Property tests: random append / select / advance / free sequences over many requests."""

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lab import pblru_queue as pblru_mod
from lab.policies import factory
from _locations import located, tier_and_slot
from lab.row_store import RowStore
from ulacache_vllm.core import DEVICE, HOST, CapacityError, TieredMapping, TokenShard
from ulacache_vllm.core import pblru as labels_mod

POLICIES = ["pblru", "pblru_queue", "pblru_bitmap", "exact_ts", "exact_list"]

op = st.one_of(
    st.tuples(st.just("append"), st.integers(0, 5), st.integers(1, 12)),
    st.tuples(st.just("select"), st.lists(st.integers(0, 5), min_size=1, max_size=3),
              st.integers(0, 2**31)),
    st.tuples(st.just("advance")),
    st.tuples(st.just("free"), st.integers(0, 5)),
    # The engine's step: last step's selection settled and this step's rows assigned as one
    # plan (`settle_and_assign`), across a round boundary.
    st.tuples(st.just("settle_append"), st.lists(st.integers(0, 5), max_size=3),
              st.integers(0, 2**31), st.integers(0, 5), st.integers(0, 12)),
)


def check_invariants(m: TieredMapping, store: RowStore, live: dict):
    addrs = torch.tensor(sorted(live), dtype=torch.int64)
    S_dev, S_host = m.dev.num_slots, m.host.num_slots
    # Pools: owner tables and free stacks agree with the counts and with each other.
    for pool in (m.dev, m.host):
        owned = (pool.owner >= 0).sum().item()
        assert owned == pool.num_used
        stack = pool.stack[:pool.num_free]
        assert stack.unique().numel() == pool.num_free, "slot twice on the free stack"
        assert (pool.owner.index_select(0, stack) < 0).all(), "owned slot on the free stack"
    assert m.dev.num_used + m.host.num_used == len(live)
    assert torch.equal(m.loc, m.visible), "no plan outstanding: the tables agree"
    if not live:
        return
    t, s = tier_and_slot(m, addrs)
    assert set(t.tolist()) <= {DEVICE, HOST}, "a live entry is missing"
    key = t * (1 << 40) + s
    assert key.unique().numel() == len(live), "two live entries share a slot"
    dev, host = t == DEVICE, t == HOST
    assert (m.dev.owner[s[dev]] == addrs[dev]).all()
    assert (m.host.owner[s[host]] == addrs[host]).all()
    # Data followed every move (including staged swaps).
    vals = torch.tensor([live[a] for a in addrs.tolist()])
    got = torch.where(dev, store.bufs[DEVICE][s.clamp(0, S_dev - 1), 0],
                      store.bufs[HOST][s.clamp(0, S_host - 1), 0])
    assert torch.equal(got, vals)
    if m.policy.name.startswith("pblru"):
        b = m.policy.bucket_of()
        assert ((b >= 0) == (m.dev.owner >= 0)).all(), "occupied slot outside the buckets"


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# A failed selection's device hits stay marked used: the next selection may then fail too.
@example(ops=[("append", 0, 1), ("append", 1, 3), ("advance",), ("append", 0, 3),
              ("append", 0, 3), ("select", [1], 0), ("select", [0], 0)],
         lru="exact_list", dev_slots=7, host_extra=0, ring=1, small=False, promote_after=1)
# promote_after 2: a host entry read once stays; read in the next settle too, it is promoted;
# freed and written again, it starts over.
@example(ops=[("append", 0, 4), ("advance",), ("append", 1, 4), ("advance",), ("append", 2, 4),
              ("advance",), ("select", [0], 1), ("select", [0], 1)],
         lru="pblru", dev_slots=8, host_extra=0, ring=1, small=False, promote_after=2)
# promote_after 3: the third read from the host in a row promotes (settle_append reads too).
@example(ops=[("append", 0, 4), ("advance",), ("append", 1, 4), ("advance",), ("append", 2, 4),
              ("advance",), ("select", [0], 1), ("settle_append", [0], 1, 3, 0),
              ("select", [0], 1)],
         lru="exact_ts", dev_slots=8, host_extra=0, ring=1, small=False, promote_after=3)
# ... and an entry read just before it was freed starts over when its address is reused.
@example(ops=[("append", 0, 4), ("advance",), ("append", 1, 4), ("advance",), ("append", 2, 4),
              ("advance",), ("select", [0], 1), ("free", 0), ("append", 0, 4), ("advance",),
              ("append", 3, 4), ("advance",), ("append", 4, 4), ("advance",), ("select", [0], 1)],
         lru="exact_ts", dev_slots=8, host_extra=0, ring=1, small=False, promote_after=2)
@given(ops=st.lists(op, min_size=1, max_size=40), lru=st.sampled_from(POLICIES),
       dev_slots=st.integers(4, 40), host_extra=st.integers(0, 20), ring=st.integers(1, 4),
       small=st.booleans(), promote_after=st.sampled_from([1, 1, 2, 3]))
def test_random_sequences(ops, lru, dev_slots, host_extra, ring, small, promote_after):
    num_logical = 6 * 64
    host_slots = 6 * 30 - dev_slots + host_extra  # small extra: the host often fills up
    # small: the PB-LRUs on their small-pool scan path (tests/core runs their own by default).
    old = pblru_mod.SMALL_POOL_SLOTS, labels_mod.SMALL_POOL_SLOTS
    pblru_mod.SMALL_POOL_SLOTS = labels_mod.SMALL_POOL_SLOTS = 4096 if small else 0
    try:
        m = TieredMapping(num_logical, dev_slots, host_slots, lru=factory(lru), ring_size=ring,
                          promote_after=promote_after)
    finally:
        pblru_mod.SMALL_POOL_SLOTS, labels_mod.SMALL_POOL_SLOTS = old
    if lru == "pblru_queue":
        assert m.policy.victim_path == ("scan" if small else "queue")
    elif lru == "pblru":
        assert m.policy.victim_path == ("scan" if small else "rounds")
    store = RowStore(dev_slots, host_slots)
    lens = {r: 0 for r in range(6)}
    live: dict[int, int] = {}
    round_touched: set[int] = set()
    counter = [1000]
    # Promotion admission, modelled: each entry's last settle it was read from the host in,
    # and its run of such settles.
    reads: dict[int, tuple[int, int]] = {}
    settles = [0]

    def admitted(uniq, on_host):
        """Which host entries a settle of ``uniq`` promotes, and the reads it records."""
        runs = {}
        for a in on_host:
            last, run = reads.get(a, (-2, 0))
            runs[a] = run + 1 if last == settles[0] - 1 else 1
        return {a for a in on_host if runs[a] >= promote_after}, runs

    def commit(runs):
        reads.update((a, (settles[0], r)) for a, r in runs.items())
        settles[0] += 1

    def stats_moved(before, uniq, hits, promoted):
        s = m.stats
        got = (s.lookups - before[0], s.hits - before[1], s.promotions - before[2],
               s.deferred - before[3])
        assert got == (len(uniq), len(hits), len(promoted), len(uniq) - len(hits) - len(promoted))

    def stats_now():
        return m.stats.lookups, m.stats.hits, m.stats.promotions, m.stats.deferred

    def value():
        counter[0] += 1
        return counter[0]

    def selection(reqs, seed):
        g = torch.Generator().manual_seed(seed)
        parts = []
        for r in reqs:
            if lens[r]:
                k = int(torch.randint(1, lens[r] + 1, (1,), generator=g))
                parts.append(r * 64 + torch.randint(0, lens[r], (k,), generator=g))
        return parts

    for o in ops:
        if o[0] == "settle_append":
            _, reqs, seed, r, n = o
            sel = torch.cat(selection(reqs, seed) + [torch.tensor([-1])])  # + padding
            n = max(0, min(n, 30 - lens[r], dev_slots // 2))
            new = torch.arange(r * 64 + lens[r], r * 64 + lens[r] + n)
            uniq = sorted(set(sel.tolist()) - {-1})
            t0, _ = tier_and_slot(m, uniq)
            on_host = {a for a, t in zip(uniq, t0.tolist()) if t == HOST}
            misses, runs = admitted(uniq, on_host)
            snap = (m.loc.clone(), m.dev.num_free, m.host.num_free, m.stats.plans)
            st0 = stats_now()
            out = m.settle_and_assign(sel, new)
            if out is None:  # not applicable: nothing changed, the engine goes one by one
                assert torch.equal(m.loc, snap[0]) and (m.dev.num_free, m.host.num_free,
                                                        m.stats.plans) == snap[1:]
                assert len(misses) + n > m.dev.num_free, "refused with free room"
                check_invariants(m, store, live)
                continue
            commit(runs)
            stats_moved(st0, uniq, set(uniq) - on_host, misses)
            slots, plan = out
            assert slots.shape == new.shape
            plan.apply(store.copy_fn)
            if n:
                vals = [value() for _ in range(n)]
                store.write(DEVICE, slots, torch.tensor(vals))
                live.update(zip(new.tolist(), vals))
                lens[r] += n
            # The misses were promoted and the new rows sit where the call said.
            if misses:
                t, _ = tier_and_slot(m, sorted(misses))
                assert (t == DEVICE).all(), "a settled miss is not device-resident"
            if on_host - misses:  # read too few times in a row: left on the host
                t, _ = tier_and_slot(m, sorted(on_host - misses))
                assert (t == HOST).all(), "a deferred entry moved"
            if n:
                t, s_ = tier_and_slot(m, new)
                assert (t == DEVICE).all() and torch.equal(s_, slots)
            round_touched = misses | set(new.tolist())  # the new round's working set so far
            check_invariants(m, store, live)
            continue
        if o[0] == "append":
            _, r, n = o
            n = min(n, 30 - lens[r], dev_slots // 2)
            if n <= 0:
                continue
            addrs = torch.arange(r * 64 + lens[r], r * 64 + lens[r] + n)
            before = _dev_slots_of(m, round_touched)
            try:
                slots, plan = m.assign(addrs)
            except CapacityError:
                check_invariants(m, store, live)
                continue
            assert not (set(plan.demote_src_device.tolist()) & before), "evicted a current-round slot"
            plan.apply(store.copy_fn)
            vals = [value() for _ in range(n)]
            store.write(DEVICE, slots, torch.tensor(vals))
            live.update(zip(addrs.tolist(), vals))
            lens[r] += n
            round_touched |= set(addrs.tolist())
        elif o[0] == "select":
            _, reqs, seed = o
            parts = selection(reqs, seed)
            if not parts:
                continue
            parts.append(torch.tensor([-1]))
            addrs = torch.cat(parts)  # duplicates + padding on purpose
            before = _dev_slots_of(m, round_touched)
            uniq = set(addrs.tolist()) - {-1}
            t0, _ = tier_and_slot(m, sorted(uniq))
            hits = {a for a, t in zip(sorted(uniq), t0.tolist()) if t == DEVICE}
            promoted, runs = admitted(uniq, uniq - hits)
            st0 = stats_now()
            try:
                slots, plan = m.ensure_resident(addrs)
            except CapacityError:
                assert len(hits | promoted | round_touched) > dev_slots, "spurious CapacityError"
                assert stats_now() == st0
                # A failed call's hits stay marked used this round (documented): they are
                # this round's working set from now on, like any touched entry.
                round_touched |= hits
                check_invariants(m, store, live)
                continue
            assert not (set(plan.demote_src_device.tolist()) & before), "evicted a current-round slot"
            assert (slots[addrs < 0] == -1).all()
            commit(runs)
            stats_moved(st0, uniq, hits, promoted)
            plan.apply(store.copy_fn)
            ok = addrs >= 0
            t, s = tier_and_slot(m, addrs[ok])
            resident = torch.tensor([a in hits | promoted for a in addrs[ok].tolist()],
                                    dtype=torch.bool)
            assert torch.equal(t == DEVICE, resident), "promoted exactly the admitted misses"
            assert torch.equal(torch.where(resident, s, -1), slots[ok])
            round_touched |= hits | promoted
        elif o[0] == "advance":
            m.advance_round()
            round_touched = set()
        else:
            r = o[1]
            addrs = torch.arange(r * 64, r * 64 + 64)  # includes never-assigned addresses
            m.free(addrs)
            for a in range(r * 64, r * 64 + lens[r]):
                live.pop(a, None)
                round_touched.discard(a)
                reads.pop(a, None)  # a freed entry's reads are forgotten
            lens[r] = 0
        check_invariants(m, store, live)

    m.free(torch.arange(num_logical))
    check_invariants(m, store, {})
    assert m.dev.num_free == dev_slots and m.host.num_free == host_slots
    if lru.startswith("pblru"):
        assert (m.policy.bucket_of() == -1).all()


def _dev_slots_of(m, addrs):
    if not addrs:
        return set()
    t, s = tier_and_slot(m, sorted(addrs))
    return set(s[t == DEVICE].tolist())


@settings(max_examples=25, deadline=None)
@given(lru=st.sampled_from(POLICIES), n_dev=st.integers(2, 16), seed=st.integers(0, 10**6))
def test_locate_commits_after_the_copies(lru, n_dev, seed):
    """Until a plan's copies are done, locate shows the old locations (whose rows are still
    there); after ``apply``, the new ones."""
    g = torch.Generator().manual_seed(seed)
    n = 3 * n_dev
    m = TieredMapping(n, n_dev, n, lru=factory(lru))
    store = RowStore(n_dev, n)
    for a in range(n):  # fill: older entries are demoted to the host
        slots, plan = m.assign(torch.tensor([a]))
        plan.apply(store.copy_fn)
        store.write(DEVICE, slots, torch.tensor([a]))
        m.advance_round()
    sel = torch.randperm(n, generator=g)[: n_dev]
    before = located(m, sel)
    t0, s0 = tier_and_slot(m, sel)
    seen = []

    def copy(*args):
        seen.append(torch.equal(located(m, sel), before))
        store.copy_fn(*args)

    slots, plan = m.ensure_resident(sel)
    assert torch.equal(located(m, sel), before)
    old = torch.where(t0 == DEVICE, store.bufs[DEVICE][s0.clamp(0, n_dev - 1), 0],
                      store.bufs[HOST][s0.clamp(0, n - 1), 0])
    assert torch.equal(old, sel), "the old locations' rows must still be there"
    plan.apply(copy)
    assert all(seen) and (len(seen) > 0) == (not plan.empty)
    t, s = tier_and_slot(m, sel)
    assert (t == DEVICE).all() and torch.equal(s, slots)
    assert torch.equal(store.bufs[DEVICE][s, 0], sel)


def _written_one_per_round(num_logical: int, dev: int, host: int, n: int):
    """A PB-LRU mapping and its rows after ``n`` single-entry writes, one round each (entry
    ``a`` holds ``100 + a``): the oldest spill to the host once the device is full."""
    m = TieredMapping(num_logical, dev, host, lru="pblru", ring_size=8)
    store = RowStore(dev, host)
    for a in range(n):
        slots, plan = m.assign(torch.tensor([a]))
        plan.apply(store.copy_fn)
        store.write(DEVICE, slots, torch.tensor([100 + a]))
        m.advance_round()
    return m, store


def test_staging_when_host_full():
    """Device and host both full: promotions and demotions swap through staging rows."""
    m, store = _written_one_per_round(8, 4, 4, 8)
    assert m.device_used == 4 and m.host_used == 4
    slots, plan = m.ensure_resident(torch.arange(4))
    assert plan.num_staged == 4 and m.stats.staged == 4
    plan.apply(store.copy_fn)
    t, s = tier_and_slot(m, torch.arange(8))
    assert (t[:4] == DEVICE).all() and (t[4:] == HOST).all()
    vals = torch.where(t == DEVICE, store.bufs[DEVICE][s, 0], store.bufs[HOST][s, 0])
    assert torch.equal(vals, 100 + torch.arange(8))


def test_settle_and_assign_swaps_through_staging_and_refuses_what_cannot_fit():
    """The merged settle + writes plan: with both pools full, the selection's host rows come
    back through staging while their device victims take the host slots they vacate, and the
    new entries land on victim slots, all data where the tables say. A step that needs more
    victims than the device holds (or host slots than there are) is refused with nothing
    changed; so is a re-assignment (the engine then goes one call at a time)."""
    m, store = _written_one_per_round(16, 4, 6, 8)
    assert m.device_used == 4 and m.host_used == 4  # 0-3 on the host, 4-7 on the device
    # 2 misses + 2 new rows: 4 victims, 2 free host slots + the 2 the misses vacate.
    slots, plan = m.settle_and_assign(torch.tensor([0, 1, 0, -1, 5]), torch.tensor([8, 9]))
    assert plan.num_staged == 2 and plan.demote_src_device.numel() == 4
    plan.apply(store.copy_fn)
    store.write(DEVICE, slots, torch.tensor([108, 109]))
    t, s = tier_and_slot(m, torch.arange(10))
    assert t[[0, 1, 8, 9]].eq(DEVICE).all() and m.device_used == 4 and m.host_used == 6
    vals = torch.where(t == DEVICE, store.bufs[DEVICE][s.clamp(max=3), 0], store.bufs[HOST][s, 0])
    assert torch.equal(vals, 100 + torch.arange(10))
    assert torch.equal(m.loc, m.visible)
    before = m.loc.clone()
    assert m.settle_and_assign(torch.tensor([2, 3]), torch.arange(10, 13)) is None  # 5 > 4
    assert m.settle_and_assign(torch.tensor([-1]), torch.tensor([8])) is None  # re-assign
    assert torch.equal(m.loc, before) and m.device_used == 4 and m.host_used == 6


def test_capacity_error_and_unassigned():
    m = TieredMapping(64, 4, 60)
    for a in range(0, 10, 2):
        m.apply(m.assign(torch.arange(a, a + 2))[1], lambda *a: None)
        m.advance_round()
    try:
        m.ensure_resident(torch.arange(5))
        raise AssertionError("expected CapacityError")
    except CapacityError:
        pass
    assert m.device_used == 4 and m.host_used == 6
    try:
        m.ensure_resident(torch.tensor([40]))
        raise AssertionError("expected KeyError")
    except KeyError:
        pass


def test_tp_placement():
    """TP shard mode: each rank maps the addresses TokenShard gives it (local ``a // P``) in a
    mapping of ``local_count(N)`` entries; every address is on exactly one rank."""
    P, N = 4, 100
    shards = [TokenShard(r, P) for r in range(P)]
    maps = [TieredMapping(s.local_count(N), 8, 32) for s in shards]
    assert [m.num_logical for m in maps] == [25] * P
    addrs = torch.arange(20)
    assert (torch.stack([s.owned(addrs) for s in shards]).sum(0) == 1).all()
    probe = torch.tensor([0, 1, 2, 3, -1])
    for r, (shard, m) in enumerate(zip(shards, maps)):
        slots, plan = m.assign(shard.local(addrs))
        assert plan.empty and ((slots >= 0) == (addrs % P == r)).all()
        assert m.device_used == 5
        t, s = tier_and_slot(m, shard.local(probe))
        assert t.tolist() == [DEVICE if i == r else -1 for i in range(4)] + [-1]
        assert s[r] == slots[r] and (s[torch.arange(5) != r] == -1).all()
        m.free(shard.local(addrs))
        assert m.device_used == 0
    # Local addresses stop at local_count(N): the last address of the space maps, one past it
    # is refused (the mapping validates what it is given).
    last = shards[(N - 1) % P]
    m = maps[(N - 1) % P]
    assert last.local(torch.tensor([N - 1])).item() == m.num_logical - 1
    m.assign(last.local(torch.tensor([N - 1])))
    with pytest.raises(KeyError):
        m.assign(last.local(torch.tensor([N - 1 + P])))


@settings(max_examples=60, deadline=None)
@given(P=st.integers(1, 9), N=st.integers(0, 120))
def test_token_shard_rule(P, N):
    """TokenShard: ``a`` is owned by rank ``a % P`` only, at local address ``a // P``; -1
    padding (and any negative address) is never owned; ``local_count(N)`` is how many of
    0..N-1 a rank owns, and its local addresses are exactly 0..local_count(N)-1."""
    addrs = torch.arange(-3, N)
    owners = torch.zeros(addrs.shape, dtype=torch.int64)
    for r in range(P):
        s = TokenShard(r, P)
        own, loc = s.owned(addrs), s.local(addrs)
        want = [a >= 0 and a % P == r for a in addrs.tolist()]
        assert own.tolist() == want
        assert loc.tolist() == [a // P if w else -1 for a, w in zip(addrs.tolist(), want)]
        assert s.local_count(N) == sum(want)
        assert loc[own].tolist() == list(range(s.local_count(N)))
        owners += own
        # int32 addresses (vLLM's top-k indices) and batch shapes: the same answers.
        a32 = addrs.to(torch.int32)
        assert torch.equal(s.owned(a32), own) and s.local(a32).tolist() == loc.tolist()
        two_d = addrs[: (addrs.numel() // 2) * 2].reshape(2, -1)
        assert s.local(two_d).shape == two_d.shape
        assert s.local(two_d).reshape(-1).tolist() == loc[: two_d.numel()].tolist()
    assert (owners[addrs >= 0] == 1).all() and (owners[addrs < 0] == 0).all()
    assert sum(TokenShard(r, P).local_count(N) for r in range(P)) == N


def test_token_shard_refuses_a_rank_outside_the_world():
    for rank, world in ((4, 4), (-1, 4), (0, 0), (5, 2)):
        with pytest.raises(ValueError, match="outside a world"):
            TokenShard(rank, world)
    # No packed rank field any more: any world size works.
    big = TokenShard(70000, 70001)
    assert big.local(torch.tensor([70000, 0, 140001, -1])).tolist() == [0, -1, 1, -1]
    assert big.local_count(70000) == 0 and big.local_count(70001) == 1


def test_pblru_default_queue_capacity_fits_int32_positions():
    from lab.pblru_queue import UNTRACKED, default_queue_capacity

    assert default_queue_capacity(1000) == 8 * 1000 + 4096
    for S in (2**28 - 1, 2**28, 2**29, 2**30 - 1):  # (not allocated here: gigabytes)
        q = default_queue_capacity(S)
        assert 2 * S <= q < UNTRACKED, S
    assert default_queue_capacity(2**30) >= UNTRACKED  # refused by PBLRU: too large for int32


pol_op = st.one_of(
    st.tuples(st.just("new"), st.integers(1, 8), st.integers(0, 2**31)),
    st.tuples(st.just("hit"), st.integers(1, 8), st.integers(0, 2**31)),
    st.tuples(st.just("release"), st.integers(1, 4), st.integers(0, 2**31)),
    st.tuples(st.just("select"), st.integers(1, 6)),
    st.tuples(st.just("advance")),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(pol_op, min_size=1, max_size=80), S=st.integers(2, 24),
       cap_extra=st.integers(0, 6), small=st.sampled_from([0, 4096]))
def test_queue_pblru_is_exact_lru(ops, S, cap_extra, small):
    """The queue PB-LRU picks exactly ListLRU's victims (same CapacityErrors; on the queue path in the
    same order, on the small-pool scan path as a set), including
    across queue compactions (tiny queue capacity), releases and re-touches; the timestamp
    LRU the same set."""
    from lab.list_lru import ListLRU
    from lab.pblru_queue import QueuePBLRU
    from lab.policies import make as make_policy
    from ulacache_vllm.core import TimestampLRU

    # small=0: the queue at every size; 4096: these pools take the small-pool scan path.
    pb = make_policy("pblru_queue", S, "cpu", small_pool_slots=small,
                     queue_capacity=2 * S + cap_extra)
    assert isinstance(pb, QueuePBLRU) == (small == 0)
    ex = ListLRU(S, "cpu")
    ts = TimestampLRU(S, "cpu")
    tracked: list[int] = []
    cur: set[int] = set()

    def pick(pool, n, seed):
        if not pool:
            return []
        g = torch.Generator().manual_seed(seed)
        idx = torch.randperm(len(pool), generator=g)[:n].tolist()
        return [pool[i] for i in idx]

    for o in ops:
        if o[0] in ("new", "hit"):
            pool = [s for s in range(S) if s not in tracked] if o[0] == "new" else list(tracked)
            sl = pick(pool, o[1], o[2])
            if not sl:
                continue
            t = torch.tensor(sl, dtype=torch.int64)
            if o[0] == "new":
                pb.touch(t)
                ex.touch(t)
                ts.touch(t)
                tracked += sl
            else:  # hit detection path: table values of device entries are the slots
                vals = torch.cat([t, torch.tensor([-1, (1 << 32) | 3])])
                h1, h2, h3 = (p.hit_touch(vals) for p in (pb, ex, ts))
                assert torch.equal(h1, h2) and torch.equal(h1, h3)
                assert h1.tolist() == [True] * len(sl) + [False, False]
            cur |= set(sl)
        elif o[0] == "release":
            sl = pick(tracked, o[1], o[2])
            if not sl:
                continue
            pb.release(torch.tensor(sl))
            ex.release(torch.tensor(sl))
            ts.release(torch.tensor(sl))
            tracked = [s for s in tracked if s not in sl]
            cur -= set(sl)
        elif o[0] == "select":
            k = o[1]
            r = []
            for p in (pb, ex, ts):
                try:
                    r.append(p.select_victims(k).tolist())
                except CapacityError:
                    r.append("cap")
            # Same victims; the queue also returns them in ListLRU's order, the small-pool
            # top-k scan in none (order does not change which entries stay resident).
            if pb.victim_path == "queue":
                assert r[0] == r[1], r
            else:
                assert (sorted(r[0]) if r[0] != "cap" else r[0]) == (sorted(r[1]) if r[1] != "cap" else r[1]), r
            # The timestamp scan returns the same victims, in no particular order.
            assert (sorted(r[2]) if r[2] != "cap" else r[2]) == (sorted(r[1]) if r[1] != "cap" else r[1])
            if r[0] != "cap":
                assert not set(r[0]) & cur, "evicted a current-round slot"
                tracked = [s for s in tracked if s not in r[0]]
        else:
            pb.advance_round()
            ex.advance_round()
            ts.advance_round()
            cur = set()
        b = pb.bucket_of()
        assert set((b >= 0).nonzero().squeeze(1).tolist()) == set(tracked)
        assert set((b == 1).nonzero().squeeze(1).tolist()) == cur


@pytest.mark.parametrize("seed", [0, 1])
def test_queue_pblru_is_exact_lru_large_windows(seed):
    """Large pools: scan windows beyond the lazy-head limit (exact head advance read off qpos),
    multi-window selections and window-view reuse pick exactly ListLRU's victims."""
    from lab.list_lru import ListLRU
    from lab.pblru_queue import QueuePBLRU

    S = 6000
    g = torch.Generator().manual_seed(seed)
    pb, ex = QueuePBLRU(S, "cpu"), ListLRU(S, "cpu")
    tracked = torch.zeros(S, dtype=torch.bool)
    for _ in range(60):
        free = (~tracked).nonzero().squeeze(1)
        new = free.index_select(0, torch.randperm(free.numel(), generator=g)[: int(torch.randint(0, 1500, (1,), generator=g))])
        for p in (pb, ex):
            p.touch(new)
        tracked.index_fill_(0, new, True)
        live = tracked.nonzero().squeeze(1)
        hit = live.index_select(0, torch.randperm(live.numel(), generator=g)[: int(torch.randint(0, 2500, (1,), generator=g))])
        for p in (pb, ex):
            p.touch(hit)
        if int(torch.randint(0, 4, (1,), generator=g)) == 0:
            rel = live.index_select(0, torch.randperm(live.numel(), generator=g)[:200])
            for p in (pb, ex):
                p.release(rel)
            tracked.index_fill_(0, rel, False)
        for p in (pb, ex):
            p.advance_round()
        n_old = int(tracked.sum())
        for k in (int(torch.randint(1, 3000, (1,), generator=g)), 1, 7):
            k = min(k, n_old)
            if k == 0:
                continue
            a, b = pb.select_victims(k), ex.select_victims(k)
            assert torch.equal(a, b)
            tracked.index_fill_(0, a, False)
            n_old -= k
        bk = pb.bucket_of()
        assert torch.equal(bk >= 0, tracked)


@pytest.mark.parametrize("seed,pass_budget", [(0, 4096), (1, 1), (2, 1), (3, 8)])
def test_queue_pblru_ring_wraps_exact(seed, pass_budget):
    """A small ring: pushes wrap around its end (padding), victim windows cross it, a ring more
    than half full is compacted incrementally (passes over several pushes with a small
    budget, victim searches jumping over a pass's dead stretch), a full ring compacts at once;
    victims stay exactly ListLRU's, CapacityErrors agree, and the queue invariants
    (``bucket_of``) hold throughout."""
    from _policy_drive import select_all
    from lab.list_lru import ListLRU
    from lab.pblru_queue import QueuePBLRU

    S = 48
    g = torch.Generator().manual_seed(seed)
    pb, ex = QueuePBLRU(S, "cpu", queue_capacity=2 * S + 7), ListLRU(S, "cpu")
    pb.pass_budget_min = pass_budget
    tracked = torch.zeros(S, dtype=torch.bool)
    crossed = partial = 0

    def rnd(n):
        return int(torch.randint(0, n, (1,), generator=g))

    for it in range(800):
        op = rnd(6) if (it // 100) % 3 != 2 else rnd(4)  # phases without selections fill the ring
        if op == 0:  # new entries
            free = (~tracked).nonzero().squeeze(1)
            new = free.index_select(0, torch.randperm(free.numel(), generator=g)[: rnd(12)])
            for p in (pb, ex):
                p.touch(new)
            tracked.index_fill_(0, new, True)
        elif op == 1:  # hits through hit detection
            live = tracked.nonzero().squeeze(1)
            hit = live.index_select(0, torch.randperm(live.numel(), generator=g)[: rnd(20)])
            a, b = pb.hit_touch(hit), ex.hit_touch(hit)
            assert torch.equal(a, b) and bool(a.all())
        elif op == 2:
            for p in (pb, ex):
                p.advance_round()
        elif op == 3 and rnd(4) == 0:
            live = tracked.nonzero().squeeze(1)
            rel = live.index_select(0, torch.randperm(live.numel(), generator=g)[: rnd(4)])
            for p in (pb, ex):
                p.release(rel)
            tracked.index_fill_(0, rel, False)
        else:
            lap = pb.head // pb.cap
            vic = select_all((pb, ex), 1 + rnd(16))
            if vic is not None:
                crossed += pb.head // pb.cap != lap
                tracked.index_fill_(0, vic, False)
        assert torch.equal(pb.bucket_of() >= 0, tracked)
        partial += pb._pass is not None
    assert pb.wraps > 5 and crossed > 2, (pb.wraps, crossed)
    # A budget of 8 keeps the passes ahead of the pushes here: the ring never fills. A budget of
    # 1 lags (a full ring compacts at once), and 4096 does a whole pass in one push.
    assert (pb.compactions == 0) if pass_budget == 8 else (pb.compactions > 0), pb.compactions
    assert pb.passes > 5 and (partial > 5 or pass_budget > S), (pb.passes, partial)


def test_small_pool_threshold_is_read_when_a_policy_is_built(monkeypatch):
    from lab.policies import make as make_policy

    monkeypatch.setenv("ULACACHE_PBLRU_SMALL_POOL_SLOTS", "100")
    for name, own in (("pblru_queue", "queue"), ("pblru", "rounds")):
        assert make_policy(name, 100, "cpu").victim_path == "scan"
        assert make_policy(name, 101, "cpu").victim_path == own
        assert make_policy(name, 50, "cpu", small_pool_slots=0).victim_path == own  # arg wins
    assert TieredMapping(64, 100, 8, lru=factory("pblru_queue")).policy.victim_path == "scan"
    assert TieredMapping(64, 100, 8, lru="pblru").policy.victim_path == "scan"
    # A policy with one way of finding victims reports its name (EvictionPolicy.victim_path).
    assert make_policy("exact_ts", 10, "cpu").victim_path == "exact_ts"
    assert make_policy("exact_list", 10, "cpu").victim_path == "exact_list"
    monkeypatch.setenv("ULACACHE_PBLRU_SMALL_POOL_SLOTS", "lots")
    with pytest.raises(ValueError, match="ULACACHE_PBLRU_SMALL_POOL_SLOTS must be an integer"):
        make_policy("pblru_queue", 10, "cpu")


@pytest.mark.parametrize("name", ["pblru_queue", "pblru"])
def test_a_small_pool_gets_the_scan_under_the_requested_name(name):
    """The factory decides the small-pool case once: the scan is its own policy object (no
    method rebinding), named after the requested policy, and picks exact-LRU victims."""
    from lab.policies import make as make_policy
    from ulacache_vllm.core.exact_lru import SmallPoolScan

    p = make_policy(name, 64, "cpu", small_pool_slots=100)
    assert isinstance(p, SmallPoolScan) and p.name == name and p.victim_path == "scan"
    p.touch(torch.arange(4))
    p.advance_round()
    assert p.select_victims(2).tolist() == [0, 1]
    q = make_policy(name, 64, "cpu", small_pool_slots=0)
    assert not isinstance(q, SmallPoolScan) and not vars(q).keys() & {"touch", "select_victims"}
    q.touch(torch.arange(4))
    q.advance_round()
    assert q.select_victims(2).tolist() == [0, 1]
    from ulacache_vllm.core.policies import make_policy as product_policy

    with pytest.raises(ValueError, match="lru must be one of pblru.exact_ts"):
        product_policy("pblru_queue", 8, "cpu")  # a lab baseline: passed as a factory only
