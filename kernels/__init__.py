"""Triton kernels with torch reference implementations (importable as ulacache_vllm.kernels).

What the product runs: the round-label PB-LRU's hit detection + touch
(``impl(labels).label_hit_touch``) and the table helpers of ``reference`` (``compact``,
``fill_at``, ``const``). Dispatch: tensors on CUDA use the Triton kernels (``pblru_kernels``);
CPU tensors use ``reference``. ``ULACACHE_FORCE_TRITON=1`` forces Triton for CPU tensors (only
meaningful with ``TRITON_INTERPRET=1``; the tests use it). The Triton module is imported
lazily so that ``TRITON_INTERPRET`` is read when it is first needed. Reading the mapping
table (device and host slots of addresses) is ``core.mapping.TieredMapping.locate``, plain
tensor ops; token placement under TP shard mode is ``core.placement.TokenShard``. (The lab's
queue and bitmap PB-LRU kernels live in ``benchmarks/lab/queue_kernels*.py``.)

The forward's resolve / stage / write translation (``resolve_impl(t)``: ``resolve_kernels`` or
``resolve_reference``, same dispatch; the row convention and contract are in
``resolve_reference``'s doc) and ``host_view`` (``uva``: a device view of a pinned host pool).
TP shard mode (CPU only) plans each layer group's read in one compiled pass
(``shard_cpu``: numba, imported by the store only in shard mode). Nothing here imports
vLLM.
"""

from __future__ import annotations

import importlib

import torch

from . import reference, resolve_reference
from .dispatch import use_triton
from .uva import host_view

__all__ = ["compact", "host_view", "impl", "reference", "resolve_impl", "resolve_reference",
           "use_triton"]


def _mod(name: str):
    return importlib.import_module(f"{__name__}.{name}")


# Boolean compaction: torch on every device (branch-free on large CPU inputs).
compact = reference.compact


def impl(t: torch.Tensor):
    """The round-label PB-LRU's kernel module for tensors like ``t`` (Triton or the reference)."""
    return _mod("pblru_kernels") if use_triton(t) else reference


def resolve_impl(t: torch.Tensor):
    """The resolve / stage / write-translation module for tensors like ``t`` (Triton or the
    reference; same functions and signatures)."""
    return _mod("resolve_kernels") if use_triton(t) else resolve_reference
