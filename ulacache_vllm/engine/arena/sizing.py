"""Arena sizing for hybrid models: one byte range, every kind at its natural page size.

Layers are grouped by spec equality (no page unification, no padding): each group is one
arena kind, one vLLM KV cache group, one block table. Full-attention groups grow in the HIGH
band, sliding-window and recurrent-state groups in the LOW band. vLLM's block ids become
virtual page ids (vids) that the worker translates to *granules* (byte offset / alignment):
every layer's cache is a view over the one buffer whose block stride is the alignment, so
granule ``g`` of a layer is its page at byte ``g * alignment`` (pages of one layer overlap in
the view; a granule is only read where a page of that layer's kind starts).

Invariants: the buffer holds ``total_bytes + max page`` bytes so that every granule's view
fits; vid 0 is the null page (max page bytes at LOW offset 0, never moved or freed).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from vllm.logger import init_logger

from ..config import KVBackendError, UlaSettings, refuse_context_parallel, reported_to_front_end
from ..line import LineLayout, UlaKVCacheConfig

logger = init_logger("vllm.ulacache")

MIN_ALIGNMENT = 256
# Granules are vLLM block ids (int32 in its block tables) and the views' dim 0 (strided views
# over the one buffer: no memory per granule). Beyond this many the alignment doubles (and
# pages are rounded up to it): only arenas of hundreds of GiB with KiB-sized layer pages.
MAX_GRANULES = 1 << 30


@dataclasses.dataclass(frozen=True)
class ArenaGroup:
    kind: str  # "full" | "sliding" | "state" (+ index when several of one type)
    band: str  # "low" | "high"
    layer_names: tuple[str, ...]
    layer_page_bytes: int  # one layer's page
    block_size: int  # tokens per page (state kinds: vLLM's mamba block size)
    pages_per_max_request: int  # pages one request of max_model_len holds (admission cap)
    # New pages of this kind are zeroed when the layout zeroes (``zero_new_pages``): vLLM
    # zeroes full-attention blocks (its CPU runner's ``_zero_block_ids``) and the arena keeps
    # zeroing recurrent state; sliding-window pages reuse stale bytes, as stock's blocks do.
    zeroed: bool = True

    @property
    def page_bytes(self) -> int:
        return self.layer_page_bytes * len(self.layer_names)


@dataclasses.dataclass
class ArenaLayout(LineLayout):
    groups: list[ArenaGroup]
    alignment: int
    total_bytes: int  # the arena's byte range (the null page included)
    buffer_bytes: int  # allocated: total + the largest page, so every granule's view fits
    budget_bytes: int
    max_model_len: int
    stock_requests: int | None = None  # max_model_len requests stock HMA fits (estimate)
    # GDN/mamba hybrids: stock's attention block (``stock_block_size``), where the arena also
    # checkpoints a prompt's state (``ArenaKVCacheManager.prefill_checkpoint_stop``); 0: none.
    state_checkpoint_tokens: int = 0
    force_moves_every: int = 0
    # New pages are zeroed before the forward reads them: vLLM's own rule for its pools
    # (``KVCacheConfig.needs_kv_cache_zeroing``: Mamba state, or KV of mixed precisions, whose
    # stale bytes could decode to NaN/Inf). Pages of one precision reuse stale bytes as
    # stock's blocks do.
    zero_new_pages: bool = True

    def manager_cls(self) -> type:
        from .manager import ArenaKVCacheManager

        return ArenaKVCacheManager

    def build_worker(self, vllm_config, settings, kv_caches: dict):
        from ..faults import MoveFaults
        from .worker import ArenaWorker

        return ArenaWorker(self, kv_caches, MoveFaults.from_env())

    @property
    def num_granules(self) -> int:
        return self.total_bytes // self.alignment

    @property
    def null_page_bytes(self) -> int:
        return _round_up(max(g.page_bytes for g in self.groups), self.alignment)

    def request_bytes(self, max_len: int | None = None) -> int:
        """Arena bytes one request of ``max_len`` (default max_model_len) holds at most."""
        if max_len is None:
            return sum(_round_up(g.page_bytes, self.alignment) * g.pages_per_max_request
                       for g in self.groups)
        return sum(_round_up(g.page_bytes, self.alignment) * _pages(g, max_len)
                   for g in self.groups)

    @property
    def max_requests(self) -> int:
        return (self.total_bytes - self.null_page_bytes) // max(1, self.request_bytes())

    def summary(self, max_model_len: int | None = None) -> str:
        kinds = ", ".join(
            f"{g.kind} {len(g.layer_names)} layers x {g.layer_page_bytes} B = {g.page_bytes} B "
            f"pages of {g.block_size} tokens ({g.band} band)" for g in self.groups)
        stock = (f"; stock vLLM (HMA, padded uniform pages) fits ~{self.stock_requests} in "
                 f"the same budget" if self.stock_requests is not None else "")
        return (f"ulacache arena: {self.total_bytes} bytes ({self.num_granules} granules of "
                f"{self.alignment} B), natural page sizes: {kinds}; max concurrent requests "
                f"of max_model_len={self.max_model_len}: {self.max_requests}{stock}")


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def _pages(g: ArenaGroup, max_len: int) -> int:
    if g.kind.startswith("state"):
        return g.pages_per_max_request
    return min(g.pages_per_max_request, -(-max_len // g.block_size) + 1)


def is_arena_model(specs: dict) -> bool:
    """True if the worker's layer specs are a hybrid the arena serves (no MLA)."""
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    kinds = {type(s) for s in specs.values()}
    if any(issubclass(k, MLAAttentionSpec) for k in kinds):
        return False
    return any(issubclass(k, (MambaSpec, SlidingWindowSpec)) for k in kinds)


def _kind_of(spec) -> tuple[str, str]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    if isinstance(spec, MambaSpec):
        return "state", "low"
    if isinstance(spec, SlidingWindowSpec):
        return "sliding", "low"
    if isinstance(spec, FullAttentionSpec):
        return "full", "high"
    raise KVBackendError(
        f"--kv-backend ulacache's arena does not handle KV layers of type "
        f"{type(spec).__name__} yet (it serves full attention, sliding window and GDN/mamba "
        f"state). Use --kv-backend vllm for this model.")


def group_specs(specs: dict) -> list[tuple[list[str], object]]:
    """Layers grouped by spec equality, in layer order of each group's first layer."""
    from ..dsa.sizing import _layer_index

    groups: list[tuple[list[str], object]] = []
    for name in sorted(specs, key=_layer_index):
        spec = specs[name]
        for names, s in groups:
            if s == spec:
                names.append(name)
                break
        else:
            groups.append(([name], spec))
    return groups


def needs_zeroing(grouped: list[tuple[list[str], object]]) -> bool:
    """Whether the arena's new pages must be zeroed: vLLM's rule for its own pools, over the
    arena's groups (every kind shares the one byte range, as stock's groups share its pool)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec(list(names), spec) for names, spec in grouped]
    return KVCacheConfig(num_blocks=1, kv_cache_tensors=[],
                         kv_cache_groups=groups).needs_kv_cache_zeroing


def _alignment(page_sizes: list[int], total: int, min_block_stride: int = 0) -> int:
    """The granule: a power of two up to the pages' gcd (at least ``MIN_ALIGNMENT``), raised
    to a multiple of it no smaller than ``min_block_stride`` (a kernel that reads a layer's
    pages at the view's block stride and refuses pages that overlap in the view)."""
    a = 0
    for p in page_sizes:
        a = math.gcd(a, p)
    a = max(MIN_ALIGNMENT, 1 << (a.bit_length() - 1) if a else MIN_ALIGNMENT)
    a = _round_up(max(a, min_block_stride), a)
    while total // a > MAX_GRANULES:
        a *= 2
    return a


def plan_arena(vllm_config, specs: dict, available_bytes: int, settings: UlaSettings,
               strided_layers=lambda name: False,
               request_pages=lambda names, spec: None) -> tuple[ArenaLayout, list]:
    """(layout, [(layer names, spec)] per group) for one worker's specs and KV budget.
    ``strided_layers(name)``: the layer's kernel refuses a view whose block stride is smaller
    than its page (the granule then grows to that page). ``request_pages(names, spec)``: the
    pages a group's request holds at most where a line knows better than the spec (None: the
    spec's own figure)."""
    max_model_len = vllm_config.model_config.max_model_len
    grouped = group_specs(specs)
    counts: dict[str, int] = {}
    groups = []
    for names, spec in grouped:
        base, band = _kind_of(spec)
        counts[base] = counts.get(base, 0) + 1
        groups.append((base, band, names, spec))
    out = []
    for base, band, names, spec in groups:
        kind = base if counts[base] == 1 else f"{base}{sum(1 for g in out if g.kind.startswith(base))}"
        per_req = spec.max_num_blocks_per_req(vllm_config, max_model_len) \
            if hasattr(spec, "max_num_blocks_per_req") else -(-max_model_len // spec.block_size)
        if base == "sliding":
            per_req = spec.max_admission_blocks_per_request(
                vllm_config.max_in_flight_tokens, max_model_len)
        elif base == "state":
            # Pages held at once ("align" mode: the running state, the previous one until
            # it is freed, checkpoints; its block-table row is longer, mostly null).
            per_req = -(-spec.max_memory_usage_bytes(vllm_config) // spec.page_size_bytes)
        own = request_pages(tuple(names), spec)
        if own is not None:
            per_req = min(per_req, own)
        out.append(ArenaGroup(kind, band, tuple(names), spec.page_size_bytes, spec.block_size,
                              int(per_req), zeroed=base != "sliding"))
    pages = [g.layer_page_bytes for g in out] + [g.page_bytes for g in out]
    strict = max((g.layer_page_bytes for g in out
                  if any(strided_layers(n) for n in g.layer_names)), default=0)
    align = _alignment(pages, max(available_bytes, 1), strict)
    max_page = _round_up(max(g.page_bytes for g in out), align)
    total = max(0, (available_bytes - max_page) // align * align)
    layout = ArenaLayout(out, align, total, total + max_page, available_bytes, max_model_len,
                         force_moves_every=settings.arena_force_moves,
                         zero_new_pages=needs_zeroing(grouped))
    layout.stock_requests = stock_hma_requests(vllm_config, grouped, available_bytes)
    layout.state_checkpoint_tokens = state_checkpoint_tokens(grouped)
    need = layout.request_bytes() + layout.null_page_bytes
    if need > total:
        raise KVBackendError(
            f"ulacache arena too small: the KV budget of {available_bytes} bytes leaves an arena "
            f"of {total} bytes, but one request of max_model_len={max_model_len} needs {need} "
            f"bytes with the null page ({layout.summary()}). Raise the KV budget "
            f"(--kv-cache-memory-bytes / VLLM_CPU_KVCACHE_SPACE) to at least "
            f"{need + max_page} bytes or lower --max-model-len.")
    return layout, grouped


# The CPU build's default attention block; for GDN/mamba hybrids its platform grows it to the
# smallest multiple whose attention page holds a state page (``Platform._align_hybrid_block_
# size``: 640 tokens on the tiny Qwen3-Next with its float32 state on AVX512-BF16 hosts, 384
# with the bf16 state AVX2 hosts keep).
STOCK_CPU_BLOCK = 128


def stock_block_size(grouped) -> int:
    """The attention block stock vLLM's CPU build gives a GDN/mamba hybrid with its default
    block size: ``128 * cdiv(state page, 128 * attention bytes per token)``; 0 without state
    layers."""
    from vllm.v1.kv_cache_interface import MambaSpec

    attn = [s for _, s in grouped if not isinstance(s, MambaSpec)]
    state = [s for _, s in grouped if isinstance(s, MambaSpec)]
    if not attn or not state:
        return 0
    per_tok = max(s.page_size_bytes // s.block_size for s in attn)
    mpage = max(s.page_size_bytes for s in state)
    return STOCK_CPU_BLOCK * -(-mpage // (STOCK_CPU_BLOCK * per_tok))


def state_checkpoint_tokens(grouped) -> int:
    """Where the arena checkpoints a prompt's GDN/mamba state besides its own pages ("align"
    mode stores a state only where a prefill chunk ends): at stock's block, so a prompt sharing
    a prefix hits at least where stock's coarse blocks let it (issue 45). 0 where that block
    is no coarser than the state page, or not a whole number of them."""
    from vllm.v1.kv_cache_interface import MambaSpec

    page = max((s.block_size for _, s in grouped if isinstance(s, MambaSpec)), default=0)
    tokens = stock_block_size(grouped)
    return tokens if page and tokens > page and tokens % page == 0 else 0


def stock_hma_requests(vllm_config, grouped, budget: int) -> int | None:
    """Requests of max_model_len stock vLLM's CPU HMA fits in ``budget`` (its rules: attention
    blocks of 128 tokens, or for GDN hybrids ``128 * cdiv(state page, 128 * attention bytes
    per token)`` with state pages padded to the attention page; groups of equal layer count,
    one block id per group page)."""
    try:
        from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

        L = vllm_config.model_config.max_model_len
        attn = [(n, s) for n, s in grouped if not isinstance(s, MambaSpec)]
        state = [(n, s) for n, s in grouped if isinstance(s, MambaSpec)]
        if not attn:
            return None
        per_tok = max(s.page_size_bytes // s.block_size for _, s in attn)
        bs = stock_block_size(grouped) or STOCK_CPU_BLOCK
        page = bs * per_tok
        layers = [len(n) for n, _ in grouped]
        gsize = min(layers)
        # vLLM splits every type into groups of gsize layers; each group holds one block per
        # page of its type; a block spans gsize layers' pages.
        blocks = budget // (page * gsize)
        per_req = 0
        for names, s in grouped:
            ngroups = -(-len(names) // gsize)
            if isinstance(s, MambaSpec):
                need = 1
            elif isinstance(s, SlidingWindowSpec):
                need = min(-(-(s.sliding_window - 1 + vllm_config.max_in_flight_tokens) // bs)
                           + 1, -(-L // bs))
            else:
                need = -(-L // bs)
            per_req += ngroups * need
        return max(0, (blocks - 1) // max(1, per_req))
    except Exception:  # an estimate for the startup line only
        return None


def get_kv_cache_configs(orig, vllm_config, kv_cache_specs: list[dict],
                         available_memory: list[int], settings: UlaSettings,
                         strided_layers=lambda name: False):
    """The arena's KVCacheConfigs: one group per kind, one strided tensor per group over one
    buffer, ``num_blocks`` = granules (vLLM's own sizing, ``orig``, is not used)."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, KVCacheTensor

    with reported_to_front_end():
        plans = [plan_arena(vllm_config, s, a, settings, strided_layers)
                 for s, a in zip(kv_cache_specs, available_memory)]
    layout, _ = min(plans, key=lambda p: p[0].total_bytes)
    configs = []
    for _, grouped in plans:
        groups = [KVCacheGroupSpec(list(names), spec) for names, spec in grouped]
        tensors = [KVCacheTensor(size=layout.buffer_bytes, layers=list(g.layer_names),
                                 layer_stride=g.layer_page_bytes, block_stride=layout.alignment,
                                 offset=0) for g in layout.groups]
        # Stock's retention rule (which window / state pages get hashed): the CLI value.
        retention = vllm_config.cache_config.prefix_cache_retention_interval
        configs.append(UlaKVCacheConfig(num_blocks=layout.num_granules,
                                        kv_cache_tensors=tensors, kv_cache_groups=groups,
                                        layout=layout,
                                        prefix_cache_retention_interval=retention))
    return configs


ARENA_BLOCK_SIZE = 32  # tokens per attention page (CPU_ATTN takes multiples of 32)


def prepare_engine_args(engine_args: Any) -> None:
    """Before vLLM builds its configuration: prefix caching is left to the user and vLLM's
    defaults (on for hybrids on the CPU build, as stock), so GDN models run vLLM's "align"
    state mode with it, as stock does; ``prepare`` pins the state checkpoints to the attention
    page."""
    return None


# Speculative methods the arena runs: n-gram (no draft KV; GDN state pages widen to 1+k per
# request, each page's conv part to ``kernel-1+k`` rows, as vLLM's specs say) and the
# target's own MTP layer (Qwen3-Next: one more full-attention layer, grouped by spec equality
# like any layer, with k lookahead slots). Every speculative page is an arena page of its
# group's kind: placed, moved and fenced with the target's; rollback is vLLM's (counters and
# GDN state-slot choice), nothing is freed.
ARENA_SPEC_METHODS = ("ngram", "mtp")


def _model_name(vllm_config: Any) -> str:
    """The model's architectures, for a refusal's message."""
    arch = getattr(vllm_config.model_config.hf_config, "architectures", None) or []
    return ",".join(arch) or "this model"


def refuse_speculative(vllm_config: Any) -> None:
    """Speculative methods the arena does not run yet are refused, naming the combination
    and the fix."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or spec.method in ARENA_SPEC_METHODS:
        return
    raise KVBackendError(
        f"--kv-backend ulacache's arena (hybrid models) does not run speculative decoding "
        f"with method {spec.method!r} on {_model_name(vllm_config)} yet: a separate draft "
        f"model's KV layers are not placed in the arena (it runs 'ngram', and 'mtp' for "
        f"models with their own MTP layer such as Qwen3-Next). Use "
        f"--speculative-config '{{\"method\": \"ngram\", \"num_speculative_tokens\": "
        f"{spec.num_speculative_tokens}}}' with the arena, or --kv-backend vllm for "
        f"{spec.method!r} drafts.")


def refuse_speculative_in_align_mode(vllm_config: Any) -> None:
    """Speculative decoding with prefix caching on a GDN hybrid (vLLM's mamba cache mode
    'align') copies states through a Triton kernel (`precopy_mamba_align_fused_kernel`)
    that vLLM's CPU build does not have: stock vLLM fails at the first decode step. Refused at
    start-up instead, naming both ways out."""
    cc = vllm_config.cache_config
    if (getattr(vllm_config, "speculative_config", None) is None
            or not cc.enable_prefix_caching
            or getattr(cc, "mamba_cache_mode", "none") != "align"):
        return
    raise KVBackendError(
        f"speculative decoding with prefix caching on {_model_name(vllm_config)} (mamba cache mode "
        f"'align') needs vLLM's Triton kernel precopy_mamba_align_fused_kernel, which vLLM's "
        f"CPU build does not have (stock vLLM fails at the first decode step). Turn prefix "
        f"caching off (--no-enable-prefix-caching; enable_prefix_caching=False) or drop "
        f"--speculative-config.")


def prepare(vllm_config: Any, settings: UlaSettings) -> None:
    """Hybrid models: what the arena does not support yet is refused here, naming the fix;
    the attention page defaults to 32 tokens instead of the CPU build's 128."""
    pc = vllm_config.parallel_config
    fix = " Use --kv-backend vllm for this setup."
    # Tensor parallelism: every rank holds its heads' share of every page, so one plan (the
    # same vids, granules and copies) serves every rank's buffer.
    if pc.pipeline_parallel_size > 1:
        raise KVBackendError(
            f"--kv-backend ulacache's arena (hybrid models) does not support pipeline "
            f"parallelism yet (pipeline_parallel_size {pc.pipeline_parallel_size}); tensor "
            f"parallelism is supported.{fix}")
    refuse_context_parallel(pc, "--kv-backend ulacache's arena (hybrid models)", f" yet.{fix}")
    refuse_speculative(vllm_config)
    sc = vllm_config.scheduler_config
    if sc.async_scheduling:
        # A step's pages are fenced until its output is processed; with one batch in flight
        # at a time (synchronous scheduling) the fences pass before the next schedule.
        logger.info("ulacache arena: async scheduling is turned off (hybrid models run with "
                    "synchronous scheduling under the arena for now)")
        sc.async_scheduling = False
    cc = vllm_config.cache_config
    if not getattr(cc, "user_specified_block_size", False):
        cc.block_size = ARENA_BLOCK_SIZE
        # Marked as chosen, so vLLM's later copies of the config keep it: the MTP drafter's
        # `dataclasses.replace(vllm_config, ...)` (v1/spec_decode/llm_base_proposer.py
        # `_create_draft_vllm_config`) re-runs `VllmConfig.__post_init__`, whose CPU platform
        # hook resets an unchosen block size to 128 on the shared cache config
        # (platforms/cpu.py `check_and_update_config`); stock re-aligns it afterwards, the
        # arena skips that alignment (patches/hybrid_block_size.py).
        cc.user_specified_block_size = True
    refuse_speculative_in_align_mode(vllm_config)
    if cc.enable_prefix_caching and getattr(cc, "mamba_cache_mode", "none") == "align":
        # A state checkpoint per attention page (vLLM re-syncs this in the block-size
        # alignment the arena skips): hits land on the same boundaries in every group, and no
        # partial-block hit (whose copy-on-write the arena does not do) can arise.
        cc.mamba_block_size = cc.block_size
