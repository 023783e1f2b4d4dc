"""Failure paths of the mapping: errors change nothing, one move plan at a time (copied, then
committed), a failed copy drops the plan's entries and nothing else."""

import pytest
import torch

from lab.policies import NAMES as POLICIES
from lab.policies import factory
from _locations import located, tier_and_slot
from lab.row_store import RowStore
from ulacache_vllm.core import DEVICE, HOST, CapacityError, TieredMapping, TokenShard


def _filled(lru, n_dev, n_host, n_entries, store=None):
    """Entries 0..n_entries-1 written one per round (value 100 + address): the oldest end up
    on the host."""
    m = TieredMapping(64, n_dev, n_host, lru=factory(lru))
    store = store or RowStore(n_dev, n_host)
    for a in range(n_entries):
        slots, plan = m.assign(torch.tensor([a]))
        plan.apply(store.copy_fn)
        store.write(DEVICE, slots, torch.tensor([100 + a]))
        m.advance_round()
    return m, store


def _snapshot(m):
    return (m.loc.clone(), m.visible.clone(), m.dev.owner.clone(), m.host.owner.clone(),
            m.dev.num_free, m.host.num_free, m.stats.lookups, m.stats.hits, m.stats.promotions)


def _same(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def _values(m, store, addrs):
    t, s = tier_and_slot(m, addrs)
    assert set(t.tolist()) <= {DEVICE, HOST}, t
    return torch.where(t == DEVICE, store.bufs[DEVICE][s.clamp(0, store.bufs[DEVICE].shape[0] - 1), 0],
                       store.bufs[HOST][s.clamp(0, store.bufs[HOST].shape[0] - 1), 0]).tolist()


@pytest.mark.parametrize("lru", list(POLICIES))
def test_failed_reassign_keeps_the_old_entries(lru):
    m, _ = _filled(lru, 2, 4, 2)
    m.ensure_resident(torch.tensor([0, 1]))  # both device slots used this round
    before = _snapshot(m)
    with pytest.raises(CapacityError):
        m.assign(torch.tensor([0, 5]))  # re-assign 0 (its slot is reused) + one more: no room
    assert _same(before, _snapshot(m))
    t, _ = tier_and_slot(m, [0, 1])
    assert t.tolist() == [DEVICE, DEVICE]
    m.advance_round()
    slots, plan = m.assign(torch.tensor([0, 5]))  # next round it fits, 0 keeps a slot
    assert (slots >= 0).all() and m.device_used == 2


@pytest.mark.parametrize("lru", list(POLICIES))
def test_failed_ensure_resident_changes_no_table_pool_or_stat(lru):
    m, store = _filled(lru, 4, 8, 8)  # 4-7 on the device, 0-3 on the host
    before = _snapshot(m)
    with pytest.raises(CapacityError):
        m.ensure_resident(torch.tensor([4, 5, 6, 7, 0]))  # 5 entries, 4 device slots
    assert _same(before, _snapshot(m))
    with pytest.raises(KeyError):
        m.ensure_resident(torch.tensor([4, 5, 40]))  # 40 never assigned
    assert _same(before, _snapshot(m))
    m.advance_round()
    _, plan = m.ensure_resident(torch.tensor([0]))
    plan.apply(store.copy_fn)
    assert m.stats.lookups == before[6] + 1 and m.stats.promotions == before[8] + 1
    assert _values(m, store, list(range(8))) == [100 + a for a in range(8)]


def test_unknown_address_does_not_mark_hits_used():
    m, store = _filled("pblru", 4, 8, 8)
    with pytest.raises(KeyError):
        m.ensure_resident(torch.tensor([4, 5, 6, 7, 40]))
    _, plan = m.ensure_resident(torch.tensor([0]))  # 4-7 are still evictable this round
    plan.apply(store.copy_fn)
    assert m.stats.demotions > 0


@pytest.mark.parametrize("lru", list(POLICIES))
def test_one_plan_at_a_time_and_copy_before_commit(lru):
    """A non-empty plan must be applied before the mapping changes again; until then the
    committed table shows the plan's entries where their rows still are, and it is updated
    only after every copy."""
    m, store = _filled(lru, 4, 8, 8)  # 4-7 on the device, 0-3 on the host
    before = located(m, torch.arange(8))
    _, plan = m.ensure_resident(torch.tensor([0]))  # promote 0, demote the oldest of 4-7
    assert not plan.empty and plan.state == "planned"
    for call in (lambda: m.assign(torch.tensor([9])), lambda: m.ensure_resident(torch.tensor([1])),
                 lambda: m.free(torch.tensor([0])), lambda: m.adopt([9], [0])):
        with pytest.raises(RuntimeError, match="outstanding"):
            call()
    assert torch.equal(located(m, torch.arange(8)), before)
    assert _values(m, store, list(range(8))) == [100 + a for a in range(8)]
    seen = []

    def copy(*a):
        seen.append(torch.equal(located(m, torch.arange(8)), before))  # not committed yet
        store.copy_fn(*a)

    m.advance_round()  # the policy alone: allowed
    assert plan.apply(copy) is plan and plan.state == "committed"
    assert seen == [True, True]  # the demotion, then the promotion
    assert torch.equal(m.loc, m.visible)
    assert _values(m, store, list(range(8))) == [100 + a for a in range(8)]
    assert plan.apply(copy) is plan and len(seen) == 2  # applied once only
    t, _ = tier_and_slot(m, [0])
    assert t.tolist() == [DEVICE]
    m.free(torch.tensor([0]))


@pytest.mark.parametrize("lru", list(POLICIES))
@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_failed_copy_drops_the_plans_entries(lru, fail_at):
    """A copy_fn that raises: the plan's entries (promoted and demoted) are dropped -- their
    rows may be half moved -- and nothing else changes; the mapping works on."""
    m, store = _filled(lru, 4, 4, 8)  # host full: promotions swap through staging
    counted = (m.stats.demotions, m.stats.promotions, m.stats.staged)
    _, plan = m.ensure_resident(torch.tensor([0, 1]))
    assert plan.num_staged == 2
    moved = set(plan._entries.tolist())
    calls = []

    def flaky(*a):
        calls.append(a[0])
        if len(calls) == fail_at:
            raise RuntimeError("copy failed")
        store.copy_fn(*a)

    with pytest.raises(RuntimeError, match="copy failed"):
        plan.apply(flaky)
    assert plan.state == "dropped" and m.stats.lost == len(moved) == 4
    # Moves that did not happen are not counted.
    assert (m.stats.demotions, m.stats.promotions, m.stats.staged) == counted
    assert plan.apply(store.copy_fn) is plan and plan.state == "dropped"
    t, _ = tier_and_slot(m, torch.arange(8))
    kept = [a for a in range(8) if a not in moved]
    assert all(t[a] == -1 for a in moved) and all(t[a] in (DEVICE, HOST) for a in kept)
    assert torch.equal(m.loc, m.visible)
    assert _values(m, store, kept) == [100 + a for a in kept]
    assert m.dev.num_used + m.host.num_used == len(kept)
    assert set(m.dev.owner[m.dev.owner >= 0].tolist()) | set(m.host.owner[m.host.owner >= 0].tolist()) == set(kept)
    with pytest.raises(KeyError):
        m.ensure_resident(torch.tensor([0]))
    m.advance_round()
    slots, plan2 = m.assign(torch.tensor([0, 9]))
    plan2.apply(store.copy_fn)
    store.write(DEVICE, slots, torch.tensor([100, 109]))
    assert _values(m, store, kept + [0, 9]) == [100 + a for a in kept] + [100, 109]


def test_apply_refuses_another_mappings_plan():
    m1, store = _filled("pblru", 4, 8, 8)
    m2, _ = _filled("pblru", 4, 8, 8)
    _, plan = m1.ensure_resident(torch.tensor([0]))
    with pytest.raises(ValueError, match="another mapping"):
        m2.apply(plan, store.copy_fn)
    m1.apply(plan, store.copy_fn)
    assert _values(m1, store, list(range(8))) == [100 + a for a in range(8)]


def test_tp_rank_that_owns_nothing():
    """Two addresses over three ranks: rank 2 owns none (a mapping of no entries); whatever it
    is given maps to padding there, and the addresses are owned by ranks 0 and 1."""
    shard = TokenShard(2, 3)
    assert shard.local_count(2) == 0
    m = TieredMapping(shard.local_count(2), 2, 2)
    addrs = torch.tensor([0, 1, -1])
    local = shard.local(addrs)
    assert local.tolist() == [-1, -1, -1]
    assert [[r for r in range(3) if TokenShard(r, 3).owned(torch.tensor([a])).item()]
            for a in (0, 1, -1)] == [[0], [1], []]
    slots, plan = m.assign(local)
    assert slots.tolist() == [-1, -1, -1] and plan.empty and m.device_used == 0
    slots, _ = m.ensure_resident(shard.local(torch.tensor([0, -1])))
    assert slots.tolist() == [-1, -1]
    t, s = tier_and_slot(m, local)
    assert t.tolist() == [-1, -1, -1] and s.tolist() == [-1, -1, -1]
    assert m.free(shard.local(torch.tensor([0]))) == 0
    with pytest.raises(KeyError):  # nothing of its own to map
        m.assign(torch.tensor([0]))


def test_slots_keep_the_input_shape():
    m = TieredMapping(64, 8, 8)
    a = torch.arange(6).reshape(2, 3)
    slots, plan = m.assign(a)
    assert slots.shape == (2, 3)
    slots2, _ = m.ensure_resident(a)
    assert torch.equal(slots, slots2)
    dev, host = m.locate(a)
    assert dev.shape == host.shape == (2, 3)
    assert torch.equal(dev, slots) and (host == -1).all()
    # int32 addresses (vLLM's top-k indices), padding among them: the same locations.
    a32 = torch.tensor([[0, -1, 5], [7, 2, -1]], dtype=torch.int32)
    d32, h32 = m.locate(a32)
    d64, h64 = m.locate(a32.long())
    assert d32.shape == (2, 3) and torch.equal(d32.long(), d64) and torch.equal(h32.long(), h64)
    assert d64.tolist() == [[int(slots[0, 0]), -1, int(slots[1, 2])], [-1, int(slots[0, 2]), -1]]


def test_reassign_refuses_entries_of_an_unapplied_plan():
    m, store = _filled("pblru", 4, 8, 8)
    _, plan = m.ensure_resident(torch.tensor([0]))
    with pytest.raises(RuntimeError, match="outstanding"):
        m.assign(torch.tensor([0]))
    plan.apply(store.copy_fn)
    m.assign(torch.tensor([0]))


def test_addresses_past_the_address_space():
    m, store = _filled("pblru", 4, 8, 8)  # num_logical 64
    before = _snapshot(m)
    for call in (m.assign, m.ensure_resident):
        with pytest.raises(KeyError, match=r"\[64, 70\].*\[0, 64\)"):
            call(torch.tensor([1, 64, 70, -1]))
    assert _same(before, _snapshot(m))
    assert m.free(torch.tensor([64, 1000])) == 0  # never assigned: ignored, as documented
    assert m.free(torch.tensor([1, 64])) == 1
    with pytest.raises(TypeError, match="integers"):
        m.ensure_resident(torch.tensor([1.0]))
    before = _snapshot(m)
    for junk in (["a"], None, [None]):
        for call in (m.assign, m.ensure_resident):
            with pytest.raises(TypeError, match="integers"):
                call(junk)
    assert _same(before, _snapshot(m))
    assert m.ensure_resident([4, 5])[0].shape == (2,)  # plain lists are accepted


def test_unsigned_and_python_addresses_past_int64():
    """uint64 addresses >= 2**63 wrap to negative int64 (padding) unless caught: they are
    past the space; ``free`` ignores them (and Python ints past int64) as documented."""
    import numpy as np

    m, store = _filled("pblru", 4, 8, 8)
    before = _snapshot(m)
    for big in (np.array([2**63], dtype=np.uint64), torch.tensor([2**63 + 5], dtype=torch.uint64)):
        for call in (m.assign, m.ensure_resident):
            with pytest.raises(KeyError, match="past int64"):
                call(big)
    assert _same(before, _snapshot(m))
    assert m.free(np.array([1, 2**64 - 1], dtype=np.uint64)) == 1
    assert m.free([2, 2**63, -(2**70)]) == 1
    assert [x.tolist() for x in tier_and_slot(m, [1, 2])] == [[-1, -1], [-1, -1]]  # freed
    assert m.ensure_resident(np.array([3], dtype=np.uint64))[0].numel() == 1  # small ones work


def test_adopt_checks_its_input_before_changing_anything():
    m = TieredMapping(8, 4, 4)
    before = _snapshot(m)
    with pytest.raises(ValueError, match="2 addresses but 1 slots"):
        m.adopt(torch.tensor([0, 1]), torch.tensor([2]))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        m.adopt(torch.tensor([0]), torch.tensor([4]))
    assert _same(before, _snapshot(m))
    m.adopt(torch.tensor([0, 1]), torch.tensor([2, 3]))
    assert m.dev.num_free == 2 and m.assign(torch.arange(2, 4))[1].empty
