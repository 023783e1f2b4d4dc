"""ulacache metrics: per-step counters and gauges from the workers, exported on `/metrics`.

Every worker (each TP rank) reports its own pools and counters: counters add up, and the
gauges are summed over ranks. They travel vLLM's own connector-stats path (worker
`get_kv_connector_stats` -> scheduler stats -> stat loggers -> `build_prom_metrics`), so they
land in vLLM's Prometheus registry with its `engine`/`model_name` labels. Which series exist
is the line's business (`line.LineMetrics`, `Line.metrics`): `UlaPromMetrics` registers those
of the line recorded for the engine. What travels needs no table: a key with a rank
(`per_rank_gauges`) is a gauge, every other key a counter increment.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from .line import LineMetrics

_AT = "@rank"  # gauges travel per rank (``device_used@rank1``) and are summed over ranks


def per_rank_gauges(gauges: dict, rank: int) -> dict:
    """``gauges`` (a worker's current pool figures) as they travel: one key per gauge and
    rank, so that every rank's latest report stays until it reports again."""
    return {f"{k}{_AT}{rank}": v for k, v in gauges.items()}


@dataclass
class UlaStats(KVConnectorStats):
    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "UlaStats":
        # Counters add up over steps and ranks; a gauge keeps each rank's latest report.
        for k, v in other.data.items():
            if _AT in k:
                self.data[k] = v
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def gauges(self) -> dict[str, int]:
        """Each gauge summed over the ranks that reported it."""
        out: dict[str, int] = {}
        for k, v in self.data.items():
            if _AT in k:
                name = k.split(_AT)[0]
                out[name] = out.get(name, 0) + v
        return out

    def reduce(self) -> dict[str, int | float]:
        out = {k: v for k, v in self.data.items() if _AT not in k}
        out.update(self.gauges())
        return out

    def is_empty(self) -> bool:
        return not self.data


class UlaPromMetrics(KVConnectorPromMetrics):
    """The line's series (``metrics``), one child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues,
                 metrics: LineMetrics):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {k: self._make(self._counter_cls, f"vllm:ulacache_{k}", h)
                         for k, h in metrics.counters.items()}
        self.gauges = {k: self._make(self._gauge_cls, f"vllm:ulacache_{k}", h)
                       for k, h in metrics.gauges.items()}
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
