"""Engine-free unified arena for hybrid models: bands, admission ladder, virtual page ids, ledger (no vLLM import)."""

from .admission import COMPACT, RELAYOUT, REUSE, SHORTFALL, AdmitResult
from .arena import Arena
from .copy_plan import CopyPlan
from .kinds import Band, KindSpec, RowSpec, attention_kind, state_kind
from .ledger import Fence, Ledger

__all__ = ["Arena", "AdmitResult", "Band", "CopyPlan", "Fence", "KindSpec", "Ledger", "RowSpec",
           "attention_kind", "state_kind", "REUSE", "COMPACT", "RELAYOUT", "SHORTFALL"]
