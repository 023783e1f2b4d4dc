"""vLLM general-plugin entry point (`vllm.general_plugins`: `ulacache`).

vLLM calls `register()` in every process it starts (API server, engine core, workers), possibly
several times; it is idempotent. It installs the patches in `ulacache_vllm.patches`.
"""
from __future__ import annotations


from vllm.logger import init_logger

logger = init_logger("vllm.ulacache")
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from ulacache_vllm.patches.apply import apply_all

    apply_all()
    _registered = True
    logger.debug("ulacache plugin registered")
