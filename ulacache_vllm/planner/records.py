"""The planner's records, at the bottom of its modules (`budget`, `assumptions` and
`capacity` read them; nothing here imports them): the cluster a plan is for (`Cluster`), the
plan (`Plan`) and its rows per KV scheme (`Row`, keyed by `VLLM_KEYS` and `ULA_KEYS`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .model import ModelShape


@dataclass
class Cluster:
    name: str
    gpus: int
    tp: int
    dp: int
    gpu_gib: float
    host_gib_per_gpu: float
    gpus_per_node: int = 8
    gpu_util: float = 0.9
    activation_reserve_gib: float = 10.0
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    batch_tokens_defaulted: bool = True  # left to vLLM's default (ulacache may lower it)
    chunked_prefill: bool = True
    kv_bytes_per_gpu: int | None = None  # given directly instead of derived from memory
    notes: tuple[str, ...] = ()


@dataclass
class Row:
    key: str
    label: str
    tokens: int | None = None  # KV tokens one engine holds (at this request length)
    requests: int | None = None  # concurrent requests one engine holds
    cluster_requests: int | None = None
    device_bytes: int = 0  # per GPU
    host_bytes: int = 0  # per GPU, host memory the scheme uses
    note: str = ""
    error: str | None = None
    layout: Any = None  # the engine's UlaLayout for ulacache rows
    host_pool_gib: float | None = None  # ulacache rows: the --ula-host-pool-gib used
    tp: int | None = None  # the engines this row deploys: TP ranks each, DP of them
    dp: int | None = None


@dataclass
class Plan:
    model: ModelShape
    cluster: Cluster
    request_tokens: int
    kv_dtype: str
    block_size: int
    weights_per_gpu: float
    kv_budget: int  # device bytes per GPU for KV
    rows: list[Row] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    ula_host_pool_gib: float | None = None  # given; else the largest that starts
    dp_engines: Plan | None = None  # DSA: the same GPUs as DP engines of TP 1 (its budget)
    extra: Any = None  # DeepSeek-V4: the per-kind figures (`v4.V4Detail`)

    def row(self, key: str) -> Row:
        return next(r for r in self.rows if r.key == key)

    @property
    def base_key(self) -> str:
        """Stock vLLM without a host tier on the cluster's own engines (DP engines at TP 1)."""
        if self.model.kind not in ("dsa", "v4"):
            return "hma_stock"
        return "stock" if self.row("stock").error is None else "stock_dp"

    @property
    def anchor_key(self) -> str:
        """The strongest vLLM configuration a user would otherwise pick: the vLLM row (stock
        or HiSparse, on TP or DP engines) holding the most requests cluster-wide; ties go to
        the later row (HiSparse over stock, DP engines last)."""
        best = None
        for r in self.rows:
            if r.key in VLLM_KEYS and r.cluster_requests is not None and (
                    best is None or r.cluster_requests >= best.cluster_requests):
                best = r
        return best.key if best is not None else self.base_key

    def gain(self, key: str, base: str | None = None) -> tuple[float | None, int | None]:
        """(ratio, extra requests) of row ``key`` over ``base`` (default: stock), cluster-wide:
        requests that fit, not throughput."""
        a, b = self.row(key).cluster_requests, self.row(base or self.base_key).cluster_requests
        if a is None or b is None:
            return None, None
        return (a / b if b else math.inf), a - b


# Rows of vLLM 0.32 configurations (the anchors), and of ulacache, in table order.
VLLM_KEYS = ("stock", "hisparse_per_rank", "hisparse_shared", "stock_dp", "hisparse_dp",
             "hma_stock")
ULA_KEYS = ("ulacache_replicate", "ulacache_shard", "ulacache_dp", "arena")
