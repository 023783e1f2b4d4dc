"""Triton kernel of the round-label PB-LRU (``core/pblru.py``): hit detection + touch of the
round labels in one kernel. The PB-LRU's other label ops are the reference's (numpy on CPU,
torch ops elsewhere), re-exported so that ``kernels.impl`` returns one module per device.

Same semantics as ``kernels.reference`` (the CPU path and the oracle). Import lazily:
``triton.jit`` decides compiled vs interpreted (``TRITON_INTERPRET=1``) at decoration time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference

_BLOCK_N = 256


@triton.jit
def _label_hit_touch_kernel(loc_ptr, labels_ptr, hit_ptr, num_slots, rnd, n, BLOCK: tl.constexpr):
    # A hit is a device slot: 0 <= v < num_slots (tier bits 0, and not -1). Unique entries
    # have unique slots: the label stores never race.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(loc_ptr + offs, mask=m, other=-1)
    hit = (v >= 0) & (v < num_slots)
    tl.store(hit_ptr + offs, hit.to(tl.int8), mask=m)
    lab = (tl.zeros((BLOCK,), tl.int32) + rnd).to(labels_ptr.dtype.element_ty)
    tl.store(labels_ptr + v, lab, mask=m & hit)


def label_hit_touch(loc_vals: torch.Tensor, labels: torch.Tensor, num_slots: int, rnd: int,
                    src: torch.Tensor | None = None) -> torch.Tensor:
    """One kernel: hit flags and the label writes (``src`` is the reference's, unused)."""
    n = loc_vals.numel()
    hit = torch.empty(n, dtype=torch.int8, device=loc_vals.device)
    if n:
        _label_hit_touch_kernel[(triton.cdiv(n, _BLOCK_N),)](
            loc_vals.contiguous(), labels, hit, num_slots, rnd, n, BLOCK=_BLOCK_N)
    return hit.bool()


label_members = reference.label_members
label_live = reference.label_live
labels_below = reference.labels_below
stable_argsort = reference.stable_argsort
