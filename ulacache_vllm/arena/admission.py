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
success the returned copy plan must be executed before the new pages are used. The ladder
itself is `Arena._run_ladder` (it works on the arena's own tables); this module holds its
result type and step names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

from .copy_plan import CopyPlan

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
