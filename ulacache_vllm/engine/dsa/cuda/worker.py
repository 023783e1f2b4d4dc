"""The DSA line's worker half on CUDA (experimental): builds `CudaRows` over the engine's
sparse-MLA layers, installs their KV caches (``[staging | pool]`` views) and registers each
impl, publishes the rows to the slot-mapping hook, and runs `CudaRows.begin_step` in the
connector's pre-forward hook (outside any CUDA graph: in FULL decode mode vLLM calls it before
``run_fullgraph``).

Staging size: distinct host misses of one layer call are at most the host pool's rows and at
most the step's tokens x top-k (`staging_bound`); that bound, in whole blocks, is the default.
``ULACACHE_CUDA_STAGING_ROWS`` may raise it; a value below the bound (or a model without
``index_topk``, which leaves no bound) is refused at build. Staging overflow would read -1 for
the rest of a call (wrong attention), so it is refused twice more: each layer call whose shape
could overflow raises (`CudaRows.resolve_stage`, a shape check), and a nonzero overflow count
in the kernels' miss logs raises at the next step (`CudaRows.begin_step`), ending the engine.
Connector stats (`stats`, vLLM's ``get_kv_connector_stats`` after the forward): promotions,
demotions, bytes moved, fallback chunks and the pool gauges, as on the CPU path and on the same
schedule, from host counters `CudaRows.begin_step` already keeps (no device read of their own).
Not reported: lookups and device hits (the resolve counts host misses only, so no hit rate).
Not covered: TP shard mode, MTP draft layers, prefix-hit counting, lost-block reporting
(copies are device ops; a failure raises).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

from ...line import LineWorker
from ...metrics import UlaStats, per_rank_gauges
from ..worker import STATS_EVERY
from .runtime import CudaRows

if TYPE_CHECKING:
    from ..sizing import UlaLayout

logger = init_logger("vllm.ulacache.dsa.cuda")
STAGING_ENV = "ULACACHE_CUDA_STAGING_ROWS"
STAT_COUNTERS = ("promotions", "demotions", "bytes_moved", "fallback_chunks")


def staging_bound(layout: "UlaLayout", max_tokens: int, topk: int) -> int:
    """The most distinct host misses one layer call can have: min(tokens x top-k, host rows)."""
    if topk <= 0:
        raise RuntimeError(
            "ulacache (CUDA, experimental): the model config has no index_topk, so the staging "
            "area has no bound (tokens x top-k); only DSA models with index_topk are covered. "
            "Use --kv-backend vllm.")
    return max(1, min(max_tokens * topk, layout.host_slots))


def staging_rows(layout: "UlaLayout", max_tokens: int, topk: int) -> int:
    """Staging rows in whole blocks: the bound, or ``ULACACHE_CUDA_STAGING_ROWS`` if set and
    not below it (below it a layer call could overflow staging: refused, naming the fix)."""
    bound = staging_bound(layout, max_tokens, topk)
    env = os.environ.get(STAGING_ENV, "").strip()
    n = bound
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < bound:
            raise RuntimeError(
                f"ulacache (CUDA, experimental): {STAGING_ENV}={env} is below the staging "
                f"bound of {bound} rows (min(max_num_batched_tokens {max_tokens} x index_topk "
                f"{topk}, host pool rows {layout.host_slots})): a layer call could have more "
                f"distinct host misses than staging rows, and the overflow would read nothing "
                f"(wrong attention). Unset {STAGING_ENV} (the default is the bound) or set it "
                f"to at least {bound}.")
    bs = layout.block_size
    return -(-n // bs) * bs


def layer_groups(layout: "UlaLayout") -> list[list[str]]:
    groups: list[list[str]] = []
    for name in layout.mla_layers:
        if name in layout.leaders or not groups:
            groups.append([])
        groups[-1].append(name)
    return groups


class CudaDsaWorker(LineWorker):
    def __init__(self, rows: CudaRows, layout: "UlaLayout"):
        self.rows, self.layout = rows, layout
        self.step = 0
        self._reported = {k: 0 for k in STAT_COUNTERS}  # counters as of the last report
        self._last_report, self._last_pools = 0, None

    @classmethod
    def build(cls, layout: "UlaLayout", vllm_config, settings, kv_caches: dict):
        from .backend import UlaFlashMLASparseImpl
        from .runtime import ACTIVE

        if layout.shards > 1:
            raise RuntimeError("ulacache (CUDA, experimental) does not support TP shard mode; "
                               "use --ula-tp-mode replicate")
        ctx = vllm_config.compilation_config.static_forward_context
        device = next(iter(kv_caches.values())).device
        widths = set(layout.mla_row_bytes.values())
        if len(widths) != 1:
            raise RuntimeError(f"ulacache (CUDA): one MLA row size expected, got {widths}")
        topk = getattr(vllm_config.model_config.hf_text_config, "index_topk", 0) or 0
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        kv_dtype = torch.uint8 if layout.mla_dtype in ("uint8", "fp8_ds_mla") else getattr(
            torch, layout.mla_dtype)
        rows = CudaRows(layer_groups(layout), row_bytes=widths.pop(),
                        head_size=layout.mla_head_size, kv_dtype=kv_dtype,
                        block_size=layout.block_size, device_slots=layout.device_slots,
                        host_slots=layout.host_slots,
                        staging_rows=staging_rows(layout, max_tokens, topk),
                        num_logical=layout.num_blocks * layout.block_size,
                        max_tokens=max_tokens, device=device, lru=settings.lru)
        for name in layout.mla_layers:
            layer = ctx[name]
            if not isinstance(layer.impl, UlaFlashMLASparseImpl):
                raise RuntimeError(
                    f"ulacache (CUDA, experimental): layer {name} runs "
                    f"{type(layer.impl).__name__}, not UlaFlashMLASparseImpl: the backend hook "
                    "(patches/cuda_sparse_backend.py) did not select it. Is "
                    "ULACACHE_EXPERIMENTAL_CUDA=1 set in the worker processes too?")
            layer.kv_cache = rows.kv_view(name)
            layer.impl.register(rows, name)
        ACTIVE["rows"] = rows
        logger.warning("ulacache CUDA glue (EXPERIMENTAL, never verified end to end on a "
                       "GPU): %d layers, staging %d rows, device %d / host %d rows per layer",
                       len(layout.mla_layers), rows.S, rows.P, rows.H)
        return cls(rows, layout)

    def begin_step(self, step, forward_context) -> None:
        self.step += 1
        freed = None
        if step.freed:
            bs = self.layout.block_size
            b = torch.tensor(step.freed, dtype=torch.int64, device=self.rows.device)
            freed = (b.unsqueeze(1) * bs + torch.arange(bs, device=b.device)).reshape(-1)
        self.rows.begin_step(freed)  # raises on a staging overflow (module doc)

    def stats(self, rank: int):
        # As the CPU path (dsa/worker.py): report when rows moved or pools changed, otherwise
        # every STATS_EVERY steps; counters as deltas since the last report, pools per rank.
        c = self.rows.counters
        delta = {k: c[k] - self._reported[k] for k in STAT_COUNTERS}
        pools = self.usage_pools()
        moved = delta["promotions"] or delta["demotions"] or pools != self._last_pools
        if not moved and self.step - self._last_report < STATS_EVERY:
            return None
        self._reported = {k: c[k] for k in STAT_COUNTERS}
        self._last_report, self._last_pools = self.step, pools
        delta.update(per_rank_gauges(pools, rank))
        return UlaStats(data=delta)

    def usage_pools(self) -> dict:
        n = len(self.rows.mappings)
        return {"device_capacity": self.rows.P * n, "host_capacity": self.rows.H * n,
                "device_used": sum(m.device_used for m in self.rows.mappings),
                "host_used": sum(m.host_used for m in self.rows.mappings)}

    def usage(self) -> dict:
        out = dict(self.usage_pools())
        out["totals"] = dict(self.rows.counters)
        out["step"] = self.step
        out["experimental_cuda"] = True
        out["block_size"] = self.layout.block_size
        return out
