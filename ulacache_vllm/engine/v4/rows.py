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

A failed copy (an exception from a copy; `engine/faults.py` injects them in tests, moves
``demote``, ``promote``, ``stage``) never kills the engine and is never read: the mapping drops
the plan's entries (unmapped: a read of them resolves to -1, which the kernels skip), their
logical blocks go to ``lost_blocks``, which the worker reports as KV load errors (the v4
line's scheduler side ends the requests holding them with an error and drops the blocks from
the prefix cache). This step's new rows hold no data yet: they are placed again, and lost
only if that fails too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ulacache_vllm.core.mapping import DEVICE, HOST, STAGING, TieredMapping
from ulacache_vllm.core.pools import CapacityError

from ..faults import MoveFaults

# (vLLM's init_logger is this; plain logging keeps the module importable without vLLM.)
logger = logging.getLogger("vllm.ulacache.v4_rows")


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

    def __init__(self, plan: CsaRowsPlan, name: str, lru: str, promote_after: int,
                 owner: CsaRows | None = None) -> None:
        self.name = name
        self.plan = plan
        self.owner = owner  # where failed copies are recorded (None: a lone layer, tests)
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
        faults = self.owner.faults if self.owner is not None else None
        if faults is not None:  # test-only (`engine/faults.py`)
            faults.before_copy("stage" if STAGING in (src_tier, dst_tier) else
                               "demote" if src_tier == DEVICE else "promote", int(src.numel()))

        def rows(tier, idx):
            return idx + D if tier == HOST else idx

        if dst_tier == STAGING:
            stage["rows"] = self.rows2d.index_select(0, rows(src_tier, src))
            return
        data = (stage["rows"].index_select(0, src) if src_tier == STAGING
                else self.rows2d.index_select(0, rows(src_tier, src)))
        self.rows2d.index_copy_(0, rows(dst_tier, dst), data)

    def _apply(self, plan, fresh: torch.Tensor | None = None) -> bool:
        """Copies the plan's rows, then commits it; False if a copy failed (module doc): the
        dropped entries but ``fresh`` (this step's new rows, no data yet) are lost."""
        if plan.empty:
            return True
        stage: dict = {}
        try:
            plan.apply(lambda s, si, d, di: self._copy(s, si, d, di, stage))
        except Exception as err:  # noqa: BLE001 - any copy failure: see the module doc
            lost = plan.entries
            if fresh is not None:  # (placed again by the caller: counted once)
                self.mapping.stats.assigned -= int(fresh.numel())
                lost = lost[~torch.isin(lost, fresh)]
            self._lost(lost, err)
            return False
        return True

    def _lost(self, rows: torch.Tensor, err: Exception) -> None:
        blocks = torch.unique(rows // self.plan.rows_per_block).tolist()
        if self.owner is not None:
            self.owner.failed_copies += 1
            self.owner.lost_blocks.update(blocks)
        logger.error("ulacache v4: a CSA row copy failed in %s (%s: %s); %d rows of %d logical "
                     "blocks dropped, their requests end with an error", self.name,
                     type(err).__name__, err, int(rows.numel()), len(blocks))

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
                fresh = new.unique()
                _, plan = self.mapping.assign(fresh)
                if not self._apply(plan, fresh):
                    # The victims' rows are lost; the new rows hold no data yet: placed again
                    # (lost too if that fails: they would never be written).
                    _, plan = self.mapping.assign(fresh)
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

    def __init__(self, plan: CsaRowsPlan, lru: str, promote_after: int,
                 faults: MoveFaults | None = None) -> None:
        self.plan = plan
        self.faults = faults  # test-only (`engine/faults.py`); None: no fault can fire
        self.layers = {n: CsaLayerRows(plan, n, lru, promote_after, self)
                       for n in plan.layer_names}
        self.settle_overflows = 0
        self.steps = 0
        self.failed_copies = 0
        self.lost_blocks: set[int] = set()  # logical blocks a failed copy lost, not reported

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

    def take_lost(self) -> set[int]:
        """Logical blocks of the CSA pool whose rows a failed copy lost since the last call."""
        out, self.lost_blocks = self.lost_blocks, set()
        return out

    def counters(self) -> dict:
        out: dict = {"settle_overflows": self.settle_overflows,
                     "failed_copies": self.failed_copies}
        for rows in self.layers.values():
            for k, v in rows.counters().items():
                out[k] = out.get(k, 0) + v
        return out
