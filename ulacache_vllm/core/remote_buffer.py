"""TP mode's buffer of recently fetched remote rows.

With TP placement rank ``r`` owns the rows of entries ``t`` with ``t % P == r`` (MLA KV is
sharded by token instead of replicated), yet attention on every rank reads every selected row
(the latent row is shared by all heads). Rows owned by other ranks are fetched; consecutive
DSA top-k sets overlap 60-95 %, so a per-rank buffer of recently fetched remote rows turns most
fetches into hits.

``RemoteRowBuffer`` maps remote logical addresses to buffer slots with a tensor table (like
``TieredMapping``) and evicts with the same policies (PB-LRU by default): victims never come
from the current round, so a row a round reads is not overwritten during it. Ordering rule as
in the tiered mapping: ``lookup`` returns the slots and a ``FetchPlan`` (which addresses to
fetch from which owner rank into which slots); ``apply(plan, fetch_fn)`` runs the fetch, and
the entries become visible to ``resolve`` only once the fetch's event reports completion
(commit, then the plan's fence is signalled). Plans are applied in creation order, so fetches
into a reused slot land in order on one in-order stream.

A freed logical address may be reused for another token: ``invalidate`` (called with every
free, on every rank) drops those entries, so a reused address is never served stale bytes.
Failures (``CapacityError``: a round's remote rows exceed the buffer; ``KeyError`` /
``TypeError``: bad addresses) leave the tables and pools unchanged (a failed lookup's hits stay
marked as used in the round, as in ``TieredMapping.ensure_resident``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ulacache_vllm import kernels as K

from .fence import Fence
from .mapping import make_policy
from .placement import Placement
from .plan_queue import AllEvents, PlanQueue, UniqueAddresses, as_addresses
from .pools import CapacityError, SlotPool

# fetch_fn(owner_ranks, addrs, dst_slots) copies the rows of ``addrs`` (owned by
# ``owner_ranks``) into buffer slots ``dst_slots``; it may return an event with ``query()``.
FetchFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]


@dataclass
class FetchPlan:
    addrs: torch.Tensor   # unique remote logical addresses to fetch
    owners: torch.Tensor  # their owner ranks (addr % world_size)
    slots: torch.Tensor   # buffer slots to write
    plan_id: int = 0
    fence: Fence = field(default_factory=Fence)
    state: str = "planned"  # planned -> fetched -> committed
    _buffer: object = None

    @property
    def empty(self) -> bool:
        return self.addrs.numel() == 0


@dataclass
class RemoteBufferStats:
    lookups: int = 0       # unique remote addresses looked up
    hits: int = 0          # ... already in the buffer
    fetched: int = 0       # rows fetched from their owners
    evicted: int = 0       # buffered rows dropped to make room
    invalidated: int = 0   # buffered rows dropped because their entry was freed

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class RemoteRowBuffer(PlanQueue):
    ISSUED = "fetched"
    KIND = "fetch"

    def __init__(self, num_logical: int, num_slots: int, *, rank: int, world_size: int,
                 device: torch.device | str = "cpu", lru="pblru", ring_size: int = 8):
        if num_slots < 1:
            raise ValueError(f"a remote-row buffer needs at least one slot, got {num_slots}")
        self.device = torch.device(device)
        self.placement = Placement("tp", rank, world_size)
        self.num_logical = num_logical
        n = max(1, num_logical)
        self.table = torch.full((n,), -1, dtype=torch.int64, device=self.device)    # planned
        self.visible = torch.full((n,), -1, dtype=torch.int64, device=self.device)  # fetched
        self._unique = UniqueAddresses(n, self.device)
        self.pool = SlotPool(num_slots, self.device)  # owner = the buffered address
        self.policy = (lru(num_slots, self.device, ring_size) if callable(lru)  # (a factory)
                       else make_policy(lru, num_slots, self.device, ring_size))
        self.stats = RemoteBufferStats()
        self._init_plans(n, self.device)  # fetches in flight (PlanQueue)
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    @property
    def used(self) -> int:
        return self.pool.num_used

    # ------------------------------------------------------------------ helpers
    def _addrs(self, addrs, what: str, ignore_out_of_range: bool = False):
        return as_addresses(addrs, self.device, self.num_logical, what, ignore_out_of_range)

    def _remote_unique(self, a: torch.Tensor):
        """``(is_remote, unique remote addresses)``: dedup in O(n) via a claim table."""
        P = self.placement.world_size
        is_remote = (a >= 0) & (a % P != self.placement.rank)
        return is_remote, self._unique(a.masked_select(is_remote))

    def _out(self, table, a, is_remote, shape) -> torch.Tensor:
        safe = torch.where(is_remote, a, torch.zeros_like(a))
        return torch.where(is_remote, table.index_select(0, safe), torch.full_like(a, -1)).reshape(shape)

    # ------------------------------------------------------------------ API
    def lookup(self, addrs):
        """Buffer slots for the remote entries among ``addrs`` (any shape; duplicates and -1
        padding allowed; entries this rank owns give -1: resolve those through the rank's
        ``TieredMapping``). Hits are touched; misses get slots (free ones first, then
        victims not used this round) and go into the returned ``FetchPlan``. Apply the plan
        and wait for its fence before reading the slots."""
        self.poll()
        a, shape = self._addrs(addrs, "lookup")
        is_remote, u = self._remote_unique(a)
        v = self.table.index_select(0, u)
        if self._pending:  # a hit on a row still being fetched is read after that fetch
            self._wait_for(u.masked_select(v >= 0))
        hit = self.policy.hit_touch(v)
        miss = K.compact(u, ~hit)
        m = miss.numel()
        self.stats.lookups += u.numel()
        self.stats.hits += u.numel() - m
        if m == 0:
            plan = FetchPlan(self._empty, self._empty, self._empty, state="committed", _buffer=self)
            plan.fence.signal()
            return self._out(self.table, a, is_remote, shape), plan
        f = min(m, self.pool.num_free)
        k = m - f
        if k:
            try:
                victims = self.policy.select_victims(k)  # raises before any change
            except CapacityError:
                self.stats.lookups -= u.numel()
                self.stats.hits -= u.numel() - m
                raise CapacityError(
                    f"remote-row buffer of {self.num_slots} slots cannot hold this round's "
                    f"{m} new remote rows next to the ones it already uses; split the round "
                    "(advance_round between smaller lookups) or enlarge the buffer") from None
            old = self.pool.owner.index_select(0, victims)
            K.reference.fill_at(self.table, old, -1)
            K.reference.fill_at(self.visible, old, -1)
            self.pool.take(victims, miss[f:])
            self.stats.evicted += k
            dst = torch.cat([self.pool.alloc(miss[:f]), victims])
        else:
            dst = self.pool.alloc(miss)
        self.table.scatter_(0, miss, dst)
        self.policy.touch(dst)
        plan = FetchPlan(miss, miss % self.placement.world_size, dst, plan_id=self._next_plan,
                         _buffer=self)
        self._next_plan += 1
        self._last_plan.index_fill_(0, miss, plan.plan_id)
        self._pending.append(plan)
        self.stats.fetched += m
        return self._out(self.table, a, is_remote, shape), plan

    def apply(self, plan: FetchPlan, fetch_fn: FetchFn) -> FetchPlan:
        """Fetch the rows, then (once the fetch is done) make them visible, then signal."""
        if plan.state != "planned":
            return plan
        if getattr(plan, "_buffer", None) is not self:
            raise ValueError("plan belongs to another remote-row buffer")
        self._check_apply_order(plan)
        ev = fetch_fn(plan.owners, plan.addrs, plan.slots)
        plan.fence.event = AllEvents(list(ev)) if isinstance(ev, (list, tuple)) else ev
        plan.state = "fetched"
        self.poll()
        return plan

    def _commit(self, plan: FetchPlan) -> None:
        # Entries invalidated or evicted since are not this plan's any more, nor are entries a
        # later plan fetches again -- even into the same slot (evicted and fetched back): that
        # later fetch may still be overwriting the slot.
        ok = (self.table.index_select(0, plan.addrs) == plan.slots) & (
            self._last_plan.index_select(0, plan.addrs) == plan.plan_id)
        self.visible.scatter_(0, plan.addrs.masked_select(ok), plan.slots.masked_select(ok))

    def resolve(self, addrs) -> torch.Tensor:
        """Buffer slot of each remote entry whose row is fetched and committed, else -1."""
        self.poll()
        a, shape = self._addrs(addrs, "resolve")
        is_remote = (a >= 0) & (a % self.placement.world_size != self.placement.rank)
        return self._out(self.visible, a, is_remote, shape)

    def invalidate(self, addrs) -> int:
        """Drop the buffered rows of freed entries (every rank calls this with every free);
        returns how many were buffered. Addresses past the space are ignored."""
        self.poll()
        a, _ = self._addrs(addrs, "invalidate", ignore_out_of_range=True)
        _, u = self._remote_unique(a)
        if u.numel() == 0:
            return 0
        v = self.table.index_select(0, u)
        held = v >= 0
        if self._pending:  # a fetch in flight still writes their slots: no reuse before
            self._wait_for(u.masked_select(held))
        slots = v.masked_select(held)
        gone = u.masked_select(held)
        K.reference.fill_at(self.table, gone, -1)
        K.reference.fill_at(self.visible, gone, -1)
        self.policy.release(slots)
        self.pool.release(slots)
        self.stats.invalidated += slots.numel()
        return slots.numel()

    def advance_round(self) -> None:
        """End of a scheduling round: rows used before it may be evicted again."""
        self.policy.advance_round()
