"""Logical addresses as the mapping tables take them: validation (``as_addresses``) and an
O(n) dedup of a batch (``UniqueAddresses``)."""

from __future__ import annotations

import numpy as np
import torch


def as_addresses(addrs, device: torch.device, num_logical: int, what: str,
                 ignore_out_of_range: bool = False):
    """``(flat, shape)``: logical addresses as a flat int64 tensor on ``device`` and their
    shape; negative values are padding. Addresses past the address space (also unsigned ones
    past int64) raise ``KeyError`` (or, with ``ignore_out_of_range``, become padding);
    non-integers raise ``TypeError``."""
    try:
        t = torch.as_tensor(addrs, device=device)
    except (OverflowError, RuntimeError, ValueError, TypeError) as e:
        if not (isinstance(e, OverflowError) or "overflow" in str(e).lower()):
            raise TypeError(f"{what}: logical addresses must be integers, got "
                            f"{str(addrs)[:60]!r} ({e})") from None
        if not ignore_out_of_range:
            raise KeyError(f"{what}: addresses outside the logical address space [0, "
                           f"{num_logical}) (too large for int64)") from None
        t = _past_int64_as_padding(addrs).to(device)
    if t.numel() == 0 and t.is_floating_point():
        t = t.long()  # torch.as_tensor([]) is float32: an empty list is no addresses
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{what}: logical addresses must be integers, got {t.dtype}")
    shape = t.shape
    wrapped = t.dtype == torch.uint64  # values >= 2**63 turn negative in int64
    t = t.to(torch.int64).reshape(-1)
    if wrapped and t.numel() and bool((t < 0).any()):
        if not ignore_out_of_range:
            raise KeyError(f"{what}: addresses outside the logical address space [0, "
                           f"{num_logical}) (unsigned, past int64)")
        t = t.masked_fill(t < 0, -1)  # past int64: padding, like any address past the space
    if t.numel() and int(t.max()) >= num_logical:
        bad = t >= num_logical
        if ignore_out_of_range:
            return t.masked_fill(bad, -1), shape
        raise KeyError(f"{what}: addresses {t.masked_select(bad)[:8].tolist()} are outside "
                       f"the logical address space [0, {num_logical})")
    return t, shape


def _past_int64_as_padding(addrs) -> torch.Tensor:
    """Python integers outside int64 (only on this rare path) as -1 padding."""
    lo, hi = -(1 << 63), 1 << 63
    keep = np.frompyfunc(lambda x: x if lo <= x < hi else -1, 1, 1)
    return torch.as_tensor(keep(np.asarray(addrs, dtype=object)).astype(np.int64))


class UniqueAddresses:
    """O(n) dedup of addresses in ``[0, n)`` through a claim table (no sort)."""

    def __init__(self, n: int, device: torch.device):
        self._claim = torch.zeros(max(1, n), dtype=torch.int64, device=device)
        self._iota = torch.arange(1024, device=device)

    def __call__(self, sel: torch.Tensor) -> torch.Tensor:
        """The distinct values of ``sel`` (one occurrence of each, in input order)."""
        n = sel.numel()
        if n <= 1:
            return sel
        if self._iota.numel() < n:
            self._iota = torch.arange(max(n, 2 * self._iota.numel()), device=self._iota.device)
        pos = self._iota[:n]
        # Every occurrence writes its position; exactly one write per address survives (the
        # last on CPU, an arbitrary one on CUDA): that occurrence is the one kept. No reset
        # is needed, every address read here was written by this call.
        self._claim.scatter_(0, sel, pos)
        return sel.masked_select(self._claim.index_select(0, sel) == pos)
