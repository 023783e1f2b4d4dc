"""In-forward resolve / stage / write translation: torch references (CPU path and test oracle)
and the state the Triton versions (``resolve_kernels``) share with them.

The contract (``shared/reference/cuda-notes.md`` sections 2-4): inside the forward (and inside a
CUDA graph) nothing reads the host, every shape is fixed and every dynamic value lives in a
device tensor; the settle (promotion of the logged misses, victims, commits) runs outside the
forward with ``TieredMapping``.

Row convention (one for every function here): rows index a byte-row view
``[staging S | device pool ...]``. Staging row ``r`` is row ``r`` (``0 <= r < S``); device slot
``s`` is row ``dev_base + s`` (``dev_base >= S``; layer ``l`` of a ``[S | P | P | ...]``
buffer passes ``S + l * P``). -1 is "no row" (padding, padded batch tokens, unmapped
selections, staging overflow); attention skips it.

``resolve(logical, table, labels, round_t, num_tokens, identity, state, dev_base=...)``:
logical slots ``[T, K]`` (int32 or int64, -1 padded; each below the table's size) -> rows
``[T, K]`` int32 (FlashMLA's index dtype), through the committed mapping
table (``TieredMapping.visible``: int64, -1 unmapped, else ``tier << 32 | slot``):

* token rows ``t >= num_tokens[0]`` (padded batch) and -1 entries: -1, no touch, no log;
* ``identity[0] != 0`` (fast path, logical slot == device slot): ``dev_base + logical``, no
  table read, no touch, no log;
* device hit: ``dev_base + slot``, and ``labels[slot] = round_t[0]`` (PB-LRU round labels,
  ``labels`` may be None: no touch);
* host miss: a staging row, one per distinct address per call (duplicates share it); the
  address and its host slot are logged in ``log.addr[r]`` / ``log.host[r]``;
  ``log.counts[0]`` counts the distinct misses, so ``max(0, counts[0] - S)`` of them overflowed
  staging (their rows are -1 and they are not logged: size S so that it cannot happen, e.g.
  S = max graph tokens x top-k);
* unmapped selection (value -1 at a valid address): -1, counted in ``log.counts[1]``.

``round_t``, ``num_tokens`` (e.g. ``query_start_loc[-1:]``) and ``identity`` are one-element
device tensors (None: round unused / every token valid / no fast path). ``labels`` is the
PB-LRU's label table (int16) with its dummy last entry (the reference's non-hits write it).
Each call first resets its log's counts and bumps the state's stamp, as device ops (captured
with the kernels); a log is overwritten by the next call that uses it, so a settle that wants
every layer's misses gives each layer its own ``MissLog`` (``log=``) and reads them after the
step's event (``MissLog.take``).

Which staging row a miss gets is unspecified (the Triton kernel takes them by atomic counter;
the reference in order of first occurrence): compare by the bytes each (t, k) reads, the set
of logged misses and the labels touched, not by row numbers.

``stage(host_pool, staging, log)``: ``staging[r] = host_pool[log.host[r]]`` for
``r < min(log.counts[0], S)``. Byte rows (uint8 ``[rows, row_bytes]``), so bf16 (1152 B) and
fp8_ds_mla (656 B) rows move verbatim. On CUDA ``host_pool`` is a CUDA-device view of pinned
host memory (``uva.host_view``): the kernel reads host memory over the bus, no host code runs.
On CPU it is the host tensor itself.

``write_translate(new_slots, table, identity, dev_base=, trash_row=)``: the step's new logical
slots -> rows of the same view (int64, what vLLM's write kernels take): ``dev_base + slot`` of
a device entry (``identity``: ``dev_base + logical``); -1 padding -> ``trash_row``; an entry
not on the device (a contract breach: ``assign`` puts new entries there) -> ``trash_row`` and
counted in ``errors[0]`` if given.

The Triton resolve's dedup needs per-address scratch (``ResolveState``: a claim table of call
stamps and each claimed address's staging row; 12 B per logical address, allocated only for
the Triton path); the reference sorts instead. Both are fixed-shape: the reference captures in
a CUDA graph too (as the eager oracle it need not).
"""
from __future__ import annotations

import torch

from .dispatch import use_triton
from .reference import SLOT_BITS, SLOT_MASK

TIER_DEVICE, TIER_HOST = 0, 1  # == core.mapping.DEVICE / HOST (the kernels cannot import core)
PENDING = -2  # internal to the Triton resolve: a miss whose staging row the second pass fills


class MissLog:
    """One resolve call's misses: ``addr``/``host`` (int64 ``[S]``, the first
    ``min(counts[0], S)`` valid) and ``counts`` (int32 ``[2]``: distinct misses claimed,
    overflow included; unmapped selections). ``S`` is the staging capacity."""

    def __init__(self, capacity: int, device):
        if capacity < 1:
            raise ValueError(f"staging capacity must be >= 1, got {capacity}")
        dev = torch.device(device)
        self.addr = torch.full((capacity,), -1, dtype=torch.int64, device=dev)
        self.host = torch.full((capacity,), -1, dtype=torch.int64, device=dev)
        self.counts = torch.zeros(2, dtype=torch.int32, device=dev)

    @property
    def capacity(self) -> int:
        return self.addr.numel()

    def take(self):
        """Outside the forward (reads the device): ``(addr, host_slots, overflow, unmapped)``
        of the logged misses. Call once the resolve's stream work has completed."""
        claimed, unmapped = (int(x) for x in self.counts.tolist())
        n = min(claimed, self.capacity)
        return self.addr[:n].clone(), self.host[:n].clone(), claimed - n, unmapped


class ResolveState:
    """Per device (shared by the layers that resolve one after another on one stream): the
    call stamp and, for the Triton path, the claim table (``claim[a]``: the stamp of the last
    call that staged address ``a``) and each claimed address's staging row; plus a default
    miss log of ``staging_rows`` entries."""

    def __init__(self, num_logical: int, staging_rows: int, device, *,
                 for_triton: bool | None = None):
        dev = torch.device(device)
        if for_triton is None:
            for_triton = use_triton(torch.empty(0, device=dev))
        self.device = dev
        self.num_logical = num_logical
        self.stamp = torch.zeros(1, dtype=torch.int64, device=dev)
        n = max(1, num_logical) if for_triton else 0
        self.claim = torch.zeros(n, dtype=torch.int64, device=dev)
        self.staged = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self.log = MissLog(staging_rows, dev)

    @property
    def staging_rows(self) -> int:
        return self.log.capacity


def _scalar(t: torch.Tensor | None, like: torch.Tensor, default: int) -> torch.Tensor:
    if t is None:
        return torch.full((), default, dtype=torch.int64, device=like.device)
    return t.reshape(-1)[0].to(torch.int64)


def check_rows(dev_base: int, staging_rows: int, labels=None, round_t=None) -> None:
    if labels is not None and round_t is None:
        raise ValueError("touching labels needs the round (round_t)")
    if dev_base < staging_rows:
        raise ValueError(f"dev_base ({dev_base}) must be >= the staging rows ({staging_rows}): "
                         "staging rows come first in the [staging | device pool] view")


def resolve(logical: torch.Tensor, table: torch.Tensor, labels: torch.Tensor | None,
            round_t: torch.Tensor | None, num_tokens: torch.Tensor | None,
            identity: torch.Tensor | None, state: ResolveState, *, dev_base: int,
            log: MissLog | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference resolve (module doc). Staging rows in order of first occurrence (flat
    ``t * K + k`` order)."""
    log = state.log if log is None else log
    S = log.capacity
    check_rows(dev_base, S, labels, round_t)
    T, K = logical.shape
    n = T * K
    dev = logical.device
    state.stamp.add_(1)  # (the Triton path's dedup key; here it only counts calls)
    a = logical.reshape(-1).to(torch.int64)
    tok = torch.arange(T, device=dev) < _scalar(num_tokens, logical, T)
    valid = tok.repeat_interleave(K) & (a >= 0)
    ident = _scalar(identity, logical, 0) != 0
    v = table.index_select(0, a.clamp(min=0))
    v = torch.where(valid, v, torch.full_like(v, -1))
    tier = v >> SLOT_BITS
    slot = v & SLOT_MASK
    mapped = v >= 0
    hit = mapped & (tier == TIER_DEVICE) & ~ident
    miss = mapped & (tier == TIER_HOST) & ~ident
    unmapped = valid & ~mapped & ~ident
    if labels is not None and n:
        dummy = labels.numel() - 1  # the PB-LRU's dummy label: non-hits write it
        rnd = _scalar(round_t, logical, 0).to(labels.dtype).expand(n)
        labels.scatter_(0, torch.where(hit, slot, torch.full_like(slot, dummy)), rnd)
    # Dedup: sort the missed addresses; the first of each run is its winner (stable: the
    # lowest flat index); winners take staging rows in flat order.
    big = table.numel()
    key = torch.where(miss, a, torch.full_like(a, big))
    sk, order = torch.sort(key, stable=True)
    first = torch.ones_like(miss)
    if n > 1:
        first[1:] = sk[1:] != sk[:-1]
    first &= sk < big
    win = torch.zeros_like(miss).scatter_(0, order, first)
    r = torch.cumsum(win, 0) - 1
    pos = torch.arange(n, device=dev)
    grp = torch.cummax(torch.where(first, pos, torch.zeros_like(pos)), 0).values
    r_flat = torch.empty_like(r).scatter_(0, order, r.index_select(0, order.index_select(0, grp)))
    staged = torch.where(miss & (r_flat < S), r_flat, torch.full_like(r_flat, -1))
    logged = win & (r < S)
    dst = torch.where(logged, r, torch.full_like(r, S))
    for buf, vals in ((log.addr, a), (log.host, slot)):
        tmp = torch.full((S + 1,), -1, dtype=torch.int64, device=dev)
        buf.copy_(tmp.scatter_(0, dst, vals)[:S])
    log.counts.copy_(torch.stack([win.sum(), unmapped.sum()]).to(torch.int32))
    neg = torch.full_like(a, -1)
    rows = torch.where(hit, dev_base + slot, torch.where(miss, staged, neg))
    rows = torch.where(ident, torch.where(valid, dev_base + a, neg), rows)
    rows = rows.to(torch.int32).view(T, K)
    if out is None:
        return rows
    return out.copy_(rows)


def stage(host_pool: torch.Tensor, staging: torch.Tensor, log: MissLog) -> None:
    """Reference stage (module doc): uint8 ``[rows, row_bytes]`` on both sides."""
    S = log.capacity
    _check_stage(host_pool, staging, S)
    if staging.device.type == "cpu":  # no graphs on CPU: read the count, copy only those
        n = min(int(log.counts[0]), S)
        if n:
            staging[:n] = host_pool.index_select(0, log.host[:n])
        return
    n = log.counts[0].to(torch.int64).clamp(max=S)
    m = torch.arange(S, device=staging.device) < n
    idx = torch.where(m, log.host, torch.zeros_like(log.host))
    rows = host_pool.index_select(0, idx)
    staging[:S].copy_(torch.where(m.unsqueeze(1), rows, staging[:S]))


def _check_stage(host_pool: torch.Tensor, staging: torch.Tensor, S: int) -> None:
    if host_pool.dtype != torch.uint8 or staging.dtype != torch.uint8:
        raise TypeError("stage copies byte rows: host_pool and staging must be uint8")
    if host_pool.dim() != 2 or staging.dim() != 2 or host_pool.shape[1] != staging.shape[1]:
        raise ValueError(f"byte rows of one size expected, got {tuple(host_pool.shape)} and "
                         f"{tuple(staging.shape)}")
    if staging.shape[0] < S:
        raise ValueError(f"staging has {staging.shape[0]} rows, the log {S}")
    if host_pool.device != staging.device:
        raise ValueError(f"host_pool on {host_pool.device}, staging on {staging.device}: pass "
                         "the pinned host pool's device view (kernels.host_view)")


def write_translate(new_slots: torch.Tensor, table: torch.Tensor,
                    identity: torch.Tensor | None, *, dev_base: int, trash_row: int,
                    errors: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference write translation (module doc); int64 rows shaped like ``new_slots``."""
    a = new_slots.reshape(-1).to(torch.int64)
    valid = a >= 0
    ident = _scalar(identity, a, 0) != 0
    v = table.index_select(0, a.clamp(min=0))
    on_dev = valid & (v >= 0) & ((v >> SLOT_BITS) == TIER_DEVICE)
    trash = torch.full_like(a, trash_row)
    rows = torch.where(on_dev, dev_base + (v & SLOT_MASK), trash)
    rows = torch.where(ident & valid, dev_base + a, rows).view(new_slots.shape)
    if errors is not None:
        errors.add_((valid & ~on_dev & ~ident).sum().to(errors.dtype))
    if out is None:
        return rows
    return out.copy_(rows)
