"""Hook: `DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler`
(models/deepseek_v4/cpu/cpu_mla.py), a vLLM 0.32.0 bug that stops stock DeepSeek-V4's first
step on the CPU build.

The shared SWA builder (`DeepseekSparseSWAMetadataBuilder.build` and its draft-decode update,
v1/attention/backends/mla/sparse_swa.py) reads a tile-scheduler entry for all five layer types
(`swaonly`, `c4a`, `c128a`, `c1a`, `c2a`), but the CPU builder's override returns only the
first three: `KeyError: 'c1a'`. The CPU never runs FlashMLA's tile-scheduler planner, so every
entry is None, as the shared builder's own CPU branch returns; the fix adds the missing ones.
Only the CPU builder is touched (it exists only on the CPU path), and only once V4's CPU package
is imported (a post-import hook; a process that never loads V4 never imports it).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from ._hook import VllmHookError, check_vllm_version, replace, resolve

HOOK = "v4_tile_scheduler"
MODULE = "vllm.models.deepseek_v4.cpu.cpu_mla"
SHARED = "vllm.v1.attention.backends.mla.sparse_swa"
LAYER_TYPES = ("_LAYER_TYPE_SWAONLY", "_LAYER_TYPE_C4A", "_LAYER_TYPE_C128A",
               "_LAYER_TYPE_C1A", "_LAYER_TYPE_C2A")


def layer_types() -> tuple[str, ...]:
    """The keys the shared builder reads (failing loudly if they moved)."""
    return tuple(resolve(SHARED, name, HOOK)[1] for name in LAYER_TYPES)


def patch() -> None:
    """Installs the fix on the loaded CPU builder (idempotent)."""
    keys = layer_types()
    import vllm.v1.attention.backends.mla.sparse_swa as swa

    # With no decode tokens the shared builder returns its all-None plan without reading self.
    shared = swa.DeepseekSparseSWAMetadataBuilder.build_tile_scheduler
    if set(shared(None, 0)) != set(keys):
        raise VllmHookError(f"ulacache patch '{HOOK}': the shared SWA builder's tile "
                            f"scheduler no longer returns the keys {keys}")
    _, orig = resolve(MODULE, "DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler", HOOK)
    if getattr(orig, "__ulacache_patch__", None) == HOOK:
        return

    def build_tile_scheduler(self, num_decode_tokens: int):
        sched = dict(orig(self, num_decode_tokens))
        for key in keys:
            sched.setdefault(key, None)
        return sched

    replace(MODULE, "DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler",
            build_tile_scheduler, HOOK)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `patch()` right after MODULE's body ran: importing V4's CPU package costs about a
    second, so a process that never loads V4 never pays it."""

    def find_spec(self, fullname, path, target=None):
        if fullname != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            patch()

        spec.loader.exec_module = exec_then_patch
        return spec


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    check_vllm_version(HOOK)
    if MODULE in sys.modules:
        patch()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
