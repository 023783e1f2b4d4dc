"""Triton resolve / stage / write translation: the semantics, the row convention and the
state are ``resolve_reference``'s (its module doc); same signatures.

Device-agnostic Triton (CUDA compiled, or the interpreter on CPU with ``TRITON_INTERPRET=1``).
Every launch has a grid fixed by the shapes; dynamic values (round, token count, identity
flag, miss count, call stamp) are read from device tensors inside the kernels, so a CUDA graph
can capture a call and replay it with new tables.

resolve: two launches. (1) Per (t, k): the table read, the label touch of device hits, and for
host misses the dedup: ``atomic_xchg(claim[a], stamp)`` returns a different stamp to exactly
one claimant of ``a`` in this call (the stamp is bumped per call, on the device, so the claim
table is never cleared); a program's claimants take consecutive staging rows from one
``atomic_add`` on ``log.counts[0]`` (ranked by a prefix sum), each records its row in
``state.staged[a]`` and logs the miss; every miss's row is left PENDING. (2) PENDING rows
read ``state.staged[a]`` (visible: a launch boundary later).
stage: a persistent grid of programs loops over the ``min(counts[0], S)`` logged rows (a
device-read bound), copying each row as words (the widest of 8/4/2/1 bytes dividing the row
size and the alignment).

Import lazily: ``triton.jit`` decides compiled vs interpreted at decoration time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import SLOT_BITS
from .resolve_reference import (PENDING, TIER_DEVICE, TIER_HOST, MissLog, ResolveState,
                                _check_stage, check_rows)

__all__ = ["MissLog", "ResolveState", "resolve", "stage", "write_translate"]

_BLOCK = 1024


@triton.jit
def _resolve_kernel(logical_ptr, table_ptr, labels_ptr, round_ptr, ntok_ptr, ident_ptr,
                    claim_ptr, staged_ptr, stamp_ptr, counts_ptr, log_addr_ptr, log_host_ptr,
                    rows_ptr, n, K, S, dev_base,
                    HAS_NTOK: tl.constexpr, HAS_IDENT: tl.constexpr, TOUCH: tl.constexpr,
                    SLOT_SHIFT: tl.constexpr, T_DEV: tl.constexpr,
                    T_HOST: tl.constexpr, PEND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(logical_ptr + offs, mask=m, other=-1).to(tl.int64)
    valid = m & (a >= 0)
    if HAS_NTOK:
        valid = valid & ((offs // K) < tl.load(ntok_ptr))
    nid = valid
    if HAS_IDENT:
        # (a vector: the interpreter rejects masks mixing a scalar into a block)
        ident = tl.zeros((BLOCK,), tl.int32) + tl.load(ident_ptr).to(tl.int32)
        nid = valid & (ident == 0)
    v = tl.load(table_ptr + a, mask=nid, other=-1)
    tier = v >> SLOT_SHIFT
    slot = v - (tier << SLOT_SHIFT)  # v & SLOT_MASK for the v >= 0 used (no 32-bit constant)
    mapped = v >= 0
    hit = nid & mapped & (tier == T_DEV)
    miss = nid & mapped & (tier == T_HOST)
    unm = nid & (v < 0)
    if TOUCH:
        rnd = tl.zeros((BLOCK,), tl.int64) + tl.load(round_ptr).to(tl.int64)
        tl.store(labels_ptr + slot, rnd.to(labels_ptr.dtype.element_ty), mask=hit)
    stamp = tl.zeros((BLOCK,), tl.int64) + tl.load(stamp_ptr)
    old = tl.atomic_xchg(claim_ptr + a, stamp, mask=miss)
    win = miss & (old != stamp)
    # Staging rows: one atomic per program for its claimants, ranked inside in flat order.
    w = win.to(tl.int32)
    base = tl.atomic_add(counts_ptr, tl.sum(w, axis=0))
    r = base + tl.cumsum(w, axis=0) - w
    fits = r < S
    tl.store(staged_ptr + a, tl.where(fits, r, -1), mask=win)
    tl.store(log_addr_ptr + r, a, mask=win & fits)
    tl.store(log_host_ptr + r, slot, mask=win & fits)
    n_unm = tl.sum(unm.to(tl.int32), axis=0)
    tl.atomic_add(counts_ptr + 1, n_unm, mask=n_unm > 0)
    neg = tl.full((BLOCK,), -1, tl.int64)
    rows = tl.where(hit, dev_base + slot, tl.where(miss, tl.full((BLOCK,), PEND, tl.int64), neg))
    if HAS_IDENT:
        rows = tl.where(ident != 0, tl.where(valid, dev_base + a, neg), rows)
    tl.store(rows_ptr + offs, rows.to(tl.int32), mask=m)


@triton.jit
def _resolve_fixup_kernel(logical_ptr, staged_ptr, rows_ptr, n, PEND: tl.constexpr,
                          BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    row = tl.load(rows_ptr + offs, mask=m, other=-1)
    pend = m & (row == PEND)
    a = tl.load(logical_ptr + offs, mask=pend, other=0).to(tl.int64)
    r = tl.load(staged_ptr + a, mask=pend, other=-1)
    tl.store(rows_ptr + offs, r, mask=pend)


def resolve(logical: torch.Tensor, table: torch.Tensor, labels: torch.Tensor | None,
            round_t: torch.Tensor | None, num_tokens: torch.Tensor | None,
            identity: torch.Tensor | None, state: ResolveState, *, dev_base: int,
            log: MissLog | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    log = state.log if log is None else log
    S = log.capacity
    check_rows(dev_base, S, labels, round_t)
    if state.claim.numel() < table.numel():
        raise ValueError("ResolveState has no claim table for this table (build it with "
                         "for_triton=True and num_logical >= the table's size)")
    T, K = logical.shape
    n = T * K
    logical = logical.contiguous()
    rows = out if out is not None else torch.empty((T, K), dtype=torch.int32,
                                                   device=logical.device)
    if rows.dtype != torch.int32 or not rows.is_contiguous():
        raise ValueError("out must be a contiguous int32 tensor")
    # Per call, on the device (captured with the kernels): a new stamp, an empty log.
    state.stamp.add_(1)
    log.counts.zero_()
    if n == 0:
        return rows
    dummy = state.stamp
    grid = (triton.cdiv(n, _BLOCK),)
    _resolve_kernel[grid](
        logical, table, labels if labels is not None else dummy,
        round_t if round_t is not None else dummy,
        num_tokens if num_tokens is not None else dummy,
        identity if identity is not None else dummy,
        state.claim, state.staged, state.stamp, log.counts, log.addr, log.host, rows,
        n, K, S, dev_base,
        HAS_NTOK=num_tokens is not None, HAS_IDENT=identity is not None,
        TOUCH=labels is not None, SLOT_SHIFT=SLOT_BITS, T_DEV=TIER_DEVICE,
        T_HOST=TIER_HOST, PEND=PENDING, BLOCK=_BLOCK)
    _resolve_fixup_kernel[grid](logical, state.staged, rows, n, PEND=PENDING, BLOCK=_BLOCK)
    return rows


@triton.jit
def _stage_kernel(src_ptr, dst_ptr, host_ptr, counts_ptr, S, W, src_stride, dst_stride,
                  NPROG: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cnt = tl.minimum(tl.load(counts_ptr), S)
    offs = tl.arange(0, BLOCK)
    for r in range(pid, cnt, NPROG):
        h = tl.load(host_ptr + r)  # int64: the byte offset of a host row may pass 2**31
        for w0 in range(0, W, BLOCK):
            o = w0 + offs
            mw = o < W
            vals = tl.load(src_ptr + h * src_stride + o, mask=mw)
            tl.store(dst_ptr + r * dst_stride + o, vals, mask=mw)


def _word_view(*ts: torch.Tensor):
    """The tensors as rows of the widest word (8/4/2/1 bytes) their sizes, strides and
    addresses allow (a reinterpretation: bytes unchanged)."""
    for dt in (torch.int64, torch.int32, torch.int16):
        w = dt.itemsize
        if all(t.stride(1) == 1 and t.shape[1] % w == 0 and t.stride(0) % w == 0
               and t.data_ptr() % w == 0 for t in ts):
            return [t.view(dt) for t in ts]
    return list(ts)


def stage(host_pool: torch.Tensor, staging: torch.Tensor, log: MissLog) -> None:
    S = log.capacity
    _check_stage(host_pool, staging, S)
    if staging.shape[1] == 0:
        return
    if S * staging.stride(0) >= 2**31:
        raise ValueError("staging must hold fewer than 2**31 bytes")
    src, dst = _word_view(host_pool, staging)
    W = src.shape[1]
    block = min(triton.next_power_of_2(W), 1024)
    nprog = min(S, 4 if not staging.is_cuda else 1024)
    _stage_kernel[(nprog,)](src, dst, log.host, log.counts, S, W, src.stride(0), dst.stride(0),
                            NPROG=nprog, BLOCK=block)


@triton.jit
def _write_translate_kernel(slots_ptr, table_ptr, ident_ptr, err_ptr, out_ptr, n, dev_base,
                            trash, HAS_IDENT: tl.constexpr, HAS_ERR: tl.constexpr,
                            SLOT_SHIFT: tl.constexpr, T_DEV: tl.constexpr,
                            BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(slots_ptr + offs, mask=m, other=-1).to(tl.int64)
    valid = m & (a >= 0)
    nid = valid
    if HAS_IDENT:
        # (a vector: the interpreter rejects masks mixing a scalar into a block)
        ident = tl.zeros((BLOCK,), tl.int32) + tl.load(ident_ptr).to(tl.int32)
        nid = valid & (ident == 0)
    v = tl.load(table_ptr + a, mask=nid, other=-1)
    on_dev = nid & (v >= 0) & ((v >> SLOT_SHIFT) == T_DEV)  # tier 0: v is the slot
    rows = tl.where(on_dev, dev_base + v, tl.zeros((BLOCK,), tl.int64) + trash)
    if HAS_IDENT:
        rows = tl.where(valid & (ident != 0), dev_base + a, rows)
    tl.store(out_ptr + offs, rows, mask=m)
    if HAS_ERR:
        bad = tl.sum((nid & ~on_dev).to(tl.int32), axis=0)
        tl.atomic_add(err_ptr, bad.to(err_ptr.dtype.element_ty), mask=bad > 0)


def write_translate(new_slots: torch.Tensor, table: torch.Tensor,
                    identity: torch.Tensor | None, *, dev_base: int, trash_row: int,
                    errors: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    slots = new_slots.contiguous()
    n = slots.numel()
    rows = out if out is not None else torch.empty(slots.shape, dtype=torch.int64,
                                                   device=slots.device)
    if rows.dtype != torch.int64 or not rows.is_contiguous():
        raise ValueError("out must be a contiguous int64 tensor")
    if n == 0:
        return rows
    dummy = table
    _write_translate_kernel[(triton.cdiv(n, _BLOCK),)](
        slots, table, identity if identity is not None else dummy,
        errors if errors is not None else dummy, rows, n, dev_base, trash_row,
        HAS_IDENT=identity is not None, HAS_ERR=errors is not None, SLOT_SHIFT=SLOT_BITS,
        T_DEV=TIER_DEVICE, BLOCK=_BLOCK)
    return rows
