"""ulacache metrics: per-step counters from the workers, exported on the server's `/metrics`.

Every worker (each TP rank) reports its own pools and counters: counters add up, and the
pool gauges are summed over ranks. They travel vLLM's own connector-stats path (worker `get_kv_connector_stats` -> scheduler
stats -> stat loggers -> `build_prom_metrics`), so they land in vLLM's Prometheus registry
with its `engine`/`model_name` labels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

COUNTERS = ("lookups", "hits", "promotions", "deferred", "demotions", "bytes_moved", "fallback_chunks",
            "fast_path_exits", "replica_exits", "remote_lookups", "remote_hits", "remote_rows_fetched",
            "remote_bytes_fetched", "remote_fill_skips", "failed_copies", "prefix_hit_entries",
            "prefix_hit_entries_host")
# The arena (hybrid models): cumulative counters from the scheduler, shipped per step.
ARENA_COUNTERS = ("arena_compactions", "arena_relayouts", "arena_pages_moved",
                  "arena_bytes_copied", "arena_cached_pages_moved", "arena_cache_evictions")
ARENA_KIND_BASES = ("full", "sliding", "state")
ARENA_GAUGES = ("arena_used_bytes", "arena_free_bytes", "arena_withheld_bytes",
                "arena_total_bytes") + tuple(f"arena_used_{k}_bytes" for k in ARENA_KIND_BASES)
COUNTERS = COUNTERS + ARENA_COUNTERS
GAUGES = ("device_used", "host_used", "device_capacity", "host_capacity", "remote_used",
          "remote_capacity") + ARENA_GAUGES
_AT = "@rank"  # gauges travel per rank (``device_used@rank1``) and are summed over ranks


def arena_gauges(stats: dict) -> dict:
    """The arena's gauges from the scheduler's stats (bytes used per kind summed by base
    kind: full / sliding / state)."""
    out = {k: stats.get(k, 0) for k in ARENA_GAUGES if not k.startswith("arena_used_") or
           k == "arena_used_bytes"}
    by_kind = stats.get("arena_used_by_kind", {})
    for base in ARENA_KIND_BASES:
        out[f"arena_used_{base}_bytes"] = by_kind.get(base, 0)
    return out


def per_rank_gauges(usage: dict, rank: int) -> dict:
    return {f"{k}{_AT}{rank}": v for k, v in usage.items() if k in GAUGES}


@dataclass
class UlaStats(KVConnectorStats):
    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "UlaStats":
        # Counters add up over steps and ranks; a gauge keeps each rank's latest report.
        for k, v in other.data.items():
            if k in COUNTERS:
                self.data[k] = self.data.get(k, 0) + v
            else:
                self.data[k] = v
        return self

    def gauges(self) -> dict[str, int]:
        """Each gauge summed over the ranks that reported it."""
        out: dict[str, int] = {}
        for k, v in self.data.items():
            if _AT in k:
                name = k.split(_AT)[0]
                out[name] = out.get(name, 0) + v
            elif k in GAUGES:
                out[k] = out.get(k, 0) + v
        return out

    def reduce(self) -> dict[str, int | float]:
        out = {k: self.data.get(k, 0) for k in COUNTERS}
        out.update({k: 0 for k in GAUGES})
        out.update(self.gauges())
        look = out["lookups"]
        out["device_hit_rate"] = out["hits"] / look if look else 0.0
        return out

    def is_empty(self) -> bool:
        return not self.data


class UlaPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        help_ = {
            "lookups": "Sparse-MLA KV entries looked up by the indexer's top-k (deduplicated).",
            "hits": "Looked-up entries already resident in the device pool.",
            "promotions": "Entries moved host -> device.",
            "deferred": "Looked-up host entries left on the host (read there) because they were not read in --ula-promote-after steps in a row.",
            "demotions": "Entries moved device -> host (PB-LRU victims).",
            "bytes_moved": "Bytes copied between the device and host pools.",
            "fallback_chunks": "Settles that promoted only part of a step's working set (it exceeded the device pool; the rest stays on the host and is staged when read).",
            "fast_path_exits": "Switches from identity placement (no translation) to mapped placement.",
            "replica_exits": "TP shard mode: switches from replicated rows (while everything fits one rank) to shards.",
            "remote_lookups": "TP shard mode: unique remote (other ranks') entries read, per read.",
            "remote_hits": "TP shard mode: remote entries read from the buffer of recently fetched rows.",
            "remote_rows_fetched": "TP shard mode: rows fetched from their owner ranks (per layer).",
            "remote_bytes_fetched": "TP shard mode: bytes of rows fetched from their owner ranks.",
            "remote_fill_skips": "TP shard mode: steps (per layer group) that left the remote-row buffer as it was because reads seldom hit it (--ula-remote-buffer-min-hit-rate).",
            "failed_copies": "Copies in the worker's move path that failed (tier row copies; arena page-copy steps); the requests whose KV they lost ended with an error.",
            "prefix_hit_entries": "Prefix-cache hits: entries of cached blocks a new request took over (per layer group).",
            "prefix_hit_entries_host": "Prefix-cache hits whose entries sat in the host tier when the request took them over (read from there; promoted once attention selects them in --ula-promote-after steps in a row).",
            "arena_compactions": "Arena (hybrid models): compactions run (holes filled with a band's farthest pages).",
            "arena_relayouts": "Arena (hybrid models): relayouts run (every movable page slid to its band's base).",
            "arena_pages_moved": "Arena (hybrid models): pages moved by compactions and relayouts.",
            "arena_bytes_copied": "Arena (hybrid models): bytes copied by compactions and relayouts.",
            "arena_cached_pages_moved": "Arena (hybrid models): prefix-cached pages (held or free-but-cached) moved by compactions and relayouts (their vids and hashes stay).",
            "arena_cache_evictions": "Arena (hybrid models): free-but-cached pages evicted from the prefix cache to make room (the arena's reclaim).",
        }
        self.counters = {
            k: self._make(self._counter_cls, f"vllm:ulacache_{k}", h) for k, h in help_.items()
        }
        gauges = {
            "device_used": "Device-pool slots in use (summed over layer groups).",
            "host_used": "Host-pool slots in use (summed over layer groups).",
            "device_capacity": "Device-pool slots (summed over layer groups).",
            "host_capacity": "Host-pool slots (summed over layer groups).",
            "remote_used": "TP shard mode: remote-row buffer slots in use (summed over groups).",
            "remote_capacity": "TP shard mode: remote-row buffer slots (summed over groups).",
            "arena_used_bytes": "Arena (hybrid models): bytes held by requests' pages.",
            "arena_free_bytes": "Arena (hybrid models): free bytes.",
            "arena_withheld_bytes": "Arena (hybrid models): freed bytes withheld by the page-use ledger until a step in flight completes.",
            "arena_total_bytes": "Arena (hybrid models): the arena's size in bytes.",
            "arena_used_full_bytes": "Arena (hybrid models): bytes held by full-attention pages.",
            "arena_used_sliding_bytes": "Arena (hybrid models): bytes held by sliding-window pages.",
            "arena_used_state_bytes": "Arena (hybrid models): bytes held by recurrent-state pages.",
        }
        self.gauges = {k: self._make(self._gauge_cls, f"vllm:ulacache_{k}", h)
                       for k, h in gauges.items()}
        self._last: dict[int, dict[str, int]] = {}

    def _make(self, cls, name, documentation):
        kwargs: dict[str, Any] = {"name": name, "documentation": documentation,
                                  "labelnames": self._labelnames}
        if cls is self._gauge_cls:
            kwargs["multiprocess_mode"] = "mostrecent"
        metric = cls(**kwargs)
        return {idx: metric.labels(*vals) for idx, vals in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for k, per_engine in self.counters.items():
            v = transfer_stats_data.get(k, 0)
            if v:
                per_engine[engine_idx].inc(v)
        # Each rank's latest report stays until it reports again (ranks report when their
        # own pools changed), and the gauge shows the sum over ranks.
        last = self._last.setdefault(engine_idx, {})
        last.update({k: v for k, v in transfer_stats_data.items() if _AT in k})
        summed = UlaStats(data=dict(last)).gauges()
        for k, per_engine in self.gauges.items():
            if k in summed:
                per_engine[engine_idx].set(summed[k])
