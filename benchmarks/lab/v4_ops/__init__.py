"""Lab only: DeepSeek-V4's CPU kernels in plain PyTorch, for x86 hosts without AVX512-BF16.

vLLM's V4 CPU path calls sixteen ``torch.ops._C`` kernels that exist only in its
``_C.abi3.so``, loaded on AVX512-BF16 CPUs (``deepseek-v4-notes`` §2.2); on an AVX2 host vLLM
loads ``_C_AVX2`` and ulacache refuses V4 at startup (``patches/v4_cpu_isa``). This package
defines those ops from Python (``torch.library``, the real schemas) with eager
implementations of the kernels' math (``attention``, ``indexer``, ``mhc_router``), so the V4
engine tests and benchmarks can run on such a host: stock vLLM and ulacache both run through
the same emulated ops, which makes it a check of everything around the kernels (the block
tables, slot ids, row views, the scheduler, the tiers), not of the kernels, and not of speed.

Invariants: never imported by the installed package; an op the loaded library already has is
left alone, and on an AVX512-BF16 host (where vLLM loads the real kernels after the boot runs)
the boot installs nothing; installed only where asked
(``ULACACHE_LAB_V4_OPS=1`` through ``boot/sitecustomize.py``, which ``run.py`` puts on every
process's path, vLLM's spawned workers included).
"""
from __future__ import annotations

_LIB = None
INSTALLED: list[str] = []


def all_ops() -> dict:
    from . import attention, indexer, mhc_router

    ops: dict = {}
    for mod in (attention, indexer, mhc_router):
        for name, entry in mod.OPS.items():
            assert name not in ops, f"{name} defined twice"
            ops[name] = entry
    return ops


def install() -> list[str]:
    """Defines every V4 op the loaded ``_C`` lacks; returns the names defined (idempotent)."""
    global _LIB
    import torch

    if _LIB is not None:
        return list(INSTALLED)
    lib = torch.library.Library("_C", "FRAGMENT")
    for name, (schema, fn) in all_ops().items():
        if hasattr(torch.ops._C, name):
            continue
        assert schema.startswith(name + "("), (name, schema)
        lib.define(schema)
        lib.impl(name, fn, "CPU")
        INSTALLED.append(name)
    _LIB = lib
    return list(INSTALLED)
