"""Kinds of state the arena stores: rows per entry, entries per page, which band a kind grows in.

A kind keeps its natural page size (only rounded up to the arena alignment); nothing is padded
to a common page size. A page is a contiguous run of ``entries_per_page`` entries, and an entry
is the concatenation of all its rows (one row per participating layer or row set; rows may
differ in shape and dtype). Within a page, entry ``e`` starts at ``e * entry_bytes`` and its
row ``r`` at ``e * entry_bytes + row_offsets[r]``.
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field

_DTYPE_BYTES = {
    "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "bool": 1,
    "float16": 2, "bfloat16": 2, "int16": 2,
    "float32": 4, "int32": 4, "float64": 8, "int64": 8,
}


def dtype_bytes(dtype: str) -> int:
    """Item size of a dtype given by name ("bfloat16", "torch.float32", ...)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}")
    return _DTYPE_BYTES[name]


class Band(enum.Enum):
    """LOW grows up from byte 0 (window KV, recurrent state); HIGH grows down from the top (full KV)."""

    LOW = "low"
    HIGH = "high"


@dataclass(frozen=True)
class RowSpec:
    """One row of an entry: e.g. one layer's K and V for one token, or one layer's SSM state."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        shape = (self.shape,) if isinstance(self.shape, numbers.Integral) else tuple(self.shape)
        if any(not isinstance(d, numbers.Integral) or isinstance(d, bool) or d < 0 for d in shape):
            raise ValueError(f"row {self.name!r}: shape must be non-negative integers, got {self.shape!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        dtype_bytes(self.dtype)  # an unknown dtype fails here, not at first use

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_bytes(self.dtype)

    @property
    def itemsize(self) -> int:
        return dtype_bytes(self.dtype)


@dataclass(frozen=True)
class KindSpec:
    """A kind of state: its rows, how many entries one page holds, and its band."""

    name: str
    band: Band
    rows: tuple[RowSpec, ...]
    entries_per_page: int = 1
    row_offsets: tuple[int, ...] = field(init=False, repr=False)
    entry_bytes: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError(f"kind {self.name!r} has no rows")
        try:  # Band("low") / Band("high") are accepted as well as the enum
            object.__setattr__(self, "band", Band(self.band))
        except ValueError:
            raise ValueError(f"kind {self.name!r}: band must be Band.LOW or Band.HIGH "
                             f"('low' / 'high'), got {self.band!r}") from None
        object.__setattr__(self, "rows", tuple(self.rows))
        if not isinstance(self.entries_per_page, numbers.Integral) or isinstance(
                self.entries_per_page, bool) or self.entries_per_page < 1:
            raise ValueError(f"kind {self.name!r}: entries_per_page must be an integer >= 1, "
                             f"got {self.entries_per_page!r}")
        offs, off, align = [], 0, 1
        for row in self.rows:
            # Each row starts at a multiple of its own item size so it can be viewed as its dtype.
            off = -(-off // row.itemsize) * row.itemsize
            offs.append(off)
            off += row.nbytes
            align = max(align, row.itemsize)
        if off == 0:  # zero-byte pages would all share one offset
            raise ValueError(f"kind {self.name!r}: its rows hold no bytes")
        object.__setattr__(self, "row_offsets", tuple(offs))
        object.__setattr__(self, "entry_bytes", -(-off // align) * align)

    @property
    def itemsize(self) -> int:
        """The largest item size of its rows: page starts must be multiples of it."""
        return max(r.itemsize for r in self.rows)

    @property
    def natural_page_bytes(self) -> int:
        return self.entry_bytes * self.entries_per_page

    def page_bytes(self, alignment: int) -> int:
        return -(-self.natural_page_bytes // alignment) * alignment

    def row_offset(self, row: str | int, entry: int = 0) -> int:
        """Byte offset of ``row`` of ``entry`` relative to the start of its page."""
        idx = row if isinstance(row, int) else [r.name for r in self.rows].index(row)
        if not 0 <= idx < len(self.rows):  # (a negative row would index from the end)
            raise IndexError(row)
        if not 0 <= entry < self.entries_per_page:
            raise IndexError(entry)
        return entry * self.entry_bytes + self.row_offsets[idx]


def attention_kind(name: str, band: Band, num_layers: int, num_kv_heads: int, head_size: int,
                   tokens_per_page: int, dtype: str = "bfloat16", head_size_v: int | None = None,
                   ) -> KindSpec:
    """Attention KV: one entry per token, one (2, heads, head_size) row per layer."""
    hv = head_size if head_size_v is None else head_size_v
    rows = tuple(RowSpec(f"layer{i}", (num_kv_heads, head_size + hv), dtype)
                 for i in range(num_layers))
    return KindSpec(name, band, rows, tokens_per_page)


def state_kind(name: str, num_layers: int, shapes: tuple[tuple[int, ...], ...],
               dtypes: tuple[str, ...]) -> KindSpec:
    """Recurrent (mamba/GDN) state: one entry per request holding every layer's state tensors."""
    if len(shapes) != len(dtypes):
        raise ValueError(f"state kind {name!r}: {len(shapes)} shapes but {len(dtypes)} dtypes")
    rows = tuple(RowSpec(f"layer{i}.s{j}", shape, dt)
                 for i in range(num_layers) for j, (shape, dt) in enumerate(zip(shapes, dtypes)))
    return KindSpec(name, Band.LOW, rows, 1)
