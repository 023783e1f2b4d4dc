"""The DSA line's worker half on CUDA (experimental): builds `CudaRows` over the engine's
sparse-MLA layers, installs their KV caches (``[staging | pool]`` views) and registers each
impl, publishes the rows to the slot-mapping hook, and runs `CudaRows.begin_step` in the
connector's pre-forward hook (outside any CUDA graph: in FULL decode mode vLLM calls it before
``run_fullgraph``).

Staging size: distinct host misses of one layer call are at most the host pool's rows and at
most the step's tokens x top-k; ``ULACACHE_CUDA_STAGING_ROWS`` overrides. A call that
overflows staging reads -1 for the rest (wrong attention): counted in ``overflow`` and logged
as an error every step it happens. Not covered: TP shard mode, MTP draft layers, prefix-hit
counting, lost-block reporting (copies are device ops; a failure raises).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

from ...line import LineWorker
from .runtime import CudaRows

if TYPE_CHECKING:
    from ..sizing import UlaLayout

logger = init_logger("vllm.ulacache.dsa.cuda")
STAGING_ENV = "ULACACHE_CUDA_STAGING_ROWS"


def staging_rows(layout: "UlaLayout", max_tokens: int, topk: int) -> int:
    env = os.environ.get(STAGING_ENV)
    n = int(env) if env else min(max(1, max_tokens * topk), max(1, layout.host_slots))
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
        before = self.rows.counters["overflow"]
        self.rows.begin_step(freed)
        if self.rows.counters["overflow"] > before:
            logger.error("ulacache (CUDA): staging overflowed (%d misses read as -1); raise %s",
                         self.rows.counters["overflow"] - before, STAGING_ENV)

    def stats(self, rank: int):
        return None  # counters through the usage RPC only (`usage`)

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
