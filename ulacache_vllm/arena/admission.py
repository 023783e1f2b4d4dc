"""Admission as packing: the three-step ladder, all-or-nothing per request.

1. reuse in place: holes of the kind's band, then the band end (no copies);
2. compact the ends: move far pages of each band into its holes (one copy step per pass;
   passes repeat while they move pages, since a pass's own moves can merge holes that
   a further pass fills);
3. relayout: slide every movable page of each band to its base, so all free bytes but those
   pinned by fences join the middle (ordered copy steps); relayout and compaction passes
   then alternate while they move pages (compaction puts pages from beyond a fenced page
   into a hole before it, which a slide never does; the next slide closes the gaps).
At each step the pages are placed by a few greedy packings (largest kinds first into the
holes nearest the base; largest first best-fit; smallest first), the first that fits wins.
A shortfall is reported only after all three steps fail; the caller then preempts. A shortfall
changes nothing: moves tried on the way are rolled back and its copy plan is empty. On
success the returned copy plan must be executed before the new pages are used.
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


# Passes per ladder step: every move takes a page towards its band's base, so the passes end
# by themselves; the cap bounds a pathological chain of one-page merges.
MAX_PASSES = 16


def run_ladder(arena: "Arena", demands: dict[int, int]) -> tuple[dict[int, np.ndarray] | None, CopyPlan, str, int]:
    """Place ``demands`` (kind index -> pages). Returns (physical offsets per kind or None,
    copy plan, step, shortfall bytes)."""
    arena.ledger.poll()
    placed, unplaced = arena._try_place(demands)
    if placed is not None:
        return placed, CopyPlan(), REUSE, 0
    need = sum(n * arena.page_bytes[k] for k, n in demands.items())
    if need > arena.free_bytes:  # nothing short of freeing can help: move nothing
        return None, CopyPlan(), SHORTFALL, need - arena.free_bytes
    # A scheduler retries its head request every step: the same demand on an unchanged
    # arena (no allocation, free, move or fence passed since) fails the same way.
    key = (arena._version, tuple(sorted(demands.items())))
    if arena._failed is not None and arena._failed[0] == key:
        return None, CopyPlan(), SHORTFALL, arena._failed[1]
    saved = arena._snapshot()
    plan = CopyPlan()
    try:
        for step, moves in ((COMPACT, (arena.compact,)), (RELAYOUT, (arena.relayout, arena.compact))):
            for _ in range(MAX_PASSES):
                moved = False
                for move in moves:
                    more = move()
                    if not more:
                        continue  # nothing moved: the last placement attempt stands
                    plan.extend(more)
                    moved = True
                    placed, unplaced = arena._try_place(demands)
                    if placed is not None:
                        return placed, plan, step, 0
                if not moved:
                    break
    except BaseException:
        arena._restore(saved)  # tables as before the call: nothing half-moved
        raise
    arena._restore(saved)
    arena._failed = (key, unplaced)
    return None, CopyPlan(), SHORTFALL, unplaced
