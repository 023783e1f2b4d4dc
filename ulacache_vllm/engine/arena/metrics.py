"""The arena line's Prometheus series (`vllm:ulacache_<name>`): the scheduler's cumulative
counters, shipped per step in the plan and reported by the worker as increments, and the
arena's gauges (bytes used per kind summed by base kind: full / sliding / state)."""
from __future__ import annotations

from ..line import LineMetrics

ARENA_COUNTERS = ("arena_compactions", "arena_relayouts", "arena_pages_moved",
                  "arena_bytes_copied", "arena_cached_pages_moved", "arena_cache_evictions")
ARENA_KIND_BASES = ("full", "sliding", "state")
ARENA_GAUGES = ("arena_used_bytes", "arena_free_bytes", "arena_withheld_bytes",
                "arena_total_bytes") + tuple(f"arena_used_{k}_bytes" for k in ARENA_KIND_BASES)


def arena_gauges(stats: dict) -> dict:
    """The arena's gauges from the scheduler's stats (bytes used per kind summed by base
    kind: full / sliding / state)."""
    out = {k: stats.get(k, 0) for k in ARENA_GAUGES if not k.startswith("arena_used_") or
           k == "arena_used_bytes"}
    by_kind = stats.get("arena_used_by_kind", {})
    for base in ARENA_KIND_BASES:
        out[f"arena_used_{base}_bytes"] = by_kind.get(base, 0)
    return out


_H = "Arena (hybrid models): "
METRICS = LineMetrics(
    counters={
        "arena_compactions": _H + "compactions run (holes filled with a band's farthest "
                                  "pages).",
        "arena_relayouts": _H + "relayouts run (every movable page slid to its band's base).",
        "arena_pages_moved": _H + "pages moved by compactions and relayouts.",
        "arena_bytes_copied": _H + "bytes copied by compactions and relayouts.",
        "arena_cached_pages_moved": _H + "prefix-cached pages (held or free-but-cached) moved "
                                         "by compactions and relayouts (their vids and hashes "
                                         "stay).",
        "arena_cache_evictions": _H + "free-but-cached pages evicted from the prefix cache to "
                                      "make room (the arena's reclaim).",
        "failed_copies": _H + "page-copy steps in the worker that failed; the requests whose "
                              "KV they lost ended with an error.",
    },
    gauges={
        "arena_used_bytes": _H + "bytes held by requests' pages.",
        "arena_free_bytes": _H + "free bytes.",
        "arena_withheld_bytes": _H + "freed bytes withheld by the page-use ledger until a step "
                                     "in flight completes.",
        "arena_total_bytes": _H + "the arena's size in bytes.",
        "arena_used_full_bytes": _H + "bytes held by full-attention pages.",
        "arena_used_sliding_bytes": _H + "bytes held by sliding-window pages.",
        "arena_used_state_bytes": _H + "bytes held by recurrent-state pages.",
    },
)
