"""The DSA line's worker half on CUDA (experimental): builds `CudaRows` over the engine's
sparse-MLA layers, installs their KV caches (``[staging | pool]`` views) and registers each
impl, publishes the rows to the slot-mapping hook, and runs `CudaRows.begin_step` in the
connector's pre-forward hook (outside any CUDA graph: in FULL decode mode vLLM calls it before
``run_fullgraph``).

Staging size (`cuda.staging_rows`): a decode step's worst case, min(max_num_seqs x (1 +
speculative tokens) x top-k, host rows), in whole blocks, so decode (and its CUDA graphs) runs
in one piece; a larger layer call (prefill, mixed) runs in token chunks of S // top-k tokens
(`CudaRows.chunks`), so staging no longer scales with max_num_batched_tokens.
``ULACACHE_CUDA_STAGING_ROWS`` replaces the default; below one token's selections (min(top-k,
host rows)), or for a model without ``index_topk``, it is refused at build. Staging overflow
would read -1 for the rest of a call (wrong attention), so it is refused twice more: each
resolve whose shape could overflow raises (`CudaRows.resolve_stage`, a shape check), and a
nonzero overflow count in the kernels' miss logs raises at the next step
(`CudaRows.begin_step`), ending the engine. The device bytes the rows take besides the device
pools (staging, miss logs, claim table, ...: `cuda.device_extra_bytes`) are taken out of the KV
budget by dsa/sizing.py with the same functions, and logged here.
Connector stats (`stats`, vLLM's ``get_kv_connector_stats`` after the forward): promotions,
deferred promotions, demotions, bytes moved, fallback chunks and the pool gauges, as on the
CPU path and on the same schedule, from host counters `CudaRows.begin_step` already keeps (no
device read of their own).
Not reported: lookups and device hits (the resolve counts host misses only, so no hit rate).
Not covered: TP shard mode, MTP draft layers, prefix-hit counting, lost-block reporting
(copies are device ops; a failure raises).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

from ...line import LineWorker
from ...metrics import UlaStats, per_rank_gauges
from ..worker import STATS_EVERY
from . import CLAIM_BYTES, STAGING_ENV, decode_tokens, device_extra_bytes, staging_rows
from .runtime import CudaRows

__all__ = ["STAGING_ENV", "CudaDsaWorker", "layer_groups"]

if TYPE_CHECKING:
    from ..layout import DsaLayout

logger = init_logger("vllm.ulacache.dsa.cuda")
STAT_COUNTERS = ("promotions", "demotions", "bytes_moved", "fallback_chunks", "deferred")


def layer_groups(layout: "DsaLayout") -> list[list[str]]:
    groups: list[list[str]] = []
    for name in layout.mla_layers:
        if name in layout.leaders or not groups:
            groups.append([])
        groups[-1].append(name)
    return groups


class CudaDsaWorker(LineWorker):
    def __init__(self, rows: CudaRows, layout: "DsaLayout"):
        self.rows, self.layout = rows, layout
        self.step = 0
        self._reported = {k: 0 for k in STAT_COUNTERS}  # counters as of the last report
        self._last_report, self._last_pools = 0, None

    @classmethod
    def build(cls, layout: "DsaLayout", vllm_config, settings, kv_caches: dict):
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
                        staging_rows=staging_rows(decode_tokens(vllm_config), topk,
                                                  layout.host_slots, layout.block_size),
                        num_logical=layout.num_blocks * layout.block_size,
                        max_tokens=max_tokens, device=device, lru=settings.lru,
                        promote_after=settings.promote_after)
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
        L = len(layout.mla_layers)
        extra = device_extra_bytes(rows.S, rows.row_bytes, L, len(rows.groups), max_tokens)
        claim = CLAIM_BYTES * layout.num_logical if rows.state.claim.numel() > 1 else 0
        logger.warning("ulacache CUDA glue (EXPERIMENTAL, never verified end to end on a "
                       "GPU): %d layers, device %d / host %d rows per layer (device pools "
                       "%.1f MiB); staging %d rows (%.1f MiB; %.1f MiB with the miss logs and "
                       "write buffers), resolve claim table %.1f MiB, all in the KV budget; "
                       "a %d-token layer call runs in chunks of %d tokens",
                       L, rows.P, rows.H, rows.P * rows.row_bytes * L / 2**20, rows.S,
                       rows.S * rows.row_bytes / 2**20, extra / 2**20, claim / 2**20,
                       max_tokens, min(max_tokens, rows.chunk_tokens(max_tokens, topk)))
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
        moved = (delta["promotions"] or delta["demotions"] or delta["deferred"]
                 or pools != self._last_pools)
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
