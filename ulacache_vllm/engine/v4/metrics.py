"""The v4 line's Prometheus series (`vllm:ulacache_<name>`): the arena's (every V4 cache but
the CSA rows) and the CSA rows' tiers (worker counters as increments, pool rows per rank)."""
from __future__ import annotations

from ..arena.metrics import METRICS as ARENA
from ..line import LineMetrics

_C = "DeepSeek-V4 CSA rows: "
METRICS = LineMetrics(
    counters={
        **ARENA.counters,
        "v4_csa_demotions": _C + "compressed rows demoted from the device pool to the host "
                                 "pool (PB-LRU victims).",
        "v4_csa_promotions": _C + "host rows promoted to the device pool after repeated "
                                  "reads.",
        "v4_csa_assigned": _C + "new compressed rows placed (on the device).",
        "v4_csa_freed": _C + "rows freed with their dead logical blocks.",
        "v4_csa_settle_overflows": _C + "settles whose selected rows exceeded the device pool "
                                        "(read in place on the host instead).",
        "v4_csa_failed_copies": _C + "row copies between the tiers that failed; the requests "
                                     "holding the rows they lost ended with an error.",
        "v4_state_scratch_tokens": "DeepSeek-V4 compressor states: prefill tokens whose state "
                                   "stayed in the step's scratch (no arena page: out of the "
                                   "window after the step), summed over state kinds.",
    },
    gauges={
        **ARENA.gauges,
        "v4_csa_device_rows_used": _C + "device-pool rows in use, all CSA layers.",
        "v4_csa_host_rows_used": _C + "host-pool rows in use, all CSA layers.",
    },
)
