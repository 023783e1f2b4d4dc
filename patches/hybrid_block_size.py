"""Hook: `CpuPlatform.update_block_size_for_backend` (platforms/cpu.py).

For hybrid GDN/mamba models vLLM's CPU platform inflates the attention block until one
attention page is as large as a recurrent-state page (640-1152 tokens) and pads the state page
to it (`_align_hybrid_block_size`). Under `--kv-backend ulacache`, a line that stores every
kind at its natural page size (`Line.aligns_hybrid_block_size` false: the arena) skips this
alignment; every other line, model and backend keeps vLLM's behaviour.
"""
from __future__ import annotations

from ._hook import replace, resolve

HOOK = "hybrid_block_size"
MODULE = "vllm.platforms.cpu"


def update_block_size(orig_fn, cls, vllm_config) -> None:
    """The hook, given vLLM's original (the classmethod's function)."""
    from ulacache_vllm.engine.lines import recorded_line

    line = recorded_line(vllm_config)
    if line is not None and not line.aligns_hybrid_block_size:
        return None
    return orig_fn(cls, vllm_config)


def apply() -> None:
    _, orig = resolve(MODULE, "CpuPlatform.update_block_size_for_backend", HOOK)
    orig_fn = getattr(orig, "__ulacache_original__", orig).__func__  # a classmethod

    def update_block_size_for_backend(cls, vllm_config) -> None:
        return update_block_size(orig_fn, cls, vllm_config)

    replace(MODULE, "CpuPlatform.update_block_size_for_backend",
            classmethod(update_block_size_for_backend), HOOK)
