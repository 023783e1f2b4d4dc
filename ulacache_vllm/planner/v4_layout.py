"""DeepSeek-V4's KV caches in plain arithmetic (no vLLM import): the caches vLLM 0.32 declares,
stock vLLM's packed hybrid groups, and ulacache's planned V4 line.

Sources (vLLM 0.32, fp8_ds_mla, the only V4 cache layout on H200's FlashMLA path and on CPU):
``models/deepseek_v4/attention.py`` (``get_kv_cache_spec`` of the attention and of
``DeepseekV4IndexerCache``), ``compressor.py`` (``CompressorStateCache``),
``v1/attention/backends/mla/sparse_swa.py`` (``DeepseekV4SWACache``); every page is padded up to
576 B (``alignment=576``); main caches use vLLM's V4 block of 256 tokens (the only block size
its sparse-MLA and indexer backends take). Stock's grouping is the arithmetic of
``v1/core/kv_cache_utils.py:_get_packed_kv_cache_groups`` and ``_get_kv_cache_bytes_per_block``
(block-outermost layout: every block id is as wide as the widest group). ``v4_check`` compares
all of it with vLLM's own functions and the engine's ``plan_arena``.

ulacache's V4 line (issue 44, planned: no engine sizing exists yet): CSA compressed rows in the
logical address space (device pool + host pool, exclusive residency, 584 B a row per CSA
layer, no page padding: the pools are ``[rows, 584]`` views); indexer keys on the device for
every logical row (at vLLM's own padded page, as V3.2's keys); window pages, HCA rows and
compressor states in the arena at their own page sizes (``engine.arena.sizing`` rules).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from .errors import PlannerError

ROW = 584  # fp8_ds_mla row: 448 fp8 NoPE + 64 bf16 RoPE (128 B) + 7 UE8M0 scales + 1 pad
ALIGN = 576  # V4 specs' page alignment (FlashMLA packing stride)
MAIN_BLOCK = 256  # cache block size V4's sparse-MLA / indexer backends take (tokens)
SWA_BLOCK = 64  # DeepseekV4SWACache's block size
STATE_BLOCK = {4: 4, 128: 8}  # CompressorStateCache block sizes per compress ratio
FP32 = 4
ARENA_MIN_ALIGNMENT = 256  # engine.arena.sizing.MIN_ALIGNMENT (v4_check compares)
ARENA_MAX_GRANULES = 1 << 30  # engine.arena.sizing.MAX_GRANULES


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(n: int, a: int) -> int:
    return cdiv(n, a) * a


@dataclass(frozen=True)
class Cache:
    """One V4 cache kind: its layers, vLLM spec family and page geometry."""
    key: str  # csa | idx | hca | swa | c4_state | c4_idx_state | c128_state
    label: str
    family: str  # "full" (MLAAttentionSpec) | "sliding" (SlidingWindowMLASpec)
    suffix: str  # layer name after "model.layers.{i}.attn"
    layers: tuple[int, ...]
    block_size: int  # tokens per page
    tokens_per_row: int  # tokens one stored row covers (compress ratio; 1 for sliding kinds)
    row_bytes: int
    window: int | None  # sliding kinds: tokens kept
    home: str  # ulacache: "logical" (device + host pools) | "device" | "arena"

    @property
    def rows_per_page(self) -> int:
        return self.block_size // self.tokens_per_row

    @property
    def raw_page(self) -> int:
        return self.rows_per_page * self.row_bytes

    @property
    def page(self) -> int:
        """vLLM's page_size_bytes (padded to 576 B), one layer."""
        return round_up(self.raw_page, ALIGN)

    def name(self, layer: int) -> str:
        return f"model.layers.{layer}.attn{self.suffix}"

    def sliding_cap(self, tokens: int, in_flight: int) -> int:
        """vLLM's ``SlidingWindowSpec.max_admission_blocks_per_request``."""
        return cdiv(min(self.window - 1 + in_flight, tokens), self.block_size) + 1

    def resident_pages(self, tokens: int) -> int:
        """Pages a request of ``tokens`` holds while decoding: every page of a full kind;
        a sliding kind's window plus one token in flight (vLLM's cap at one token in flight,
        = the most pages window + 1 consecutive tokens span: also with async scheduling)."""
        if self.family == "full":
            return cdiv(tokens, self.block_size)
        return min(self.sliding_cap(tokens, 1), cdiv(tokens, self.block_size))

    def admission_pages(self, tokens: int, in_flight: int) -> int:
        """Pages the admission gate of a new request of ``tokens`` asks (vLLM's
        ``get_num_blocks_to_allocate`` with ``apply_admission_cap``; the arena's gate)."""
        if self.family == "full":
            return cdiv(tokens, self.block_size)
        return min(cdiv(tokens, self.block_size), self.sliding_cap(tokens, in_flight))

    def reserve_pages(self, tokens: int, in_flight: int) -> int:
        """Pages vLLM's startup figure reserves per request (``max_memory_usage_bytes``)."""
        if self.family == "full":
            return cdiv(tokens, self.block_size)
        return self.sliding_cap(tokens, in_flight)

    def exact_bytes(self, tokens: int) -> int:
        """Bytes of data a request keeps (all layers), no pages: full kinds one row per
        complete group of ``tokens_per_row``; sliding kinds the window's rows."""
        rows = tokens // self.tokens_per_row if self.family == "full" else min(self.window,
                                                                                tokens)
        return len(self.layers) * rows * self.row_bytes


def layer_ratios(cfg: dict[str, Any]) -> list[int]:
    """Compress ratio per layer as vLLM reads it (``max(1, compress_ratios[i])`` for the first
    num_hidden_layers; the MTP layer's trailing entry is not a decoder layer)."""
    n = cfg["num_hidden_layers"]
    ratios = cfg.get("compress_ratios")
    if ratios is None or len(ratios) < n:
        raise PlannerError(f"a DeepSeek-V4 config needs compress_ratios for each of its {n} "
                           f"layers (0 sliding window only, 4 CSA, 128 HCA)")
    out = [max(1, int(r)) for r in ratios[:n]]
    bad = sorted({r for r in out if r not in (1, 4, 128)})
    if bad:
        raise PlannerError(f"compress ratios {bad} are not DeepSeek-V4.0's (0/1, 4, 128); "
                           f"V4.1's C1A/C2A layers are not modelled")
    return out


def v4_caches(cfg: dict[str, Any]) -> list[Cache]:
    """The caches one rank holds (all replicated over TP: max_tp_shards=1)."""
    if cfg.get("head_dim", 512) != 512 or cfg.get("qk_rope_head_dim", 64) != 64:
        raise PlannerError("V4's fp8_ds_mla row (584 B) assumes head_dim 512 with RoPE 64")
    ratios = layer_ratios(cfg)
    csa = tuple(i for i, r in enumerate(ratios) if r == 4)
    hca = tuple(i for i, r in enumerate(ratios) if r == 128)
    every = tuple(range(len(ratios)))
    hd, ihd, win = cfg.get("head_dim", 512), cfg["index_head_dim"], cfg["sliding_window"]
    out = [
        Cache("csa", "CSA compressed rows (C4 main)", "full", "", csa, MAIN_BLOCK, 4, ROW,
              None, "logical"),
        Cache("idx", "C4 indexer keys", "full", ".indexer.k_cache", csa, MAIN_BLOCK, 4,
              ihd + ihd // 128 * 4, None, "device"),
        Cache("hca", "HCA rows (C128 main)", "full", "", hca, MAIN_BLOCK, 128, ROW, None,
              "arena"),
        Cache("swa", "sliding window (every layer)", "sliding", ".swa_cache", every, SWA_BLOCK,
              1, ROW, win, "arena"),
        Cache("c4_state", "C4 compressor state", "sliding", ".compressor.state_cache", csa,
              STATE_BLOCK[4], 1, 2 * 2 * hd * FP32, 2 * 4, "arena"),
        Cache("c4_idx_state", "C4 indexer compressor state", "sliding",
              ".indexer.compressor.state_cache", csa, STATE_BLOCK[4], 1, 2 * 2 * ihd * FP32,
              2 * 4, "arena"),
        Cache("c128_state", "C128 compressor state", "sliding", ".compressor.state_cache", hca,
              STATE_BLOCK[128], 1, 2 * 1 * hd * FP32, 128, "arena"),
    ]
    return [c for c in out if c.layers]


def layer_specs(caches: list[Cache]) -> list[tuple[str, Cache]]:
    """(layer name, cache) in vLLM's registration order: per layer the indexer's key cache and
    its compressor state, the window cache, the attention, its compressor state."""
    order = {"idx": 0, "c4_idx_state": 1, "swa": 2, "csa": 3, "hca": 3, "c4_state": 4,
             "c128_state": 4}
    items = [(i, order[c.key], c) for c in caches for i in c.layers]
    return [(c.name(i), c) for i, _, c in sorted(items, key=lambda t: (t[0], t[1]))]


# ---------------------------------------------------------------- stock: packed groups

@dataclass(frozen=True)
class StockGroup:
    members: tuple[tuple[str, Cache], ...]

    @property
    def first(self) -> Cache:
        return self.members[0][1]

    @property
    def page(self) -> int:
        """Bytes of one block of this group (its layers' pages side by side)."""
        return sum(c.page for _, c in self.members)

    @property
    def kinds(self) -> Counter:
        return Counter(c.key for _, c in self.members)


def approximate_gcd(values: list[int], lower_bound: int) -> int:
    """vLLM's ``_approximate_gcd``: the chunk size with least upward padding (ties: larger)."""
    lo, hi = max(1, lower_bound), max(values)
    if lo > hi:
        return lo
    best, best_pad = lo, None
    for d in range(lo, hi + 1):
        pad = sum((d - x % d) % d for x in values)
        if best_pad is None or pad < best_pad or (pad == best_pad and d > best):
            best, best_pad = d, pad
    return best


def stock_groups(caches: list[Cache]) -> list[StockGroup]:
    """vLLM's ``_get_packed_kv_cache_groups`` on V4's specs (no Mamba / circular-buffer
    buckets in V4.0)."""
    buckets: list[list[tuple[str, Cache]]] = []
    for name, c in layer_specs(caches):
        for b in buckets:
            f = b[0][1]
            if (f.family, f.block_size, f.window) == (c.family, c.block_size, c.window):
                b.append((name, c))
                break
        else:
            buckets.append([(name, c)])
    info = []
    for b in buckets:
        by_page: dict[int, list] = {}
        for name, c in b:
            by_page.setdefault(c.page, []).append((name, c))
        balanced = len({len(v) for v in by_page.values()}) == 1
        info.append((b, by_page, balanced, max(len(v) for v in by_page.values())))
    min_rep = max((m for _, p, bal, m in info if bal and len(p) > 1), default=0)
    rep = approximate_gcd([m for _, _, bal, m in info if bal], min_rep) if min_rep else None

    def is_state(b) -> bool:  # no Mamba / CircularBuffer here; sliding buckets when unsplit
        return rep is None and b[0][1].family == "sliding"

    def n_groups(bal: bool, m: int) -> int:
        return cdiv(m, rep) if bal and rep is not None else 1

    def widest(by_page: dict, n: int) -> int:
        return sum(cdiv(len(v), n) * page for page, v in by_page.items())

    anchor = max((widest(p, len(b) if is_state(b) else n_groups(bal, m))
                  for b, p, bal, m in info), default=0)
    groups = []
    for b, by_page, bal, m in info:
        n = n_groups(bal, m)
        if anchor and is_state(b):
            n = max(n, cdiv(len(b), max(anchor // b[0][1].page, 1)))
        if n == 1:
            groups.append(StockGroup(tuple(b)))
            continue
        repeats = list(zip(*by_page.values()))
        for i in range(n):
            groups.append(StockGroup(tuple(x for r in repeats[i::n] for x in r)))
    return groups


def stock_stride(groups: list[StockGroup]) -> int:
    """Bytes per block id (block-outermost: the widest group's page)."""
    return max(g.page for g in groups)


# ---------------------------------------------------------------- ulacache: the arena kinds

@dataclass(frozen=True)
class ArenaKind:
    cache: Cache

    @property
    def page(self) -> int:  # one page holds all the kind's layers (plan_arena's groups)
        return self.cache.page * len(self.cache.layers)


def arena_alignment(kinds: list[ArenaKind], total: int) -> int:
    """engine.arena.sizing._alignment over the kinds' layer and group pages."""
    a = 0
    for p in [k.cache.page for k in kinds] + [k.page for k in kinds]:
        a = math.gcd(a, p)
    a = max(ARENA_MIN_ALIGNMENT, 1 << (a.bit_length() - 1) if a else ARENA_MIN_ALIGNMENT)
    while total // a > ARENA_MAX_GRANULES:
        a *= 2
    return a


def v4_params(c: dict[str, Any]) -> tuple[int, int]:
    """(dense, routed-expert) parameters of a V4 config: attention (fused wq_a/wkv, wq_b,
    grouped wo_a, wo_b), compressors (fused wkv/wgate + position bias), the C4 layers' indexer
    (wq_b, weights_proj, its compressor), shared experts, router, embeddings; norms, attention
    sinks, mHC mixing weights and the MTP layer are left out."""
    h, nh, hd = c["hidden_size"], c["num_attention_heads"], c.get("head_dim", 512)
    ql, ol, og = c["q_lora_rank"], c["o_lora_rank"], c["o_groups"]
    ih, ihd = c["index_n_heads"], c["index_head_dim"]
    attn = h * (ql + hd) + ql * nh * hd + nh * hd * ol + og * ol * h
    dense = 0
    for r in layer_ratios(c):
        dense += attn
        if r > 1:
            coff = 2 if r == 4 else 1
            dense += 2 * h * coff * hd + r * coff * hd
        if r == 4:
            dense += ql * ih * ihd + h * ih + 2 * h * 2 * ihd + 4 * 2 * ihd
    L, e, mi = c["num_hidden_layers"], c["n_routed_experts"], c["moe_intermediate_size"]
    dense += L * ((c.get("n_shared_experts") or 0) * 3 * h * mi + e * h)
    dense += c["vocab_size"] * h * (1 if c.get("tie_word_embeddings") else 2)
    return dense, L * e * 3 * h * mi
