"""DeepSeek-V4's CSA compressed rows in the logical address space (the v4 line's worker side).

A CSA layer (a compress-ratio-4 attention layer) stores one 584-byte compressed row per 4
tokens and reads, per query token, the 512 rows its own indexer selects. Here each CSA layer's
rows live in one pool of byte rows, ``uint8 [device_rows + host_rows, 1, row_bytes]``: device
rows first (counted in the KV budget), host rows after them (`--ula-host-pool-gib`). A
`core.mapping.TieredMapping` per layer maps a *logical row* (``logical block * rows_per_block +
row``, the slot vLLM's V4 metadata computes from the CSA group's block table, whose ids are
logical blocks of the scheduler's CSA pool) to a device row or a host row: exclusive
residency, PB-LRU victims, promotion after ``promote_after`` settles in a row.

vLLM's V4 kernels take the pool as pages of one row (block size 1: a row's data and scales
in its own 584 bytes), so a row is addressed by its pool index wherever it lives; host rows
are read in place (the CPU build). The layer's kernels see the pool through
`patches.v4_csa_rows` (the compressor writes at ``write_slots``, the attention reads at
``resolve`` of the indexer's logical top-k).

The worker contract (outside the forward, in `begin`, in this order): dead blocks' rows are
freed; the rows each layer selected in the previous step are settled (promoted after repeated
reads, victims demoted; a working set larger than the device pool stays where it is, read
in place); the PB-LRU round advances; this step's new rows get device rows (victims demoted)
and the write slots are fixed. Inside the forward: fixed-shape tensor work only (`resolve`:
one gather through the committed table; the selection is kept for the next settle).
Every move copies the rows, then commits the mapping (`TieredMapping.apply`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ulacache_vllm.core.mapping import DEVICE, HOST, STAGING, TieredMapping
from ulacache_vllm.core.pools import CapacityError


@dataclass(frozen=True)
class CsaRowsPlan:
    """The sizing's figures for the CSA rows (one entry of the v4 layout)."""

    group: int  # the CSA layers' KV cache group (its block table holds logical blocks)
    layer_names: tuple[str, ...]
    rows_per_block: int  # compressed rows per logical block (256 tokens / 4)
    row_bytes: int  # one layer's row (584 B: 448 fp8 + 64 bf16 RoPE + 8 scale bytes)
    device_rows: int  # per layer
    host_rows: int  # per layer
    num_blocks: int  # logical blocks of the scheduler's CSA pool (the null block included)

    @property
    def device_bytes(self) -> int:
        return self.device_rows * self.row_bytes * len(self.layer_names)

    @property
    def host_bytes(self) -> int:
        return self.host_rows * self.row_bytes * len(self.layer_names)


class CsaLayerRows:
    """One CSA layer's pool and mapping table (module doc)."""

    def __init__(self, plan: CsaRowsPlan, name: str, lru: str, promote_after: int) -> None:
        self.name = name
        self.plan = plan
        D, H = plan.device_rows, plan.host_rows
        self.pool = torch.zeros(D + H, 1, plan.row_bytes, dtype=torch.uint8)
        self.rows2d = self.pool.view(D + H, plan.row_bytes)
        self.mapping = TieredMapping(plan.num_blocks * plan.rows_per_block, D, H, lru=lru,
                                     promote_after=promote_after)
        self.selected: list[torch.Tensor] = []  # this step's resolved logical rows
        self.write_slots: torch.Tensor | None = None  # this step's, fixed before the forward

    # ------------------------------------------------------------- forward half
    def physical(self, logical: torch.Tensor) -> torch.Tensor:
        """Pool rows of ``logical`` rows (-1 stays -1) through the committed table."""
        dev, host = self.mapping.locate(logical)
        return torch.where(dev >= 0, dev, torch.where(host >= 0, host + self.plan.device_rows,
                                                      host))

    def resolve(self, logical: torch.Tensor) -> torch.Tensor:
        """The attention's read: pool rows of the selected logical rows; the selection is
        kept for the next settle (no host read here)."""
        self.selected.append(logical)
        return self.physical(logical)

    # ------------------------------------------------------------ between steps
    def _copy(self, src_tier: int, src: torch.Tensor, dst_tier: int, dst: torch.Tensor,
              stage: dict) -> None:
        D = self.plan.device_rows

        def rows(tier, idx):
            return idx + D if tier == HOST else idx

        if dst_tier == STAGING:
            stage["rows"] = self.rows2d.index_select(0, rows(src_tier, src))
            return
        data = (stage["rows"].index_select(0, src) if src_tier == STAGING
                else self.rows2d.index_select(0, rows(src_tier, src)))
        self.rows2d.index_copy_(0, rows(dst_tier, dst), data)

    def _apply(self, plan) -> int:
        stage: dict = {}
        plan.apply(lambda s, si, d, di: self._copy(s, si, d, di, stage))
        return 0 if plan.empty else int(plan.demote_src_device.numel()
                                        + plan.promote_src_host.numel())

    def free_blocks(self, blocks: torch.Tensor) -> None:
        if blocks.numel():
            rpb = self.plan.rows_per_block
            rows = (blocks.unsqueeze(1) * rpb + torch.arange(rpb)).reshape(-1)
            self.mapping.free(rows)

    def settle(self) -> bool:
        """The previous step's selections made device-resident where they fit (module doc);
        False when the working set exceeded the device pool (left where it is)."""
        sel, self.selected = self.selected, []
        if not sel:
            return True
        addrs = torch.cat([s.reshape(-1) for s in sel])
        try:
            _, plan = self.mapping.ensure_resident(addrs, drop_unmapped=True, want_slots=False)
        except CapacityError:
            return False
        self._apply(plan)
        return True

    def assign_writes(self, logical_slots: torch.Tensor, valid: torch.Tensor) -> None:
        """This step's new rows (``logical_slots``: vLLM's CSA slot mapping, -1 where a token
        writes no row; ``valid``: its entries >= 0) get pool rows: device rows for rows not
        yet mapped, in place for rows already mapped (a row is written once; a re-sent block's
        row is overwritten where it lives)."""
        if valid.numel():
            dev, host = self.mapping.locate(valid)
            new = valid[(dev < 0) & (host < 0)]
            if new.numel():
                _, plan = self.mapping.assign(new.unique())
                self._apply(plan)
        self.write_slots = self.physical(logical_slots)

    def counters(self) -> dict:
        s = self.mapping.stats
        return {"demotions": s.demotions, "promotions": s.promotions, "hits": s.hits,
                "lookups": s.lookups, "deferred": s.deferred, "assigned": s.assigned,
                "freed": s.freed, "device_used": self.mapping.device_used,
                "host_used": self.mapping.host_used}


class CsaRows:
    """Every CSA layer's rows (one `CsaLayerRows` per layer) and the step's contract."""

    def __init__(self, plan: CsaRowsPlan, lru: str, promote_after: int) -> None:
        self.plan = plan
        self.layers = {n: CsaLayerRows(plan, n, lru, promote_after) for n in plan.layer_names}
        self.settle_overflows = 0
        self.steps = 0

    def free(self, dead_blocks) -> None:
        """The dead logical blocks' rows leave every layer's tables (first thing of a step,
        also of a step with no forward)."""
        if dead_blocks:
            dead = torch.as_tensor(list(dead_blocks), dtype=torch.int64)
            for rows in self.layers.values():
                rows.free_blocks(dead)

    def begin(self, slot_mapping: torch.Tensor | None) -> None:
        """Outside the forward, after `free` (module doc): settle, round, this step's
        writes."""
        self.steps += 1
        if slot_mapping is not None:  # the same slots for every CSA layer: read once
            slot_mapping = slot_mapping.long()
            valid = slot_mapping[slot_mapping >= 0]
        for rows in self.layers.values():
            if not rows.settle():
                self.settle_overflows += 1
            rows.mapping.advance_round()
            if slot_mapping is not None:
                rows.assign_writes(slot_mapping, valid)

    def counters(self) -> dict:
        out: dict = {"settle_overflows": self.settle_overflows}
        for rows in self.layers.values():
            for k, v in rows.counters().items():
                out[k] = out.get(k, 0) + v
        return out
