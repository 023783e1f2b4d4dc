"""Which implementation a tensor gets: Triton on CUDA (when Triton is installed), the torch
reference elsewhere; ``ULACACHE_FORCE_TRITON=1`` forces Triton for CPU tensors (meaningful only
under ``TRITON_INTERPRET=1``: the tests use it)."""
from __future__ import annotations

import importlib.util
import os

import torch

_HAS_TRITON = importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    if os.environ.get("ULACACHE_FORCE_TRITON") == "1":
        return True
    return t.is_cuda and _HAS_TRITON
