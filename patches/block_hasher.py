"""Hook: `EngineCore.__init__` (v1/engine/core.py), its `request_block_hasher`.

vLLM hashes every request's full blocks when prefix caching is on *or any KV connector is
configured* (connectors such as LMCache key external KV by those hashes). ulacache's connector
is only the scheduler -> worker channel of its own KV manager and never reads a hash, so
under `--kv-backend ulacache` with prefix caching off the engine hashes nothing, as stock
does (a hash per full block at prefill, and a hasher call per request per step). With
prefix caching on, the hashes are vLLM's, computed as stock computes them.
"""
from __future__ import annotations

from ._hook import replace, resolve

HOOK = "block_hasher"
MODULE = "vllm.v1.engine.core"


def after_init(engine_core, vllm_config) -> None:
    """After vLLM's `EngineCore.__init__`: no hasher under ulacache without prefix caching;
    every other engine keeps vLLM's."""
    if not hasattr(engine_core, "request_block_hasher"):
        from ._hook import VllmHookError

        raise VllmHookError(f"ulacache patch '{HOOK}': EngineCore no longer sets "
                            "request_block_hasher")
    from ulacache_vllm.engine.config import kv_backend_of

    if (kv_backend_of(vllm_config) == "ulacache"
            and not vllm_config.cache_config.enable_prefix_caching):
        engine_core.request_block_hasher = None


def apply() -> None:
    _, orig = resolve(MODULE, "EngineCore.__init__", HOOK)
    orig = getattr(orig, "__ulacache_original__", orig)

    def __init__(self, vllm_config, *args, **kwargs):
        orig(self, vllm_config, *args, **kwargs)
        after_init(self, vllm_config)

    replace(MODULE, "EngineCore.__init__", __init__, HOOK)
