"""Tiered mapping table of one layer group: address -> (tier, slot).

Exclusive residency: a live entry is in exactly one of the device pool or the host pool. One
shared device pool serves every request (no quota); an eviction policy (PB-LRU or an exact LRU)
picks device victims, which are demoted to the host.

Moves are synchronous. ``assign`` and ``ensure_resident`` update the bookkeeping (``loc``,
pools, policy, stats) and return a ``MovePlan``; ``apply(plan, copy_fn)`` copies the rows, then
commits the plan's entries to ``visible``, the table readers use (copy data, then update the
mapping). A non-empty plan must be applied before the next ``assign``, ``adopt``,
``ensure_resident`` or ``free`` (they refuse otherwise); until then ``visible`` shows the
plan's entries where their rows still are. With no plan outstanding, ``visible`` equals ``loc``.

Promotion admission (``promote_after`` = k): a settle (``ensure_resident``,
``settle_and_assign``) promotes a host entry only when it was read from the host in k settles
in a row, this one included; the others stay on the host, where readers find them through
``locate`` (read in place or staged), counted in ``stats.deferred``. k = 1 promotes every host
entry read. A row read once (an indexer whose top-k moves) then costs no promotion and no
later demotion; a row read again (a top-k that stays) is promoted one settle later. Freeing an
entry forgets its reads (`admission.PromotionAdmission`). The counters are `MappingStats`
(`mapping_stats`, with the policy timer of ``profile=True``).

Failures: ``CapacityError`` (the round's working set exceeds the device pool, or the host
pool is full) and ``KeyError`` (unknown addresses) leave tables, pools and stats unchanged.
A ``copy_fn`` that raises may have overwritten some of the plan's rows without writing their
new places: ``apply`` then drops the plan's entries (unmapped in both tables, their slots back
in the pools, counted in ``stats.lost``; its demotions, promotions and staged copies are no
longer counted) and re-raises; other entries are untouched.

Addresses are the rank's own (under TP shard mode the engine maps logical address ``a`` to
``a // P`` first: `placement.TokenShard`); -1 is padding. Table values: -1 unmapped, else
``tier << 32 | slot``; readers go through ``locate`` (device and host slots).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ulacache_vllm import kernels as K
from ulacache_vllm.kernels.reference import SLOT_BITS, SLOT_MASK

from .addresses import UniqueAddresses, as_addresses
from .admission import PromotionAdmission
from .mapping_stats import MappingStats, TimedPolicy
from .policies import POLICIES, PolicyFactory, make_policy  # noqa: F401  (re-exported)
from .pools import CapacityError, SlotPool

DEVICE, HOST = 0, 1
STAGING = 4  # copy_fn tier: engine-provided scratch rows, indices 0..plan.num_staged-1

# copy_fn(src_tier, src_slots, dst_tier, dst_slots): rows of every layer of the group; the copy
# is complete, or ordered before every later read (one in-order stream), when it returns.
CopyFn = Callable[[int, torch.Tensor, int, torch.Tensor], object]


@dataclass
class MovePlan:
    """Rows to move, in int64 tensors; ``state``: "planned" -> "committed" (or "dropped").

    Copy order in ``apply`` (exclusive residency with a full host may make a demotion target
    a host slot that a promotion of the same plan reads): (1) the first ``num_staged``
    promotions HOST->STAGING, (2) all demotions DEVICE->HOST, (3) the other promotions
    HOST->DEVICE, (4) STAGING->DEVICE for the staged ones. Then the mapping commits.
    """

    demote_src_device: torch.Tensor
    demote_dst_host: torch.Tensor
    promote_src_host: torch.Tensor
    promote_dst_device: torch.Tensor
    num_staged: int = 0
    state: str = "planned"
    _entries: torch.Tensor | None = None   # the entries the plan moves ...
    _new_vals: torch.Tensor | None = None  # ... and their table values once committed
    _mapping: TieredMapping | None = None

    @property
    def empty(self) -> bool:
        return self._entries is None or self._entries.numel() == 0

    @property
    def entries(self) -> torch.Tensor | None:
        """The entries the plan moves (after a failed ``apply``: the ones it dropped)."""
        return self._entries

    def apply(self, copy_fn: CopyFn) -> MovePlan:
        return self._mapping.apply(self, copy_fn)


class TieredMapping:
    def __init__(self, num_logical: int, device_slots: int, host_slots: int, *,
                 device: torch.device | str = "cpu", lru: str | PolicyFactory = "pblru",
                 ring_size: int = 8, promote_after: int = 1,
                 profile: bool = False):
        if max(device_slots, host_slots) >= 1 << SLOT_BITS:
            raise ValueError("pools are limited to 2**32 slots")
        if isinstance(promote_after, bool) or not isinstance(promote_after, int) or promote_after < 1:
            raise ValueError(f"promote_after must be a whole number >= 1, got {promote_after!r}")
        self.device = torch.device(device)
        self.num_logical = num_logical
        # At least one row: a TP rank may own no address, and lookups gather a clamped index.
        n = max(1, num_logical)
        self.loc = torch.full((n,), -1, dtype=torch.int64, device=self.device)      # planned
        self.visible = torch.full((n,), -1, dtype=torch.int64, device=self.device)  # committed
        self._unique = UniqueAddresses(n, self.device)
        self.dev = SlotPool(device_slots, self.device)
        self.host = SlotPool(host_slots, self.device)
        self.stats = MappingStats()
        # A product policy by name, or a factory passed explicitly (the benchmarks' baselines).
        policy = (lru(device_slots, self.device, ring_size) if callable(lru)
                  else make_policy(lru, device_slots, self.device, ring_size))
        self.policy = TimedPolicy(policy, self.stats) if profile else policy
        self._outstanding: MovePlan | None = None  # the non-empty plan not applied yet
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        # Promotion admission: which host entries a settle promotes (module doc).
        self.promote_after = promote_after
        self.admission = PromotionAdmission(promote_after, n, self.device)

    # ------------------------------------------------------------------ helpers
    @property
    def device_used(self) -> int:
        return self.dev.num_used

    @property
    def host_used(self) -> int:
        return self.host.num_used

    def _addrs(self, addrs, what: str, ignore_out_of_range: bool = False):
        if self._outstanding is not None:
            raise RuntimeError(f"{what}: a move plan is outstanding; apply it first")
        return as_addresses(addrs, self.device, self.num_logical, what, ignore_out_of_range)

    def _local_unique(self, addrs: torch.Tensor):
        """``(is_local, local_idx, unique_local_idx)`` of flat ``_addrs`` output; dedup in
        O(n) via a claim table."""
        is_local, idx = addrs >= 0, addrs
        return is_local, idx, self._unique(idx.masked_select(is_local))

    def _slots_out(self, is_local, idx, shape) -> torch.Tensor:
        """Device slots of ``idx`` (-1: padding, not local, or on the host)."""
        safe = torch.where(is_local, idx, torch.zeros_like(idx))
        lv = self.loc.index_select(0, safe)
        out = torch.where(is_local & (lv >> SLOT_BITS == DEVICE), lv & SLOT_MASK,
                          torch.full_like(idx, -1))
        return out.reshape(shape)

    def _release(self, u: torch.Tensor, lv: torch.Tensor | None = None) -> int:
        """Unmaps the unique entries ``u`` (``lv``: their ``loc`` values, if already read)."""
        if lv is None:
            lv = self.loc.index_select(0, u)
        mapped = lv >= 0
        tier = lv >> SLOT_BITS
        slots = lv & SLOT_MASK
        dev_slots = K.compact(slots, mapped & (tier == DEVICE))
        host_slots = K.compact(slots, mapped & (tier == HOST))
        self.policy.release(dev_slots)
        self.dev.release(dev_slots)
        self.host.release(host_slots)
        K.reference.fill_at(self.loc, u, -1)
        K.reference.fill_at(self.visible, u, -1)
        self.admission.forget(u)  # a reused address starts with no reads
        return dev_slots.numel() + host_slots.numel()

    def _new_plan(self, dsrc, ddst, psrc, pdst, staged, entries, new_vals) -> MovePlan:
        plan = MovePlan(dsrc, ddst, psrc, pdst, staged, _entries=entries, _new_vals=new_vals,
                        _mapping=self)
        self._outstanding = plan
        self.stats.plans += 1
        return plan

    def _empty_plan(self) -> MovePlan:
        e = self._empty
        return MovePlan(e, e, e, e, 0, state="committed", _entries=e, _new_vals=e, _mapping=self)

    def _check_host_room(self, k: int, spare: int) -> None:
        """``k`` demotions need host slots: free ones plus ``spare`` this call vacates."""
        if k > self.host.num_free + spare:
            raise CapacityError(f"host pool full: {k} demotions, {self.host.num_free} free host "
                                f"slots (+{spare} this call frees)")

    def _victims_to_host(self, k: int, new_entries: torch.Tensor, promote_src=None, victims=None):
        """Pick ``k`` device victims, hand their slots to ``new_entries``, give them host slots.

        Host slots come from the free host pool first, then from ``promote_src`` (host slots
        this same plan vacates; those promotions are staged). Returns
        ``(victim_slots, victim_entries, host_dst, num_staged)``.
        """
        self._check_host_room(k, 0 if promote_src is None else promote_src.numel())
        if victims is None:
            victims = self.policy.select_victims(k)
        ventries = self.dev.owner.index_select(0, victims)
        self.dev.take(victims, new_entries)
        hf = min(k, self.host.num_free)
        h1 = self.host.alloc(ventries[:hf])
        c = k - hf
        if c:
            h2 = promote_src[:c]
            self.host.take(h2, ventries[hf:])
            hdst = torch.cat([h1, h2])
        else:
            hdst = h1
        self.loc.scatter_(0, ventries, (HOST << SLOT_BITS) | hdst)
        self.stats.demotions += k
        self.stats.staged += c
        return victims, ventries, hdst, c

    # ------------------------------------------------------------------ API
    def assign(self, addrs: torch.Tensor):
        """Give newly written entries device slots (re-assigning releases the old entry first).

        Returns ``(device_slots, plan)``; ``device_slots`` is aligned with ``addrs`` (-1 for
        padding / non-owned). Apply ``plan`` (victims demoted to host) before writing the rows.
        A ``CapacityError`` leaves tables, pools and stats unchanged; as with
        ``ensure_resident``, the call's re-assigned entries that were on the device stay marked
        as used in this round (they were written in it), so they are not this round's victims.
        """
        addrs, shape = self._addrs(addrs, "assign")
        is_local, idx, u = self._local_unique(addrs)
        if u.numel() == 0:
            return self._slots_out(is_local, idx, shape), self._empty_plan()
        n = u.numel()
        victims = None
        # New rows are unmapped as a rule (re-assignment: speculative decoding's rewrites):
        # one read of their table values decides whether anything must be released first.
        lv = self.loc.index_select(0, u)
        remapped = bool((lv >= 0).any())
        if n > self.dev.num_free:
            # Victims first, so that a CapacityError leaves everything as it was. Entries being
            # re-assigned give their slots back below: they are neither victims nor counted
            # as missing room (untracked for the selection, tracked again if it fails).
            tier = lv >> SLOT_BITS
            own_dev = (lv & SLOT_MASK).masked_select(tier == DEVICE)
            own_host = int((tier == HOST).sum())
            k = n - self.dev.num_free - own_dev.numel()
            if k > 0:
                self._check_host_room(k, own_host)
                self.policy.release(own_dev)
                try:
                    victims = self.policy.select_victims(k)
                except CapacityError:
                    self.policy.touch(own_dev)
                    raise
        if remapped:
            self._release(u, lv)
        f = min(n, self.dev.num_free)
        k = n - f
        late = u[f:]
        if k:
            victims, ventries, hdst, _ = self._victims_to_host(k, late, victims=victims)
        free_slots = self.dev.alloc(u[:f])
        self.loc.scatter_(0, u[:f], free_slots)
        self.visible.scatter_(0, u[:f], free_slots)
        self.stats.assigned += n
        if k == 0:
            self.policy.touch(free_slots)
            return self._slots_out(is_local, idx, shape), self._empty_plan()
        self.loc.scatter_(0, late, victims)
        self.policy.touch(torch.cat([free_slots, victims]))
        e = self._empty
        # New entries on victim slots become visible once the demotion has copied the old rows.
        plan = self._new_plan(victims, hdst, e, e, 0, torch.cat([ventries, late]),
                              torch.cat([(HOST << SLOT_BITS) | hdst, victims]))
        return self._slots_out(is_local, idx, shape), plan

    def adopt(self, addrs: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Register unmapped, unique local entries as already resident at the given free
        device slots (their rows were written there by an identity-placement fast path)."""
        addrs, _ = self._addrs(addrs, "adopt")
        slots = torch.as_tensor(device_slots, device=self.device).to(torch.int64).reshape(-1)
        if slots.numel() != addrs.numel():  # checked before any change: nothing to undo
            raise ValueError(f"adopt: {addrs.numel()} addresses but {slots.numel()} slots")
        if slots.numel() and not (0 <= int(slots.min()) and int(slots.max()) < self.dev.num_slots):
            raise ValueError(f"adopt: device slots must lie in [0, {self.dev.num_slots})")
        is_local, idx = addrs >= 0, addrs
        if not bool(is_local.all()):
            raise ValueError("adopt: every address must be local and valid")
        if bool((self.loc.index_select(0, idx) >= 0).any()):
            raise ValueError("adopt: some addresses are already mapped")
        self.dev.claim(slots, idx)
        self.loc.scatter_(0, idx, slots)
        self.visible.scatter_(0, idx, slots)
        self.policy.touch(slots)
        self.stats.assigned += idx.numel()

    def ensure_resident(self, addrs: torch.Tensor, *, drop_unmapped: bool = False,
                        want_slots: bool = True):
        """Make the selected entries device-resident; duplicates and -1 padding allowed.
        ``drop_unmapped``: unmapped addresses are skipped (as padding) instead of raising
        ``KeyError`` (the engine's settle: entries freed since they were read). With
        ``want_slots=False`` the slots are not computed (``None`` is returned in their place).

        Hits are touched (current round); misses are promoted (with ``promote_after`` k > 1,
        those read from the host in k settles in a row; the others stay there, slot -1), evicting
        victims that were not used in the current round (so never anything of this call).
        Returns ``(device_slots, plan)`` with ``device_slots`` aligned with ``addrs``.
        Raises ``CapacityError`` when the round's working set exceeds the device pool and
        ``KeyError`` for addresses that were never assigned. Either leaves tables, pools and
        stats unchanged; after a ``CapacityError`` the call's hits stay marked as used in this
        round (they were requested in it), so the caller splits the round: ``advance_round``
        between smaller calls, as the engine's chunked attention does.
        """
        addrs, shape = self._addrs(addrs, "ensure_resident")
        is_local, idx, u = self._local_unique(addrs)
        lv = self.loc.index_select(0, u)
        unmapped = lv < 0
        if bool(unmapped.any()):  # before any touch: a failed call changes nothing
            if not drop_unmapped:
                raise KeyError("ensure_resident: some addresses were never assigned (or were "
                               "freed)")
            keep = ~unmapped
            u, lv = K.compact(u, keep), K.compact(lv, keep)
        slots_out = (lambda: self._slots_out(is_local, idx, shape)) if want_slots else (
            lambda: None)
        hit = self.policy.hit_touch(lv)
        miss, mlv = K.compact(u, ~hit), K.compact(lv, ~hit)
        nhost = miss.numel()
        miss, mlv, commit = self.admission.admit(miss, mlv)
        m = miss.numel()
        if m == 0:
            commit()
            self.stats.lookups += u.numel()
            self.stats.hits += u.numel() - nhost
            self.stats.deferred += nhost
            return slots_out(), self._empty_plan()
        _, plan = self._place(miss, mlv & SLOT_MASK)  # (a CapacityError changes nothing)
        commit()
        self.stats.lookups += u.numel()
        self.stats.hits += u.numel() - nhost
        self.stats.promotions += m
        self.stats.deferred += nhost - m
        return slots_out(), plan

    def _place(self, entries: torch.Tensor, psrc: torch.Tensor):
        """Device slots for unique ``entries``: the first ``psrc.numel()`` are promotions from
        those host slots, the rest new entries. Free slots first, then victims demoted to the
        host (`_victims_to_host`: victims first, so a ``CapacityError`` changes nothing).
        Returns ``(device slots, plan)``; a plan with nothing to copy is committed at once."""
        m, n = psrc.numel(), entries.numel()
        f = min(n, self.dev.num_free)
        k = n - f
        e = self._empty
        if k:
            victims, ventries, hdst, c = self._victims_to_host(k, entries[f:], psrc)
        else:
            victims, ventries, hdst, c = e, e, e, 0
        free_slots = self.dev.alloc(entries[:f])
        dst = torch.cat([free_slots, victims]) if k else free_slots
        self.host.release(psrc[c:])  # the first c were re-owned by demotions
        self.loc.scatter_(0, entries, dst)
        self.policy.touch(dst)
        if k == 0 and m == 0:  # new entries on free slots: visible at once
            self.visible.scatter_(0, entries, dst)
            return dst, self._empty_plan()
        # Promoted and new entries become visible once the copies are done.
        return dst, self._new_plan(victims, hdst, psrc, dst[:m], c,
                                   torch.cat([entries, ventries]),
                                   torch.cat([dst, (HOST << SLOT_BITS) | hdst]))

    def settle_and_assign(self, selected: torch.Tensor, new: torch.Tensor):
        """One step's two requests as ONE plan: ``ensure_resident(selected,
        drop_unmapped=True)`` in the current round, ``advance_round``, then ``assign(new)`` in
        the next round. The misses' promotions and the new entries' slots come from one
        victim selection, so one set of demotions serves both (victims: any slot not used in
        the new round, the previous round's hits included, least recent first).

        Returns ``(device_slots of new, plan)`` like ``assign``; apply the plan before the
        forward writes the new rows. Returns ``None`` with nothing changed (not even the
        round) when the merged call does not apply: a new address is already mapped
        (re-assignment), or the misses and new entries need more victims than the device
        pool holds or host slots than the host has; the caller then makes the two calls one
        by one (``ensure_resident`` splits an oversized selection)."""
        sel, _ = self._addrs(selected, "settle_and_assign")
        new, shape = self._addrs(new, "settle_and_assign")
        _, _, u = self._local_unique(sel)
        is_new, nidx, w = self._local_unique(new)
        nlv = self.loc.index_select(0, w)
        if bool((nlv >= 0).any()):
            return None
        lv = self.loc.index_select(0, u)
        keep = lv >= 0  # entries freed since they were read are skipped (drop_unmapped)
        u, lv = K.compact(u, keep), K.compact(lv, keep)
        tier = lv >> SLOT_BITS
        on_host = tier == HOST
        miss, mlv = K.compact(u, on_host), K.compact(lv, on_host)
        nhost = miss.numel()
        miss, mlv, commit = self.admission.admit(miss, mlv)
        m, nw = miss.numel(), w.numel()
        k = m + nw - self.dev.num_free
        # Room, checked before any change: in the new round every occupied slot may be a
        # victim (the policy tracks exactly the occupied slots), and each needs a host slot:
        # a free one or one a promotion of this plan vacates (staged, as in ensure_resident).
        if k > 0 and (k > self.dev.num_used or k > self.host.num_free + m):
            return None
        self.policy.hit_touch(lv)  # the ending round's hits (device entries)
        self.policy.advance_round()
        psrc = mlv & SLOT_MASK
        try:
            _, plan = self._place(torch.cat([miss, w]) if m else w, psrc)
        except CapacityError:
            raise RuntimeError("settle_and_assign: victims short after the room check "
                               "(policy and pool disagree)") from None
        commit()
        self.stats.lookups += u.numel()
        self.stats.hits += u.numel() - nhost
        self.stats.promotions += m
        self.stats.deferred += nhost - m
        self.stats.assigned += nw
        return self._slots_out(is_new, nidx, shape), plan

    def free(self, addrs: torch.Tensor) -> int:
        """Release entries (device or host); never-assigned addresses (also those past the
        address space) are ignored."""
        _, _, u = self._local_unique(self._addrs(addrs, "free", ignore_out_of_range=True)[0])
        n = self._release(u) if u.numel() else 0
        self.stats.freed += n
        return n

    def advance_round(self) -> None:
        """End of a scheduling round: the policy's ring advances."""
        self.policy.advance_round()

    def locate(self, addrs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(device_slots, host_slots)`` of addresses through the committed table, each shaped
        like ``addrs``: -1 where the entry is not on that tier, unmapped, or padding (-1).
        Fixed-shape tensor ops, no host read: what the forward's resolve runs."""
        loc = self.visible.index_select(0, addrs.reshape(-1).clamp(min=0)).view_as(addrs)
        loc = loc.masked_fill(addrs < 0, -1)
        # -1 (unmapped) >> 32 is -1: neither tier.
        tier = loc >> SLOT_BITS
        slot = loc & SLOT_MASK
        return (torch.where(tier == DEVICE, slot, -1), torch.where(tier == HOST, slot, -1))

    def apply(self, plan: MovePlan, copy_fn: CopyFn) -> MovePlan:
        """Copy the plan's rows with ``copy_fn(src_tier, src_slots, dst_tier, dst_slots)``
        (in ``MovePlan``'s order; its return value is ignored), then commit the plan. If
        ``copy_fn`` raises, the plan's entries are dropped (module doc) and the error
        propagates. An applied, dropped or empty plan is returned as is."""
        if getattr(plan, "_mapping", None) is not self:  # another mapping's, or a fetch plan
            raise ValueError("plan belongs to another mapping")
        if plan.state != "planned":
            return plan
        c = plan.num_staged
        stage_idx = torch.arange(c, device=self.device)
        copies = [(HOST, plan.promote_src_host[:c], STAGING, stage_idx),
                  (DEVICE, plan.demote_src_device, HOST, plan.demote_dst_host),
                  (HOST, plan.promote_src_host[c:], DEVICE, plan.promote_dst_device[c:]),
                  (STAGING, stage_idx, DEVICE, plan.promote_dst_device[:c])]
        self._outstanding = None
        try:
            for src_tier, src, dst_tier, dst in copies:
                if src.numel():
                    copy_fn(src_tier, src, dst_tier, dst)
        except BaseException:
            plan.state = "dropped"
            self.stats.lost += self._release(plan._entries)
            # (counted when planned: these moves did not happen)
            self.stats.demotions -= int(plan.demote_src_device.numel())
            self.stats.promotions -= int(plan.promote_src_host.numel())
            self.stats.staged -= c
            raise
        self.visible.scatter_(0, plan._entries, plan._new_vals)
        plan.state = "committed"
        return plan
