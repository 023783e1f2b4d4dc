"""Hook: `get_kv_cache_configs` as imported by `vllm.v1.engine.core`.

Under `--kv-backend ulacache` the engine core sizes the KV cache with the product line recorded
for the engine (`engine.lines.recorded_line`, chosen once in the front end): the line's
sizing returns `UlaKVCacheConfig`s carrying its layout to the scheduler and the workers, and
the layout's summary is the startup line. Other backends pass through.
"""
from __future__ import annotations

from ._hook import replace, resolve

HOOK = "kv_cache_sizing"
MODULE = "vllm.v1.engine.core"


def get_kv_cache_configs(orig, vllm_config, kv_cache_specs, available_memory):
    """The hook, given vLLM's original."""
    from ulacache_vllm.engine.lines import recorded_line

    line = recorded_line(vllm_config)
    if line is None:
        return orig(vllm_config, kv_cache_specs, available_memory)
    from vllm.logger import init_logger

    from ulacache_vllm.engine import config as ula_config

    settings = ula_config.settings_from_additional_config(vllm_config.additional_config)
    configs = line.get_kv_cache_configs(orig, vllm_config, kv_cache_specs, available_memory,
                                        settings)
    init_logger("vllm.ulacache").info(
        configs[0].layout.summary(vllm_config.model_config.max_model_len))
    return configs


def apply() -> None:
    _, orig = resolve(MODULE, "get_kv_cache_configs", HOOK)
    orig = getattr(orig, "__ulacache_original__", orig)

    def hook(vllm_config, kv_cache_specs, available_memory):
        return get_kv_cache_configs(orig, vllm_config, kv_cache_specs, available_memory)

    replace(MODULE, "get_kv_cache_configs", hook, HOOK)
