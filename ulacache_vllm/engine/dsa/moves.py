"""The DSA worker store's moves between tiers (`TierMoves`, a part the store owns): the
byte-row copy a move plan runs per layer group, and what a failed copy leaves behind.

A failed copy (an exception from the copy; `faults.MoveFaults` injects them in tests) never
kills the engine and is never read: `TieredMapping.apply` drops the plan's entries, their
logical blocks go to ``lost_blocks`` (reported to the scheduler as KV load errors, so vLLM ends
the requests owning them with an error), and this step's new entries, which hold no data yet,
are not lost (the caller assigns them again).
"""
from __future__ import annotations

import torch
from vllm.logger import init_logger

from ulacache_vllm.core.mapping import DEVICE, HOST, STAGING
from ulacache_vllm.core.placement import TokenShard

from ..faults import MoveFaults
from .layout import DsaLayout
from .rows import RowPools, wide
from .state import LayerGroup, StoreState

logger = init_logger("vllm.ulacache.worker_store")


class TierMoves:
    """Copies between the tiers of the store's pools and failed-copy bookkeeping.
    ``shard``: TP shard mode's token placement (lost local addresses -> logical blocks)."""

    def __init__(self, layout: DsaLayout, pools: RowPools, state: StoreState,
                 shard: TokenShard | None = None):
        self.layout, self.pools, self.state, self.shard = layout, pools, state, shard
        self.faults = MoveFaults.from_env()  # test-only fault injection; None by default
        # Failed moves (see `apply`): logical blocks whose rows were lost, until the connector
        # reports them; and the entries lost since startup. (The failed copies themselves
        # are a counter: `failed_copies`.)
        self.lost_blocks: set[int] = set()
        self.lost_entries = 0

    def copy_fn(self, g: LayerGroup):
        """Copies byte rows of every layer of ``g`` between tiers (device, host, staging)."""
        def copy(src_tier, src, dst_tier, dst):
            need = src.numel() if STAGING in (src_tier, dst_tier) else 0
            if self.faults is not None:
                self.faults.before_copy("stage" if need else
                                        "demote" if src_tier == DEVICE else "promote",
                                        int(src.numel()))
            for name in g.layers:
                s = self._bytes(g, name, src_tier, need)
                d = self._bytes(g, name, dst_tier, need)
                if s.dtype != d.dtype:  # a staging buffer of another width (never on CPU)
                    s, d = s.view(torch.uint8), d.view(torch.uint8)
                # One op per copy, on the destination's device: the gather runs where the
                # source lives and lands before the scatter reads it (stream order on CUDA
                # needs a device-side view of the host pool; the CPU backend reads it directly).
                d.index_copy_(0, dst.to(d.device), s.index_select(0, src.to(s.device)).to(d.device))
            if src_tier != dst_tier and STAGING not in (src_tier, dst_tier):
                self.state.counters.bytes_moved += int(src.numel()) * g.row_bytes
            return None
        return copy

    def _bytes(self, g: LayerGroup, name: str, tier: int, need: int) -> torch.Tensor:
        """The rows of ``tier`` for a copy, viewed in the widest integer type dividing a row
        (`rows.wide`)."""
        if tier == DEVICE:
            return self.pools.wide_rows[name][0]
        if tier == HOST:
            return self.pools.wide_rows[name][1]
        buf = g.staging.get(name)
        if buf is None or buf.shape[0] < need:
            buf = torch.empty(max(need, 64), self.layout.mla_row_bytes[name], dtype=torch.uint8,
                              device=self.pools.device)
            g.staging[name] = buf
        return wide(buf)

    def apply(self, g: LayerGroup, plan, fresh: torch.Tensor | None = None) -> bool:
        """Copies the plan's rows, then commits it; False if a copy failed.

        A failed copy (an exception from the copy; `faults.MoveFaults` injects them in tests)
        must never let a request read rows that were not fully moved, nor kill the engine
        (vLLM ends the engine core on any exception in a step): `TieredMapping.apply` drops
        the plan's entries (unmapped, slots back in the pools, so the tables stay consistent),
        and their logical blocks go to `lost_blocks`, which the connector reports to the
        scheduler as KV load errors: vLLM ends the requests owning them with an error
        (``kv_load_failure_policy="fail"``) before it emits this step's tokens of theirs.
        ``fresh``: this step's write addresses (local); their entries hold no data yet, so
        they are not lost (the caller assigns them again)."""
        if plan.empty:
            return True
        if plan.demote_src_device.numel():
            g.host_live = True  # (a draft layer's in-forward writes may demote)
        try:
            with self.state.timed("copy"):
                g.mapping.apply(plan, self.copy_fn(g))
        except Exception as err:  # noqa: BLE001 - any copy failure: see the docstring
            lost = plan.entries  # what `apply` dropped (core/mapping.py module doc)
            if fresh is not None:
                lost = lost[~torch.isin(lost, fresh)]
            self._lost(lost, err)
            return False
        self.state.counters.promotions += int(plan.promote_src_host.numel())
        self.state.counters.demotions += int(plan.demote_src_device.numel())
        return True

    def _lost(self, local: torch.Tensor, err: Exception) -> None:
        """Records entries a failed move dropped (local addresses) as lost logical blocks."""
        addrs = local if self.shard is None else local * self.shard.world + self.shard.rank
        blocks = torch.unique(addrs // self.layout.block_size).tolist()
        self.lost_blocks.update(blocks)
        self.state.counters.failed_copies += 1
        self.lost_entries += int(local.numel())
        self.state.usage_changed = True
        logger.error("ulacache: a row copy failed (%s: %s); %d entries of %d logical blocks "
                     "dropped, their requests end with an error", type(err).__name__, err,
                     int(local.numel()), len(blocks))

    def take_lost_blocks(self) -> set[int]:
        out, self.lost_blocks = self.lost_blocks, set()
        return out
