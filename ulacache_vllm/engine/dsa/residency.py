"""Which rows are device-resident (`Residency`, a part the DSA worker store owns): the
pre-forward *settle* (the previous step's selections made device-resident), this step's
*writes* (device rows for new tokens, fixed for the forward; an MTP draft layer's inside its
forward through the translator), the two as one move plan where they apply, and the placement
mode switches a write can trigger: out of identity placement (a write beyond the device
range) and, in TP shard mode, out of replicas (a write beyond the replica limit). Module doc
of `store` for the contract; every move goes through `moves.TierMoves.apply`.
"""
from __future__ import annotations

import torch

from ulacache_vllm.core.mapping import TieredMapping
from ulacache_vllm.core.pools import CapacityError

from .layout import DsaLayout
from .moves import TierMoves
from .rows import RowPools
from .sharded_rows import ShardedRows
from .state import LayerGroup, StoreState


class Residency:
    def __init__(self, layout: DsaLayout, state: StoreState, pools: RowPools,
                 moves: TierMoves, groups: list[LayerGroup],
                 sharded: ShardedRows | None = None):
        self.layout, self.state, self.pools, self.moves = layout, state, pools, moves
        self.groups = groups
        self.sharded = sharded
        self.shard = sharded.shard if sharded is not None else None
        # (step, slot mapping, write rows) of the step's first group under identity placement,
        # shared by `write_step`'s groups only (not by in-forward writes).
        self._identity_writes: tuple | None = None

    # ------------------------------------------------------------ settle
    def settle(self, g: LayerGroup, sel: torch.Tensor) -> None:
        """Make the previous step's selections of ``g`` (local addresses, -1 = none)
        device-resident (hits touched in the round they were read in, host rows promoted as
        ``promote_after`` admits them)."""
        m = g.mapping
        # Padding, duplicates and entries freed since they were read are left to the mapping
        # (it dedups in O(n) and reads each entry's table value once: `drop_unmapped`).
        sel = sel.reshape(-1)
        n = sel.numel()
        while n:
            before = (m.stats.lookups, m.stats.hits, m.stats.deferred)
            try:
                _, plan = m.ensure_resident(sel[:n], drop_unmapped=True, want_slots=False)
            except CapacityError:
                # The step read more rows than the device pool holds: promote a prefix; the
                # rest stays on the host (staged again if read again).
                n //= 2
                self.state.counters.fallback_chunks += 1
                continue
            self._count_reads(m, before)
            self.moves.apply(g, plan)
            return

    def _count_reads(self, m: TieredMapping, before: tuple[int, int, int]) -> None:
        """Adds a settle's lookups, hits and deferred promotions (``m.stats`` minus
        ``before``) to the store's counters."""
        c = self.state.counters
        c.lookups += m.stats.lookups - before[0]
        c.hits += m.stats.hits - before[1]
        c.deferred += m.stats.deferred - before[2]

    # ------------------------------------------------------------ writes
    def write_step(self, writes: dict, deferred: dict[int, torch.Tensor]) -> None:
        """This step's writes of every group with write slots in ``writes`` (per layer name);
        a group with a selection in ``deferred`` (by group id) settles it in the same plan."""
        self._identity_writes = (self.state.step, None, None)
        for g in self.groups:
            sm = writes.get(g.layers[0])
            if sm is None:
                continue
            sel = deferred.get(g.gid)
            if sel is not None:
                self.settle_and_write(g, sel, sm)
            else:
                self.prepare_writes(g, sm)
        self._identity_writes = None

    def settle_and_write(self, g: LayerGroup, sel: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
        """Settle, round and writes of ``g`` (mapped placement: not identity, not replicas) as
        ONE move plan (`TieredMapping.settle_and_assign`: one victim selection, one set of
        copies); one by one where the merged plan does not apply."""
        st, m = self.state, g.mapping
        local = self.shard.local(sel) if self.shard is not None else sel
        with st.timed("write"):
            sm = slot_mapping.reshape(-1).long()
            if g.remote is not None:
                # As in `prepare_writes`: a written address's buffered copy is stale now.
                g.remote.invalidate(sm[sm >= 0])
            if self.shard is not None:
                sm = self.shard.local(sm)
            before = (m.stats.lookups, m.stats.hits, m.stats.deferred)
            out = m.settle_and_assign(local, sm)
            if out is not None:
                st.trace.record(st.step, g.gid, "append", slot_mapping)
                self._count_reads(m, before)
                st.counters.merged_plans += 1
                slots, plan = out
                if not self.moves.apply(g, plan, fresh=sm):
                    # As in `prepare_writes`: the new entries lost only their slots.
                    slots, plan = m.assign(sm)
                    self.moves.apply(g, plan)
                g.write_key = slot_mapping
                g.write_rows = slots.masked_fill(slots < 0, self.pools.trash_slot)
                return
        self.settle(g, local)
        m.advance_round()
        self.prepare_writes(g, slot_mapping)

    def prepare_writes(self, g: LayerGroup, slot_mapping: torch.Tensor) -> None:
        """Device rows for this step's new tokens of ``g`` (padding and, in TP shard mode,
        other ranks' tokens -> the trash row)."""
        st = self.state
        st.trace.record(st.step, g.gid, "append", slot_mapping)
        with st.timed("write"):
            shared = self._identity_writes
            same = (st.identity and shared is not None and shared[0] == st.step
                    and shared[1] is slot_mapping)
            if same and g.remote is None:
                # Identity placement: every group's write rows are the same (one check of
                # the device range and one live mark per step, not one per group).
                g.write_key, g.write_rows = slot_mapping, shared[2]
                return
            sm = slot_mapping.reshape(-1).long()
            valid = sm.masked_select(sm >= 0)
            if g.remote is not None:
                # A written address's buffered copy is stale from now on (speculative decoding
                # rewrites rejected drafts' rows in place): every rank drops it alike.
                g.remote.invalidate(valid)
                if same:  # (the rest as above)
                    g.write_key, g.write_rows = slot_mapping, shared[2]
                    return
            if self.shard is not None:  # (valid: marked live in begin_step)
                if st.replicas:
                    if valid.numel() and int(valid.max()) >= self.sharded.replica_limit:
                        self._end_replicas()
                    else:  # every rank writes every row, at its logical address
                        g.write_key = slot_mapping
                        g.write_rows = torch.where(sm >= 0, sm,
                                                   torch.full_like(sm, self.pools.trash_slot))
                        return
                sm = self.shard.local(sm)
                valid = sm.masked_select(sm >= 0)
            if st.identity:
                if valid.numel() and int(valid.max()) >= self.layout.device_slots:
                    self._leave_identity()
                else:
                    st.live.index_fill_(0, valid, True)
                    slots = sm
            if not st.identity:
                slots, plan = g.mapping.assign(sm)
                if not self.moves.apply(g, plan, fresh=sm):
                    # This step's new entries lost only slots, no data (they are written in
                    # the forward): the failed plan freed the victims' slots, so assigning
                    # them again needs no move.
                    slots, plan = g.mapping.assign(sm)
                    self.moves.apply(g, plan)
            g.write_key = slot_mapping
            g.write_rows = slots.masked_fill(slots < 0, self.pools.trash_slot)
            if st.identity and self._identity_writes is not None:
                self._identity_writes = (st.step, slot_mapping, g.write_rows)  # (write_step)

    # ------------------------------------------------------------ mode switches
    def _leave_identity(self) -> None:
        """The first write beyond the device range: the live addresses are adopted into the
        mapping tables in place (nothing moves); mapped placement from now on."""
        addrs = torch.nonzero(self.state.live).flatten()
        for g in self.groups:
            g.mapping.adopt(addrs, addrs)
            g.mapping.advance_round()
            if g.write_key is not None:  # an earlier group's writes of this step: re-assign
                key = g.write_key
                g.write_key = None
                self.prepare_writes(g, key)
        self.state.identity = False
        self.state.counters.fast_path_exits += 1

    def _end_replicas(self) -> None:
        """Replicated rows -> shards, on every rank at the same step: this rank's tokens move
        to their local addresses (`ShardedRows.localize`; local identity placement), the
        others' rows are dropped."""
        st = self.state
        local = self.sharded.localize()
        st.replicas = False
        st.identity = True
        st.live.zero_()
        st.live.index_fill_(0, local, True)
        st.counters.replica_exits += 1
        for g in self.groups:
            if g.write_key is not None:  # an earlier group's writes of this step: re-assign
                key = g.write_key
                g.write_key = None
                self.prepare_writes(g, key)
