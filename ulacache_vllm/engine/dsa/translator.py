"""The forward half of the DSA worker contract, one `GroupTranslator` per layer group (the
`KVTranslator` each of the group's sparse-MLA impls holds): writes to the device rows fixed
before the forward; *resolve* the indexer's logical top-k through the committed mapping table
(`TieredMapping.locate`) into device rows and host rows; in TP shard mode, remote rows from the
buffer of recent ones or, for this step's misses, one all-gather per layer from their owners
(`sharded_rows.ShardedRows`); *stage* the host and fetched rows beside the device rows for
attention's gather (host rows are read in place where the host pool is in attention's view:
the CPU build). Fixed-shape tensor work, no moves, no host reads except the exchange's
collective (module doc of `store`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .kv_translation import KVTranslator

if TYPE_CHECKING:
    from .residency import Residency
    from .rows import RowPools
    from .sharded_rows import ShardedRows
    from .state import LayerGroup, StoreState


class GroupTranslator(KVTranslator):
    """The forward half of the contract for one layer group (see the module doc): reads the
    store's ``state`` and ``pools``; an MTP draft layer's writes are placed by ``residency``,
    TP shard mode's remote rows come from ``sharded``."""

    def __init__(self, group: LayerGroup, state: StoreState, pools: RowPools,
                 residency: Residency, sharded: ShardedRows | None = None):
        self.g = group
        self.state, self.pools, self.residency, self.sharded = state, pools, residency, sharded
        self.shard = sharded.shard if sharded is not None else None
        self.trash_slot = pools.trash_slot

    def write_slots(self, layer_name: str, slot_mapping: torch.Tensor) -> torch.Tensor:
        g = self.g
        if g.write_key is not None and (
                g.write_key is slot_mapping or (
                    g.write_key.data_ptr() == slot_mapping.data_ptr()
                    and g.write_key.shape == slot_mapping.shape)):
            return g.write_rows
        # Not in the pre-forward context (an MTP draft layer), or another layer of the group
        # with a copy of the same slots: prepared here, inside the forward.
        if g.write_key is None or not torch.equal(g.write_key.reshape(-1).long(),
                                                  slot_mapping.reshape(-1).long()):
            self.residency.prepare_writes(g, slot_mapping)
        return g.write_rows

    def resolve(self, layer_name: str, logical: torch.Tensor, req_of_token: torch.Tensor | None):
        g, st = self.g, self.state
        # The group's first layer resolves (each forward pass, so a drafter's repeated passes
        # in one step each resolve their own selection); the others reuse its result.
        if layer_name != g.layers[0] and g.read_step == st.step:
            return g.read
        if st.trace.on:
            st.trace.record(st.step, g.gid, "select", logical.reshape(-1),
                            None if req_of_token is None else
                            req_of_token.long().unsqueeze(1).expand_as(logical)[logical >= 0])
        with st.timed("read"):
            if st.replicas:  # every row is here, at its logical address
                g.read_host = False
                g.read = (logical, [])
                g.read_step = st.step
                return g.read
            sh = self.shard
            local = logical if sh is None else sh.local(logical)
            staged = []
            host_live = not st.identity and g.host_live
            host_base = self.pools.host_base
            g.read_host = host_live and host_base is None
            if st.identity:
                dev = local
            else:
                dev, host = g.mapping.locate(local)
                if g.read_host:
                    staged.append(host)
                elif host_live:  # the host pool is in attention's view: read in place
                    dev = torch.where(host >= 0, host + host_base, dev)
            if sh is not None or not st.identity:
                g.selected.append(logical)
            if sh is not None:
                # TP shard mode: buffered remote rows and this step's misses.
                dev, fetch_ids = self.sharded.read(g, logical, dev)
                staged.append(fetch_ids)
            g.read = (dev, staged)
        g.read_step = st.step
        return g.read

    def staged_rows(self, layer_name: str) -> list[torch.Tensor]:
        g, st = self.g, self.state
        out = []
        if g.read_host:  # as `resolve` decided for this step's read
            out.append(self.pools.host_rows[layer_name])
        if self.shard is not None and not st.replicas:
            # TP shard mode: this layer's rows of the misses, one all-gather.
            out.append(self.sharded.rows(g, layer_name))
        return out
