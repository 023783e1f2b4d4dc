"""The shared half of the ordering rule *copy data -> update mapping -> signal*.

``TieredMapping`` (move plans) and ``RemoteRowBuffer`` (fetch plans) both hand out plans that
the caller applies in creation order; an applied plan is committed (its entries become visible)
only once its copy's event reports completion, oldest first, and then its fence is signalled.
``PlanQueue`` holds that machinery: the queue of plans in flight, per entry the id of the last
plan that writes it (so a use or free of an entry waits for exactly the copies it needs), and
the creation-order check. Also here: the validation of logical addresses both tables share,
and their O(n) dedup of a batch of addresses.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch


def as_addresses(addrs, device: torch.device, num_logical: int, what: str,
                 ignore_out_of_range: bool = False):
    """``(flat, shape)``: logical addresses as a flat int64 tensor on ``device`` and their
    shape; negative values are padding. Addresses past the address space (also unsigned ones
    past int64) raise ``KeyError`` (or, with ``ignore_out_of_range``, become padding);
    non-integers raise ``TypeError``."""
    try:
        t = torch.as_tensor(addrs, device=device)
    except (OverflowError, RuntimeError, ValueError, TypeError) as e:
        if not (isinstance(e, OverflowError) or "overflow" in str(e).lower()):
            raise TypeError(f"{what}: logical addresses must be integers, got "
                            f"{str(addrs)[:60]!r} ({e})") from None
        if not ignore_out_of_range:
            raise KeyError(f"{what}: addresses outside the logical address space [0, "
                           f"{num_logical}) (too large for int64)") from None
        t = _past_int64_as_padding(addrs).to(device)
    if t.numel() == 0 and t.is_floating_point():
        t = t.long()  # torch.as_tensor([]) is float32: an empty list is no addresses
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{what}: logical addresses must be integers, got {t.dtype}")
    shape = t.shape
    wrapped = t.dtype == torch.uint64  # values >= 2**63 turn negative in int64
    t = t.to(torch.int64).reshape(-1)
    if wrapped and t.numel() and bool((t < 0).any()):
        if not ignore_out_of_range:
            raise KeyError(f"{what}: addresses outside the logical address space [0, "
                           f"{num_logical}) (unsigned, past int64)")
        t = t.masked_fill(t < 0, -1)  # past int64: padding, like any address past the space
    if t.numel() and int(t.max()) >= num_logical:
        bad = t >= num_logical
        if ignore_out_of_range:
            return t.masked_fill(bad, -1), shape
        raise KeyError(f"{what}: addresses {t.masked_select(bad)[:8].tolist()} are outside "
                       f"the logical address space [0, {num_logical})")
    return t, shape


def _past_int64_as_padding(addrs) -> torch.Tensor:
    """Python integers outside int64 (only on this rare path) as -1 padding."""
    lo, hi = -(1 << 63), 1 << 63
    keep = np.frompyfunc(lambda x: x if lo <= x < hi else -1, 1, 1)
    return torch.as_tensor(keep(np.asarray(addrs, dtype=object)).astype(np.int64))


class UniqueAddresses:
    """O(n) dedup of addresses in ``[0, n)`` through a claim table (no sort)."""

    def __init__(self, n: int, device: torch.device):
        self._claim = torch.zeros(max(1, n), dtype=torch.int64, device=device)
        self._iota = torch.arange(1024, device=device)

    def __call__(self, sel: torch.Tensor) -> torch.Tensor:
        """The distinct values of ``sel`` (one occurrence of each, in input order)."""
        n = sel.numel()
        if n <= 1:
            return sel
        if self._iota.numel() < n:
            self._iota = torch.arange(max(n, 2 * self._iota.numel()), device=self._iota.device)
        pos = self._iota[:n]
        # Every occurrence writes its position; exactly one write per address survives (the
        # last on CPU, an arbitrary one on CUDA): that occurrence is the one kept. No reset
        # is needed, every address read here was written by this call.
        self._claim.scatter_(0, sel, pos)
        return sel.masked_select(self._claim.index_select(0, sel) == pos)


class AllEvents:
    """The events of one plan's copies (e.g. on different streams) as one event."""

    def __init__(self, events):
        self.events = events

    def query(self) -> bool:
        return all(bool(e.query()) for e in self.events)

    def synchronize(self) -> None:
        for e in self.events:
            if not e.query():
                e.synchronize()


class PlanQueue:
    """Mixin: plans carry ``plan_id``, ``state`` ("planned" -> ``ISSUED`` -> "committed") and
    ``fence``; the owner defines ``_commit(plan)``."""

    ISSUED = "copied"   # a plan's state once its copies are issued
    KIND = "move"       # for messages

    def _init_plans(self, num_entries: int, device: torch.device) -> None:
        self._pending: deque = deque()
        self._next_plan = 1
        self._last_plan = torch.zeros(num_entries, dtype=torch.int64, device=device)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def _wait_for(self, u: torch.Tensor) -> None:
        """Wait for the copies of the pending plans that write entries ``u`` (and of the plans
        before them: plans commit in order), then commit them."""
        if not self._pending or u.numel() == 0:
            return
        last = int(self._last_plan.index_select(0, u).max())
        if last < self._pending[0].plan_id:
            return
        for plan in list(self._pending):
            if plan.plan_id > last:
                break
            if plan.state == "planned":
                raise RuntimeError(f"{self.KIND} plan {plan.plan_id} was never applied: apply "
                                   "each plan (in creation order) before using or freeing its "
                                   "entries")
            plan.fence.wait()
        self.poll()

    def _check_apply_order(self, plan) -> None:
        """A later plan may reuse slots an earlier one still fills: apply in creation order."""
        for p in self._pending:
            if p is plan:
                break
            if p.state == "planned":
                raise RuntimeError(f"apply {self.KIND} plans in creation order: plan "
                                   f"{p.plan_id} comes before plan {plan.plan_id} and was not "
                                   "applied")

    def poll(self) -> None:
        """Commit, in creation order, every applied plan whose copy has finished."""
        while self._pending:
            plan = self._pending[0]
            if plan.state != self.ISSUED or not plan.fence.copy_done():
                return
            self._pending.popleft()
            self._commit(plan)
            plan.state = "committed"
            plan.fence.signal()

    def sync(self) -> None:
        """Wait for every applied plan's copy and commit them (un-applied plans stay pending)."""
        for plan in list(self._pending):
            if plan.state == self.ISSUED:
                plan.fence.wait()
        self.poll()

    def _commit(self, plan) -> None:
        raise NotImplementedError
