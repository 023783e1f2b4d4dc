"""Triton kernels with torch reference implementations (importable as ulacache_vllm.kernels).

Dispatch: tensors on CUDA use the Triton kernels (``pblru_kernels``, ``translate_kernels``; not ``translate.py``: a submodule of that name would shadow the ``translate`` function); CPU
tensors use ``reference``. ``ULACACHE_FORCE_TRITON=1`` forces Triton for CPU tensors (only
meaningful with ``TRITON_INTERPRET=1``; the tests use it). The Triton modules are imported
lazily so that ``TRITON_INTERPRET`` is read when they are first needed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

from . import reference

__all__ = ["use_triton", "impl", "popcount64", "expand_first_k", "queue_push", "queue_take", "hit_touch_push", "translate", "compact", "reference"]


_HAS_TRITON = importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    if os.environ.get("ULACACHE_FORCE_TRITON") == "1":
        return True
    return t.is_cuda and _HAS_TRITON


def _mod(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def popcount64(words):
    return (_mod("pblru_kernels") if use_triton(words) else reference).popcount64(words)


def expand_first_k(words, k: int):
    return (_mod("pblru_kernels") if use_triton(words) else reference).expand_first_k(words, k)


# Boolean compaction: torch on every device (branch-free on large CPU inputs).
compact = reference.compact


def impl(t: torch.Tensor):
    """The kernel module used for tensors like ``t`` (Triton or the torch reference)."""
    return _mod("pblru_kernels") if use_triton(t) else reference


def queue_push(slots, qslot, qpos, start: int, pos=None):
    return (_mod("pblru_kernels") if use_triton(qslot) else reference).queue_push(
        slots, qslot, qpos, start, pos)


def hit_touch_push(loc_vals, qslot, qpos, start: int, iota):
    return (_mod("pblru_kernels") if use_triton(qslot) else reference).hit_touch_push(
        loc_vals, qslot, qpos, start, iota)


def queue_take(wslots, wpos, qpos, k: int):
    return (_mod("pblru_kernels") if use_triton(qpos) else reference).queue_take(
        wslots, wpos, qpos, k)


def translate(addrs, table, rank: int, world: int, pub_rank: int | None = None):
    return (_mod("translate_kernels") if use_triton(addrs) else reference).translate(
        addrs, table, rank, world, pub_rank)
