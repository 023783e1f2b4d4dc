"""Concurrent DeepSeek-V4 requests of one length at one rank's KV budget: stock vLLM (its
packed hybrid groups, every block id as wide as the widest group) against ulacache's planned
V4 line, and the physical bound. Plain arithmetic on ``v4_layout`` (no vLLM import).

Two ways to count, the same for both schemes:
- ``steady`` (the headline): the most requests of ``tokens`` that are each admitted and all run
  to their full length: every running request holds its full kinds' pages and its sliding
  kinds' window (``Cache.resident_pages``), and one admission at a time needs its whole capped
  demand free (``Cache.admission_pages``: window - 1 + the in-flight tokens of a prefill for
  sliding kinds): ``N = 1 + (pool - admission) / resident`` (the form of vLLM 0.32's HiSparse
  steady-state concurrency). vLLM's scheduler and ulacache's arena admit by that gate
  (``scheduler_reserve_full_isl``) and free out-of-window pages as requests run.
- ``reserve``: every request at its startup reservation (``Cache.reserve_pages``), the figure
  vLLM logs at startup (``get_max_concurrency_for_kv_cache_config``) and the arena's
  ``max_requests``; transient prefill reserves counted once per request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .v4_layout import (
    ArenaKind,
    Cache,
    StockGroup,
    arena_alignment,
    cdiv,
    round_up,
    stock_groups,
    stock_stride,
)

PLACEHOLDER = 1  # device bytes per logical row per CSA layer (the DSA line's placeholder spec)


@dataclass(frozen=True)
class Sched:
    max_num_batched_tokens: int
    index_topk: int
    in_flight_batches: int = 2  # vLLM's async scheduling on GPUs: 2 batches in flight

    @property
    def in_flight_tokens(self) -> int:  # VllmConfig.max_in_flight_tokens
        return self.in_flight_batches * self.max_num_batched_tokens


@dataclass
class StockFit:
    groups: list[StockGroup]
    stride: int  # bytes per block id
    usable_blocks: int  # budget // stride, less the null block
    resident_blocks: int  # per request, decoding
    admission_blocks: int  # per admission
    reserve_blocks: int  # per request, vLLM's startup figure
    steady: int
    reserve: float  # vLLM's get_max_concurrency_for_kv_cache_config

    def group_blocks(self, tokens: int) -> list[int]:
        return [g.first.resident_pages(tokens) for g in self.groups]


def stock_fit(caches: list[Cache], budget: int, tokens: int, s: Sched) -> StockFit:
    groups = stock_groups(caches)
    stride = stock_stride(groups)
    usable = max(0, budget // stride - 1)
    res = sum(g.first.resident_pages(tokens) for g in groups)
    adm = sum(g.first.admission_pages(tokens, s.in_flight_tokens) for g in groups)
    rsv = sum(g.first.reserve_pages(tokens, s.in_flight_tokens) for g in groups)
    steady = 1 + (usable - adm) // res if usable >= adm else 0
    return StockFit(groups, stride, usable, res, adm, rsv, steady, usable / rsv)


@dataclass
class UlaFit:
    requests: int
    mode: str  # "steady" | "reserve"
    device_blocks: int  # CSA device pool, logical blocks (64 rows each)
    host_blocks: int  # CSA host pool, logical blocks
    device_bytes: int  # of the budget, used
    host_bytes: int  # host pool bytes (allocated)


@dataclass
class UlaLine:
    """ulacache's planned V4 line on one rank: per-request bytes of each part."""
    caches: list[Cache]
    tokens: int
    sched: Sched
    alignment: int
    kinds: list[ArenaKind]
    csa_layers: int
    block_rows: int  # compressed rows per 256-token logical block
    row_block_bytes: int  # CSA rows of one logical block, all CSA layers (device or host)
    key_block_bytes: int  # indexer keys + placeholders of one logical block (device)
    need_blocks: int  # the device pool's floor: one step's new rows + index_topk
    blocks_per_request: int
    arena_fixed: int  # null page + the largest page's view slack
    fits: dict[str, UlaFit] = field(default_factory=dict)

    def arena_bytes(self, how: str) -> int:
        """Arena bytes one request holds: ``resident`` / ``admission`` / ``reserve``."""
        t, f = self.tokens, self.sched.in_flight_tokens
        pages = {"resident": lambda c: c.resident_pages(t),
                 "admission": lambda c: c.admission_pages(t, f),
                 "reserve": lambda c: c.reserve_pages(t, f)}[how]
        return sum(round_up(k.page, self.alignment) * pages(k.cache) for k in self.kinds)

    def kind_bytes(self, k: ArenaKind) -> int:
        return round_up(k.page, self.alignment) * k.cache.resident_pages(self.tokens)

    @property
    def device_request_bytes(self) -> int:
        """Device bytes a decoding request holds besides its CSA rows."""
        return self.blocks_per_request * self.key_block_bytes + self.arena_bytes("resident")

    @property
    def csa_request_bytes(self) -> int:
        return self.blocks_per_request * self.row_block_bytes

    def cost(self, n: int, budget_host_blocks: int, pool_given: bool, mode: str):
        """(device bytes, device blocks, host blocks) for ``n`` requests."""
        need = n * self.blocks_per_request
        h = budget_host_blocks if pool_given else min(budget_host_blocks,
                                                      max(0, need - self.need_blocks))
        d = max(self.need_blocks, need - h)
        if mode == "steady":
            arena = n * self.arena_bytes("resident") + (
                self.arena_bytes("admission") - self.arena_bytes("resident") if n else 0)
        else:
            arena = n * self.arena_bytes("reserve")
        dev = (d + h) * self.key_block_bytes + d * self.row_block_bytes + arena \
            + self.arena_fixed
        return dev, d, h

    def fit(self, budget: int, host_bytes: int, pool_given: bool, mode: str) -> UlaFit:
        """The most requests the line holds in ``budget`` device bytes with a host pool of at
        most ``host_bytes`` (exactly that pool when ``pool_given``; else the size that holds
        the most: every host row keeps its indexer key on the device)."""
        hb = host_bytes // self.row_block_bytes
        lo, hi = 0, budget // max(1, self.blocks_per_request * self.key_block_bytes) + 1
        if self.cost(0, hb, pool_given, mode)[0] > budget:
            return UlaFit(0, mode, 0, 0, 0, 0)
        while lo < hi:  # cost is nondecreasing in n
            mid = (lo + hi + 1) // 2
            if self.cost(mid, hb, pool_given, mode)[0] <= budget:
                lo = mid
            else:
                hi = mid - 1
        dev, d, h = self.cost(lo, hb, pool_given, mode)
        return UlaFit(lo, mode, d, h, dev, h * self.row_block_bytes)


def ula_line(caches: list[Cache], budget: int, tokens: int, s: Sched) -> UlaLine:
    by = {c.key: c for c in caches}
    csa, idx = by["csa"], by["idx"]
    n = len(csa.layers)
    kinds = [ArenaKind(c) for c in caches if c.home == "arena"]
    align = arena_alignment(kinds, budget)
    max_page = round_up(max(k.page for k in kinds), align)
    need_rows = cdiv(s.max_num_batched_tokens, csa.tokens_per_row) + s.index_topk
    return UlaLine(
        caches, tokens, s, align, kinds, n, csa.rows_per_page,
        row_block_bytes=n * csa.rows_per_page * csa.row_bytes,
        key_block_bytes=n * (idx.page + csa.rows_per_page * PLACEHOLDER),
        need_blocks=cdiv(need_rows, csa.rows_per_page),
        blocks_per_request=cdiv(tokens, csa.block_size),
        arena_fixed=2 * max_page)


def exact_device_bytes(caches: list[Cache], tokens: int) -> int:
    """The physical bound's bytes per request: every device-resident kind's data, no pages
    (the CSA rows on the host)."""
    return sum(c.exact_bytes(tokens) for c in caches if c.home != "logical")


def stock_kind_bytes(fit: StockFit, tokens: int) -> dict[str, int]:
    """Stock's bytes per request of each kind: its groups' blocks x the block stride, shared
    out among the kinds of a group by their page bytes (padding included)."""
    out: dict[str, float] = {}
    for g in fit.groups:
        blocks = g.first.resident_pages(tokens)
        for _, c in g.members:
            out[c.key] = out.get(c.key, 0) + blocks * fit.stride * c.page / g.page
    return {k: int(round(v)) for k, v in out.items()}
