"""Hook: `CpuPlatform.check_and_update_config` (platforms/cpu.py), for the MLA models that run
a line's CPU sparse-attention support on vLLM's CPU build (`Line.cpu_sparse_attention`: the
DSA models of the V3.2 generation), whatever the KV backend (the explicit requests come from
`engine_config.py`'s `EngineArgs` hook). Every other model (dense MLA, DeepSeek-V4 with its
forced block size of 256, any other) keeps exactly what vLLM's platform hook decided.

vLLM's CPU build picks an MLA path by host: on x86 CPUs with AMX tiles (`amx_mla_enabled`)
chunked prefill and prefix caching stay on and the block size defaults to 128; elsewhere the
reference `CPU_MLA` kernel's limits are applied to every MLA model (block size forced to 16,
chunked prefill and prefix caching forced off, `max_num_batched_tokens = max(max_model_len,
2048)`). DSA models never run that kernel: they run ulacache's CPU sparse-MLA backend and
indexer (`cpu_sparse_attention.py`), which take any block size that is a multiple of 16,
chunked prefill and prefill over a cached prefix. So for these models the reference rules only
override what the user left to defaults: an explicit `enable_chunked_prefill=True` (with its
`max_num_batched_tokens`), `enable_prefix_caching=True` or `block_size` (a multiple of 16) is
kept. That makes each host's path reproducible on the other: on an AMX host
`enable_chunked_prefill=False, block_size=16, max_num_batched_tokens=max(max_model_len, 2048)`
is the reference path's schedule; on any host `enable_chunked_prefill=True, block_size=128` is
the AMX path's. Defaults are vLLM's own, untouched. CPU-only; other platforms pass through.
"""
from __future__ import annotations

from ._hook import replace

HOOK = "cpu_mla_path"


# Where the explicit requests travel: `additional_config[REQUESTED_KEY]`. The engine core
# re-runs the platform hook on its copy of the config (`VllmConfig.__post_init__`), so the
# requests must travel with the config, not live in the front end's process.
REQUESTED_KEY = "cpu_mla_requested"
REQUESTABLE = ("enable_chunked_prefill", "enable_prefix_caching")


def host_has_amx() -> bool:
    """True where vLLM's CPU build takes its AMX MLA path (x86 with AMX tiles)."""
    import torch

    from vllm.platforms import CpuArchEnum, current_platform

    return (current_platform.is_cpu()
            and current_platform.get_cpu_architecture() == CpuArchEnum.X86
            and bool(torch.cpu._is_amx_tile_supported()))


def runs_line_sparse_backend(model_config) -> bool:
    """An MLA model whose sparse attention runs a line's CPU support (decided by the model,
    whatever the KV backend)."""
    if model_config is None or not model_config.use_mla:
        return False
    from ulacache_vllm.engine.lines import cpu_sparse_attention_for

    return cpu_sparse_attention_for(model_config) is not None


def record_requests(engine_args) -> None:
    """Front end, before the config is built: note the explicit choices the platform hook
    may keep (None means left to vLLM's defaults and is not recorded)."""
    asked = {k: getattr(engine_args, k) for k in REQUESTABLE if getattr(engine_args, k) is not None}
    if asked:
        engine_args.additional_config = {**(engine_args.additional_config or {}),
                                         REQUESTED_KEY: asked}


def keep_explicit_choices(vllm_config, before: dict) -> list[str]:
    """Undo the reference-MLA overrides of what the user (or, for the block size, vLLM's own
    `user_specified_block_size`) asked for explicitly, on a model that runs a line's CPU
    sparse-attention support; returns what was kept, for the log."""
    if not runs_line_sparse_backend(vllm_config.model_config):
        return []
    requested = (vllm_config.additional_config or {}).get(REQUESTED_KEY) or {}
    sc, cc = vllm_config.scheduler_config, vllm_config.cache_config
    kept = []
    if requested.get("enable_chunked_prefill") and not sc.enable_chunked_prefill:
        sc.enable_chunked_prefill = True
        sc.max_num_batched_tokens = before["max_num_batched_tokens"]
        kept.append(f"chunked prefill (max_num_batched_tokens {sc.max_num_batched_tokens})")
    if requested.get("enable_prefix_caching") and not cc.enable_prefix_caching:
        cc.enable_prefix_caching = True
        kept.append("prefix caching")
    bs = before["block_size"]
    if (cc.user_specified_block_size and bs and cc.block_size != bs and bs % 16 == 0):
        cc.block_size = bs
        kept.append(f"block size {bs}")
    return kept


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.platforms.cpu import CpuPlatform

    orig_check = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        sc, cc = vllm_config.scheduler_config, vllm_config.cache_config
        before = dict(max_num_batched_tokens=sc.max_num_batched_tokens, block_size=cc.block_size)
        orig_check(cls, vllm_config)
        kept = keep_explicit_choices(vllm_config, before)
        if kept and not getattr(check_and_update_config, "logged", False):
            check_and_update_config.logged = True
            from vllm.logger import init_logger

            init_logger("vllm.ulacache").info(
                "DSA model on the CPU sparse-MLA backend: keeping the explicitly requested %s "
                "(vLLM's reference CPU_MLA limits do not apply to it)", ", ".join(kept))

    replace("vllm.platforms.cpu", "CpuPlatform.check_and_update_config",
            classmethod(check_and_update_config), HOOK)

