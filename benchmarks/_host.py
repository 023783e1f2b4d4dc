"""What host a benchmark ran on, for its result file: the CPU, whether vLLM's CPU build takes
its AMX MLA path here, and (for engine runs) the scheduler and cache choices the engine ran
with. vLLM's CPU build differs by host (README, "CPU hosts"), so figures name their path."""
from __future__ import annotations

import os
import platform


def cpu_host() -> dict:
    """The CPU and vLLM's MLA path on it (no vLLM import)."""
    flags, model = set(), platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
                elif line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    amx = "amx_tile" in flags
    return {"cpu": model or platform.machine(), "cores": os.cpu_count(), "amx_tile": amx,
            "avx512_bf16": "avx512_bf16" in flags,
            "mla_path": "amx" if amx else "reference"}


def engine_path(llm, usage: dict | None = None) -> dict:
    """The path one engine ran on: its host, block size, chunked prefill, prefix caching and
    max_num_batched_tokens (ulacache's lowered value when it lowered vLLM's default; the
    engine core's scheduler runs that one). ``usage``: a ulacache_usage() dict, if any."""
    cfg = llm.llm_engine.vllm_config
    sc, cc = cfg.scheduler_config, cfg.cache_config
    out = {**cpu_host(), "block_size": cc.block_size,
           "chunked_prefill": bool(sc.enable_chunked_prefill),
           "prefix_caching": bool(cc.enable_prefix_caching),
           "max_num_batched_tokens": sc.max_num_batched_tokens}
    lowered = (usage or {}).get("batch_tokens_lowered")
    if lowered:
        out["max_num_batched_tokens"] = lowered[1]
        out["max_num_batched_tokens_default"] = lowered[0]
    if usage and usage.get("block_size"):
        out["block_size"] = usage["block_size"]
    return out
