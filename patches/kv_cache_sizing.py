"""Hook: `get_kv_cache_configs` as imported by `vllm.v1.engine.core`.

Under `--kv-backend ulacache` the block pool becomes a logical address space sized to the
device pool plus the host pool, and the sparse-MLA rows move out of vLLM's allocation into
ulacache's own pools (see `ulacache_vllm/engine/dsa/sizing.py`); for hybrid models it becomes the
arena (`ulacache_vllm/engine/arena/sizing.py`). Other backends pass through.
"""
from __future__ import annotations

from ._hook import replace

HOOK = "kv_cache_sizing"
MODULE = "vllm.v1.engine.core"


def apply() -> None:
    import vllm.v1.engine.core as core

    orig = core.get_kv_cache_configs

    def get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory):
        from ulacache_vllm.engine import config as ula_config

        if ula_config.kv_backend_of(vllm_config) != "ulacache":
            return orig(vllm_config, kv_cache_specs, available_memory)
        from ulacache_vllm.engine.dsa import sizing

        from vllm.logger import init_logger

        settings = ula_config.settings_from_additional_config(vllm_config.additional_config)
        if ula_config.is_arena_config(vllm_config):
            from ulacache_vllm.engine.arena import sizing as arena_sizing

            configs = arena_sizing.get_kv_cache_configs(vllm_config, kv_cache_specs,
                                                        available_memory, settings)
            init_logger("vllm.ulacache").info(configs[0].ulacache_arena.summary())
            return configs
        configs = sizing.get_kv_cache_configs(orig, vllm_config, kv_cache_specs,
                                              available_memory, settings)
        init_logger("vllm.ulacache").info(
            configs[0].ulacache_layout.summary(vllm_config.model_config.max_model_len))
        return configs

    replace(MODULE, "get_kv_cache_configs", get_kv_cache_configs, HOOK)
