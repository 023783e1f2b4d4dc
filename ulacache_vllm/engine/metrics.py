"""ulacache metrics: per-step counters from the workers, exported on the server's `/metrics`.

They travel vLLM's own connector-stats path (worker `get_kv_connector_stats` -> scheduler
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

COUNTERS = ("lookups", "hits", "promotions", "demotions", "bytes_moved", "fallback_chunks",
            "fast_path_exits")
GAUGES = ("device_used", "host_used", "device_capacity", "host_capacity")


@dataclass
class UlaStats(KVConnectorStats):
    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "UlaStats":
        # Counters add up over steps and ranks; gauges keep the latest report per rank.
        for k in COUNTERS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        for k in GAUGES:
            if k in other.data:
                self.data[k] = other.data[k]
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {k: self.data.get(k, 0) for k in COUNTERS + GAUGES}
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
            "demotions": "Entries moved device -> host (PB-LRU victims).",
            "bytes_moved": "Bytes copied between the device and host pools.",
            "fallback_chunks": "Settles that promoted only part of a step's working set (it exceeded the device pool; the rest stays on the host and is staged when read).",
            "fast_path_exits": "Switches from identity placement (no translation) to mapped placement.",
        }
        self.counters = {
            k: self._make(self._counter_cls, f"vllm:ulacache_{k}", h) for k, h in help_.items()
        }
        gauges = {
            "device_used": "Device-pool slots in use (summed over layer groups).",
            "host_used": "Host-pool slots in use (summed over layer groups).",
            "device_capacity": "Device-pool slots (summed over layer groups).",
            "host_capacity": "Host-pool slots (summed over layer groups).",
        }
        self.gauges = {k: self._make(self._gauge_cls, f"vllm:ulacache_{k}", h)
                       for k, h in gauges.items()}

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
        for k, per_engine in self.gauges.items():
            if k in transfer_stats_data:
                per_engine[engine_idx].set(transfer_stats_data[k])
