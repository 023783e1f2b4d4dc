"""Admission as packing: the three-step ladder, all-or-nothing per request.

1. reuse in place: holes of the kind's band, then the band end (no copies);
2. compact the ends: move far pages of each band into its holes (one copy step);
3. relayout: slide every movable page of each band to its base, so all free bytes but those
   pinned by fences join the middle (ordered copy steps).
A shortfall is reported only after all three fail; the caller then preempts. Whatever the
outcome, the returned copy plan must be executed: moves already happened in the tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .copy_plan import CopyPlan

if TYPE_CHECKING:
    from .arena import Arena

REUSE, COMPACT, RELAYOUT, SHORTFALL = "reuse", "compact", "relayout", "shortfall"


@dataclass
class AdmitResult:
    ok: bool
    virtual_page_ids: dict[str, np.ndarray] = field(default_factory=dict)
    copy_plan: CopyPlan = field(default_factory=CopyPlan)
    shortfall_bytes: int = 0
    step: str = REUSE  # the ladder step that succeeded, or SHORTFALL

    @property
    def vids(self) -> dict[str, np.ndarray]:
        return self.virtual_page_ids


def run_ladder(arena: "Arena", demands: dict[int, int]) -> tuple[dict[int, np.ndarray] | None, CopyPlan, str, int]:
    """Place ``demands`` (kind index -> pages). Returns (physical offsets per kind or None,
    copy plan, step, shortfall bytes)."""
    arena.ledger.poll()
    plan = CopyPlan()
    placed, unplaced = arena._try_place(demands)
    if placed is not None:
        return placed, plan, REUSE, 0
    need = sum(n * arena.page_bytes[k] for k, n in demands.items())
    if need > arena.free_bytes:  # nothing short of freeing can help: move nothing
        return None, plan, SHORTFALL, need - arena.free_bytes
    plan.extend(arena.compact())
    placed, unplaced = arena._try_place(demands)
    if placed is not None:
        return placed, plan, COMPACT, 0
    plan.extend(arena.relayout())
    placed, unplaced = arena._try_place(demands)
    if placed is not None:
        return placed, plan, RELAYOUT, 0
    return None, plan, SHORTFALL, unplaced
