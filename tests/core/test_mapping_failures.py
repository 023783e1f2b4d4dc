"""Failure paths of the mapping: errors change nothing, copies in flight are never overtaken,
a failed copy can be resumed, plans apply in order."""

import pytest
import torch

from lab.policies import NAMES as POLICIES
from lab.policies import factory
from lab.row_store import RowStore
from ulacache_vllm.core import (DEVICE, HOST, PENDING, CapacityError, ManualEvent,
                                TieredMapping, unpack)


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
    t, _, s = unpack(m.resolve(torch.tensor(addrs)))
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
    t, _, _ = unpack(m.resolve(torch.tensor([0, 1])))
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


class _DeferredCopies:
    """An asynchronous copy engine: copies run when their event is synchronised / set."""

    def __init__(self, store):
        self.store, self.queue = store, []

    def copy_fn(self, *args):
        ev = _Deferred(self, args)
        self.queue.append(ev)
        return ev


class _Deferred(ManualEvent):
    def __init__(self, owner, args):
        super().__init__()
        self.owner, self.args = owner, args

    def synchronize(self):
        self.set()

    def set(self):
        if not self._done:
            for ev in list(self.owner.queue):  # one stream: earlier copies first
                self.owner.queue.remove(ev)
                ev._done = True
                self.owner.store.copy_fn(*ev.args)
                if ev is self:
                    break


@pytest.mark.parametrize("lru", list(POLICIES))
def test_freed_slot_is_not_reused_while_its_copy_is_in_flight(lru):
    m, store = _filled(lru, 4, 8, 8)
    dc = _DeferredCopies(store)
    _, plan = m.ensure_resident(torch.tensor([0]))  # promote 0, demote the oldest of 4-7
    plan.apply(dc.copy_fn)
    assert dc.queue and not plan.fence.completed
    t, _, _ = unpack(m.resolve(torch.tensor([0])))
    assert t.tolist() == [PENDING]
    m.free(torch.tensor([0]))  # waits for the copies (they may still write 0's slot)
    assert plan.fence.completed and not dc.queue
    slots, plan2 = m.assign(torch.tensor([9]))
    plan2.apply(store.copy_fn)
    store.write(DEVICE, slots, torch.tensor([109]))
    assert _values(m, store, [1, 2, 3, 4, 5, 6, 7, 9]) == [101, 102, 103, 104, 105, 106, 107, 109]


def test_hit_on_a_row_in_flight_waits_for_its_copy():
    m, store = _filled("pblru", 4, 8, 8)
    dc = _DeferredCopies(store)
    _, plan = m.ensure_resident(torch.tensor([0]))
    plan.apply(dc.copy_fn)
    m.advance_round()
    slots, plan2 = m.ensure_resident(torch.tensor([0]))  # a hit: slot returned ...
    assert plan2.empty and plan.fence.completed  # ... only once the row is there
    assert store.bufs[DEVICE][slots, 0].tolist() == [100]


def test_fence_waits_for_every_copy_event():
    m, store = _filled("exact_ts", 4, 8, 8)
    events = []

    def async_copy(*a):
        store.copy_fn(*a)
        events.append(ManualEvent())
        return events[-1]

    _, plan = m.ensure_resident(torch.tensor([0, 1]))
    plan.apply(async_copy)
    assert len(events) == 2  # demotions and promotions
    events[-1].set()
    m.poll()
    assert not plan.fence.completed, "committed while the demotion copy was still running"
    events[0].set()
    m.poll()
    assert plan.fence.completed


@pytest.mark.parametrize("lru", list(POLICIES))
def test_apply_resumes_after_a_failed_copy(lru):
    m, store = _filled(lru, 4, 4, 8)  # host full: promotions swap through staging
    _, plan = m.ensure_resident(torch.arange(4))
    assert plan.num_staged == 4
    calls = []

    def flaky(*a):
        calls.append(a[0])
        if len(calls) == 3:
            raise RuntimeError("copy failed")
        store.copy_fn(*a)

    with pytest.raises(RuntimeError, match="copy failed"):
        plan.apply(flaky)
    assert plan.state == "planned"
    with pytest.raises(RuntimeError, match="never applied"):
        m.ensure_resident(torch.tensor([0]))
    plan.apply(store.copy_fn)  # resumes at the failed copy: earlier ones are not re-run
    assert plan.fence.completed
    assert _values(m, store, list(range(8))) == [100 + a for a in range(8)]


def test_plans_apply_in_creation_order():
    m, store = _filled("pblru", 4, 8, 8)
    _, p1 = m.ensure_resident(torch.tensor([0]))
    m.advance_round()
    _, p2 = m.ensure_resident(torch.tensor([1]))
    with pytest.raises(RuntimeError, match="creation order"):
        p2.apply(store.copy_fn)
    p1.apply(store.copy_fn)
    p2.apply(store.copy_fn)
    assert _values(m, store, list(range(8))) == [100 + a for a in range(8)]


def test_tp_rank_that_owns_nothing():
    m = TieredMapping(2, 2, 2, placement="tp", rank=2, world_size=3)
    slots, plan = m.assign(torch.tensor([0, 1, -1]))
    assert slots.tolist() == [-1, -1, -1] and plan.empty
    slots, _ = m.ensure_resident(torch.tensor([0, -1]))
    assert slots.tolist() == [-1, -1]
    t, r, _ = unpack(m.resolve(torch.tensor([0, 1, -1])))
    assert t[:2].tolist() == [3, 3] and r[:2].tolist() == [0, 1] and t[2] == -1
    assert m.free(torch.tensor([0])) == 0


def test_slots_keep_the_input_shape():
    m = TieredMapping(64, 8, 8)
    a = torch.arange(6).reshape(2, 3)
    slots, plan = m.assign(a)
    assert slots.shape == (2, 3)
    slots2, _ = m.ensure_resident(a)
    assert torch.equal(slots, slots2) and m.resolve(a).shape == (2, 3)


@pytest.mark.parametrize("lru", list(POLICIES))
def test_reassign_waits_for_a_promotion_into_its_slot(lru):
    """Re-assigning an entry whose promotion is in flight gives its slot back only after the
    copy: otherwise the new rows written there would be overwritten by the old promoted row."""
    m, store = _filled(lru, 4, 8, 8)
    dc = _DeferredCopies(store)
    _, plan = m.ensure_resident(torch.tensor([0]))  # promote 0 (copy queued, not run)
    plan.apply(dc.copy_fn)
    m.advance_round()
    assert dc.queue and not plan.fence.completed
    slots, plan2 = m.assign(torch.tensor([9, 0]))  # a new entry + re-assignment of 0
    assert plan.fence.completed and not dc.queue
    plan2.apply(store.copy_fn)
    store.write(DEVICE, slots, torch.tensor([109, 999]))
    assert _values(m, store, [0, 9]) == [999, 109]
    live = [a for a in range(1, 8) if int(m.loc[a]) >= 0]
    assert _values(m, store, live) == [100 + a for a in live]


@pytest.mark.parametrize("lru", list(POLICIES))
def test_reassign_waits_for_the_demotion_out_of_its_slot(lru):
    """Entry 9 took the slot of a victim whose demotion copy (device -> host) is in flight:
    re-assigning 9 must not let its new row land before the copy has read the victim's."""
    m, store = _filled(lru, 4, 8, 4)
    dc = _DeferredCopies(store)
    slots, plan = m.assign(torch.tensor([9]))  # demotes the oldest entry
    plan.apply(dc.copy_fn)
    m.advance_round()
    assert dc.queue
    slots, plan2 = m.assign(torch.tensor([9]))
    assert plan.fence.completed and not dc.queue
    plan2.apply(store.copy_fn)
    store.write(DEVICE, slots, torch.tensor([202]))
    assert _values(m, store, [0, 1, 2, 3, 9]) == [100, 101, 102, 103, 202]


def test_reassign_refuses_entries_of_an_unapplied_plan():
    m, store = _filled("pblru", 4, 8, 8)
    _, plan = m.ensure_resident(torch.tensor([0]))
    with pytest.raises(RuntimeError, match="never applied"):
        m.assign(torch.tensor([0]))
    plan.apply(store.copy_fn)
    m.assign(torch.tensor([0]))


def test_addresses_past_the_address_space():
    m, store = _filled("pblru", 4, 8, 8)  # num_logical 64
    before = _snapshot(m)
    for call in (m.assign, m.ensure_resident, m.resolve):
        with pytest.raises(KeyError, match=r"\[64, 70\].*\[0, 64\)"):
            call(torch.tensor([1, 64, 70, -1]))
    assert _same(before, _snapshot(m))
    assert m.free(torch.tensor([64, 1000])) == 0  # never assigned: ignored, as documented
    assert m.free(torch.tensor([1, 64])) == 1
    with pytest.raises(TypeError, match="integers"):
        m.ensure_resident(torch.tensor([1.0]))
    for junk in (["a"], None, [None]):
        with pytest.raises(TypeError, match="integers"):
            m.resolve(junk)
    assert m.resolve([2, 3]).shape == (2,)  # plain lists are accepted


def test_unsigned_and_python_addresses_past_int64():
    """uint64 addresses >= 2**63 wrap to negative int64 (padding) unless caught: they are
    past the space; ``free`` ignores them (and Python ints past int64) as documented."""
    import numpy as np

    m, store = _filled("pblru", 4, 8, 8)
    before = _snapshot(m)
    for big in (np.array([2**63], dtype=np.uint64), torch.tensor([2**63 + 5], dtype=torch.uint64)):
        for call in (m.assign, m.ensure_resident, m.resolve):
            with pytest.raises(KeyError, match="past int64"):
                call(big)
    assert _same(before, _snapshot(m))
    assert m.free(np.array([1, 2**64 - 1], dtype=np.uint64)) == 1
    assert m.free([2, 2**63, -(2**70)]) == 1
    assert m.resolve([1, 2]).tolist() == [-1, -1]
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
