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


def apply() -> None:
    _, orig = resolve(MODULE, "EngineCore.__init__", HOOK)

    def __init__(self, vllm_config, *args, **kwargs):
        orig(self, vllm_config, *args, **kwargs)
        if not hasattr(self, "request_block_hasher"):
            from ._hook import VllmHookError

            raise VllmHookError(f"ulacache patch '{HOOK}': EngineCore no longer sets "
                                "request_block_hasher")
        from ulacache_vllm.engine.config import kv_backend_of

        if (kv_backend_of(vllm_config) == "ulacache"
                and not vllm_config.cache_config.enable_prefix_caching):
            self.request_block_hasher = None

    replace(MODULE, "EngineCore.__init__", __init__, HOOK)
