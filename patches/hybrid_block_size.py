"""Hook: `CpuPlatform.update_block_size_for_backend` (platforms/cpu.py).

For hybrid GDN/mamba models vLLM's CPU platform inflates the attention block until one
attention page is as large as a recurrent-state page (640-1152 tokens) and pads the state page
to it (`_align_hybrid_block_size`). Under `--kv-backend ulacache` the arena stores every kind
at its natural page size, so this alignment is skipped; every other model and backend keeps
vLLM's behaviour.
"""
from __future__ import annotations

from ._hook import replace, resolve

HOOK = "hybrid_block_size"
MODULE = "vllm.platforms.cpu"


def apply() -> None:
    owner, orig = resolve(MODULE, "CpuPlatform.update_block_size_for_backend", HOOK)
    orig_fn = orig.__func__  # a classmethod

    def update_block_size_for_backend(cls, vllm_config) -> None:
        from ulacache_vllm.engine.config import is_arena_config

        if is_arena_config(vllm_config):
            return
        return orig_fn(cls, vllm_config)

    replace(MODULE, "CpuPlatform.update_block_size_for_backend",
            classmethod(update_block_size_for_backend), HOOK)
