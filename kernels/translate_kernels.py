"""Triton kernel for logical -> physical translation (public packed ``tier<<48|rank<<32|slot``).

Semantics of ``kernels.reference.translate``: -1 padding stays -1, addresses owned by another
rank (``a % world != rank``) give tier REMOTE + owner rank, unmapped entries give -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _translate_kernel(addr_ptr, table_ptr, out_ptr, n, rank, world, rank_bits,
                      BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(addr_ptr + offs, mask=m, other=-1)
    valid = a >= 0
    a0 = tl.where(valid, a, 0)
    owner = a0 % world
    local = valid & (owner == rank)
    v = tl.load(table_ptr + a0 // world, mask=m & local, other=-1)
    mine = ((v >> 32) << 48) | rank_bits | (v & 0xFFFFFFFF)
    mine = tl.where(v >= 0, mine, -1)
    remote = (3 << 48) | (owner << 32)
    out = tl.where(local, mine, remote)
    out = tl.where(valid, out, -1)
    tl.store(out_ptr + offs, out, mask=m)


def translate(addrs: torch.Tensor, table: torch.Tensor, rank: int, world: int,
              pub_rank: int | None = None) -> torch.Tensor:
    pub_rank = rank if pub_rank is None else pub_rank
    addrs = addrs.long()  # the kernel packs in int64 whatever the address width
    n = addrs.numel()
    out = torch.empty(n, dtype=torch.int64, device=addrs.device)
    if n:
        _translate_kernel[(triton.cdiv(n, 256),)](addrs.contiguous(), table, out, n, rank, world,
                                                 pub_rank << 32, BLOCK=256)
    return out.view(addrs.shape)
