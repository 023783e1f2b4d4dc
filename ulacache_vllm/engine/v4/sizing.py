"""DeepSeek-V4 under ulacache: the CSA compressed rows in the logical address space (device
and host pools, `rows.py`), every other cache an arena kind at its natural page size.

V4 declares seven kinds of cache per model (`../shared/reference/deepseek-v4-notes.md` §1.2):
the sliding window of every layer (64-token pages), the CSA compressed rows (584 B per 4
tokens), the CSA indexer keys (132 B per 4 tokens), the HCA rows (584 B per 128 tokens), and
three fp32 compressor states (4- and 8-token pages). Stock vLLM's hybrid allocator gives every
block id the bytes of its widest group (47,808 B on the factory's 3-layer tiny V4, 189,504 B on
an 8-layer one, for pages of 1,728 to 37,440 B per layer); the arena stores each at its own
size. Layers are grouped by spec equality, the sliding
and state kinds in the arena's LOW band, the compressed kinds in its HIGH band, as for any
hybrid (`arena.sizing.plan_arena`).

The CSA rows (584 B per 4 tokens and CSA layer, ~79 % of a long request's bytes on V4's
default layer schedule, read sparsely: the top 512 per query) leave the arena: their group's
block ids are logical blocks of the scheduler's CSA pool, ``(device_rows + host_rows) /
rows_per_block`` of them, and the device budget holds ``device_rows`` per CSA layer (default:
one step's new rows plus one request's top-k) besides the arena. So admission is
bounded by the arena's bytes per request (indexer keys, HCA rows, window pages, compressor
states) and by the CSA pool's rows, most of them host memory (`--ula-host-pool-gib`).

Invariant: the indexer's key kernel (`fp8_paged_mqa_logits_cpu`) reads a layer's pages at the
view's block stride and refuses pages that overlap in the view, so the granule (the arena's
block stride) is at least one indexer layer page (`INDEXER_CACHE_SUFFIX`); every other V4
kernel takes pages at any granule.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from vllm.logger import init_logger

from ..arena.sizing import ArenaLayout
from ..config import KVBackendError, UlaSettings, refuse_context_parallel, reported_to_front_end
from ..line import UlaKVCacheConfig
from .rows import CsaRowsPlan

logger = init_logger("vllm.ulacache")

# vLLM's V4 names a CSA layer's indexer key cache `<layer>.attn.indexer.k_cache`
# (`vllm/models/deepseek_v4/attention.py`, the indexer's `k_cache` module).
INDEXER_CACHE_SUFFIX = ".indexer.k_cache"


def strided_layer(name: str) -> bool:
    """Layers whose kernel needs the view's block stride to hold a whole page."""
    return name.endswith(INDEXER_CACHE_SUFFIX)


def stock_requests(orig: Callable, vllm_config: Any, kv_cache_specs: list[dict],
                   available_memory: list[int]) -> int | None:
    """Requests of max_model_len stock vLLM fits in the same budget: its own sizing and its
    own concurrency figure (the one it logs as "Maximum concurrency")."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    try:
        cfg = orig(vllm_config, kv_cache_specs, available_memory)[0]
        return int(get_max_concurrency_for_kv_cache_config(vllm_config, cfg))
    except Exception as err:  # noqa: BLE001 - a figure for the startup line only
        logger.debug("ulacache v4: stock's sizing for comparison failed: %s", err)
        return None


def csa_layers(specs: dict) -> dict:
    """The CSA compressed-row caches (compress ratio 4, not the indexer's keys) of one worker."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return {n: s for n, s in specs.items() if isinstance(s, MLAAttentionSpec)
            and s.tokens_per_state == CSA_RATIO and not strided_layer(n)}


CSA_RATIO = 4  # tokens per CSA compressed row


def plan_csa(vllm_config: Any, csa: dict, group: int, settings: UlaSettings) -> CsaRowsPlan:
    """The CSA rows' pools: device rows per layer (the setting, or one step's new rows plus
    one request's top-k), host rows per layer from ``--ula-host-pool-gib``, and the
    logical blocks they make (module doc). Refuses a host pool that holds less than one
    request of ``max_model_len``, naming the size that does."""
    from ..dsa.sizing import GIB, _layer_index

    specs = set(csa.values())
    if len(specs) != 1:
        raise KVBackendError(f"ulacache v4: the CSA layers declare {len(specs)} different cache "
                             f"specs; the v4 line places one. Use --kv-backend vllm.")
    spec = specs.pop()
    names = tuple(sorted(csa, key=_layer_index))
    rpb = spec.block_size // CSA_RATIO
    row = spec.real_page_size_bytes // rpb
    sched, mc = vllm_config.scheduler_config, vllm_config.model_config
    seqs = max(1, sched.max_num_seqs or 1)
    topk = int(getattr(mc.hf_text_config, "index_topk", 0) or 0)
    writes = -(-sched.max_num_batched_tokens // CSA_RATIO) + seqs
    # One step's new rows and one request's selection: the rest of a decode's reads are host
    # rows, read in place on the CPU build (promoted once read again) -- every running
    # request's top-k on the device would hold most rows of every request there.
    device_rows = settings.v4_csa_device_rows or writes + topk
    if device_rows < writes:
        raise KVBackendError(
            f"--ula-v4-csa-device-rows {device_rows} is smaller than one step's new CSA rows "
            f"({writes}: max_num_batched_tokens {sched.max_num_batched_tokens} / {CSA_RATIO} + "
            f"max_num_seqs {seqs}). Raise it to at least {writes}, or lower "
            f"--max-num-batched-tokens.")
    host_rows = int(settings.host_pool_gib * GIB) // (row * len(names))
    per_request = -(-mc.max_model_len // spec.block_size) * rpb
    if host_rows < per_request:
        need = math.ceil(per_request * row * len(names) / GIB * 1000) / 1000
        raise KVBackendError(
            f"ulacache host pool too small: --ula-host-pool-gib {settings.host_pool_gib} holds "
            f"{host_rows} DeepSeek-V4 CSA rows per layer ({row} B each over {len(names)} CSA "
            f"layers), fewer than one request of max_model_len={mc.max_model_len} "
            f"({per_request} rows). Set --ula-host-pool-gib to at least {need} or lower "
            f"--max-model-len.")
    num_blocks = (device_rows + host_rows) // rpb + 1  # + vLLM's null block
    return CsaRowsPlan(group, names, rpb, row, device_rows, host_rows, num_blocks)


def state_request_pages(vllm_config: Any) -> Callable:
    """The compressor-state pages a request holds at most under the v4 line (`states.py`):
    one window, and with prefix caching on a hit's tail before each of the two boundaries
    vLLM's retention rule keeps (the replay boundary, a junction); not the window plus a
    step's in-flight tokens vLLM's spec counts, since those pages are transient. None where
    the states keep their pages (a retention rule other than stock's 0)."""
    from .states import hit_tail_pages, is_state_group, transient_states, window_pages

    cc = vllm_config.cache_config
    if not transient_states(bool(cc.enable_prefix_caching), cc.prefix_cache_retention_interval,
                            False):
        return lambda names, spec: None

    def pages(names, spec):
        if not is_state_group(names):
            return None
        tails = 2 * hit_tail_pages(spec.sliding_window, spec.block_size) \
            if cc.enable_prefix_caching else 0
        return window_pages(spec.sliding_window, spec.block_size) + tails
    return pages


def _too_small(vllm_config: Any, rest: dict, avail: int, csa: CsaRowsPlan,
               settings: UlaSettings) -> str:
    """The startup error of a KV budget that cannot hold the CSA device rows and an arena
    for one request of max_model_len, with the budget that does."""
    from ..arena import sizing as arena_sizing

    probe, _ = arena_sizing.plan_arena(vllm_config, rest, 1 << 40, settings, strided_layer,
                                       state_request_pages(vllm_config))
    page = -(-max(g.page_bytes for g in probe.groups) // probe.alignment) * probe.alignment
    arena = probe.request_bytes() + probe.null_page_bytes + page + probe.alignment
    return (f"ulacache v4: the KV budget of {avail} bytes must hold the CSA device rows "
            f"({csa.device_rows} rows x {csa.row_bytes} B x {len(csa.layer_names)} layers = "
            f"{csa.device_bytes} bytes, --ula-v4-csa-device-rows) and an arena for one request "
            f"of max_model_len={probe.max_model_len} ({arena} bytes with its null page). Raise "
            f"the KV budget (--kv-cache-memory-bytes / VLLM_CPU_KVCACHE_SPACE) to at least "
            f"{arena + csa.device_bytes} bytes, or lower --max-model-len.")


@dataclasses.dataclass
class V4Layout(ArenaLayout):
    """The arena's layout (every V4 cache but the CSA rows) and the CSA rows' plan."""

    csa: CsaRowsPlan | None = None

    def manager_cls(self) -> type:
        from .manager import V4KVCacheManager

        return V4KVCacheManager

    def build_worker(self, vllm_config, settings, kv_caches: dict):
        from ..faults import MoveFaults
        from .worker import V4Worker

        return V4Worker(self, kv_caches, vllm_config, settings, MoveFaults.from_env())

    @property
    def csa_requests(self) -> int:
        """Requests of max_model_len the CSA pool holds (device and host rows)."""
        c = self.csa
        per = -(-self.max_model_len // (c.rows_per_block * CSA_RATIO))
        return (c.num_blocks - 1) // max(1, per)

    @property
    def max_requests(self) -> int:
        return min(super().max_requests, self.csa_requests)

    def summary(self, max_model_len: int | None = None) -> str:
        c = self.csa
        return (f"{super().summary(max_model_len)}; DeepSeek-V4 CSA rows in the logical "
                f"address space: {len(c.layer_names)} layers x {c.row_bytes} B rows, "
                f"{c.device_rows} device rows ({c.device_bytes} B) + {c.host_rows} host rows "
                f"({c.host_bytes} B) per layer, {c.num_blocks - 1} logical blocks of "
                f"{c.rows_per_block} rows ({self.csa_requests} requests of max_model_len)")


def get_kv_cache_configs(orig: Callable, vllm_config: Any, kv_cache_specs: list[dict],
                         available_memory: list[int],
                         settings: UlaSettings) -> list[UlaKVCacheConfig]:
    """The arena's configs over every cache but the CSA rows, with the CSA group appended
    (its layers get placeholder views of the shared buffer: the worker binds their pools)."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, KVCacheTensor

    from ..arena import sizing as arena_sizing

    stock = stock_requests(orig, vllm_config, kv_cache_specs, available_memory)
    plans = []
    with reported_to_front_end():
        for specs, avail in zip(kv_cache_specs, available_memory):
            csa = csa_layers(specs)
            if not csa:
                raise KVBackendError("ulacache v4: this DeepSeek-V4 model declares no CSA "
                                     "(compress ratio 4) layer. Use --kv-backend vllm.")
            rest = {n: s for n, s in specs.items() if n not in csa}
            probe = plan_csa(vllm_config, csa, 0, settings)
            try:
                layout, grouped = arena_sizing.plan_arena(vllm_config, rest,
                                                          avail - probe.device_bytes, settings,
                                                          strided_layer,
                                                          state_request_pages(vllm_config))
            except KVBackendError:
                raise KVBackendError(_too_small(vllm_config, rest, avail, probe, settings)) \
                    from None
            plan = dataclasses.replace(probe, group=len(grouped))
            fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(ArenaLayout)}
            plans.append((V4Layout(**fields, csa=plan), grouped, csa))
    layout = min((p[0] for p in plans), key=lambda lay: lay.total_bytes)
    layout.stock_requests = stock
    retention = vllm_config.cache_config.prefix_cache_retention_interval
    configs = []
    for _, grouped, csa in plans:
        names = list(layout.csa.layer_names)
        groups = [KVCacheGroupSpec(list(n), s) for n, s in grouped]
        groups.append(KVCacheGroupSpec(names, csa[names[0]]))
        tensors = [KVCacheTensor(size=layout.buffer_bytes, layers=list(g.layer_names),
                                 layer_stride=g.layer_page_bytes, block_stride=layout.alignment,
                                 offset=0) for g in layout.groups]
        # Placeholder views (4 bytes apart, vLLM's alignment, from byte 4: no other layer's
        # base, as vLLM's block zeroer wants; a few KiB of the shared buffer, never read or
        # written: the worker binds the pools before the first step).
        tensors.append(KVCacheTensor(size=layout.buffer_bytes, layers=names, layer_stride=4,
                                     block_stride=4, offset=4))
        configs.append(UlaKVCacheConfig(num_blocks=layout.num_granules,
                                        kv_cache_tensors=tensors, kv_cache_groups=groups,
                                        layout=layout,
                                        prefix_cache_retention_interval=retention))
    return configs


def prepare(vllm_config: Any, settings: UlaSettings) -> None:
    """What the V4 line does not run yet is refused, naming the fix; V4's own CPU settings
    (block size 256, the fp8 cache) stay as vLLM's platform sets them."""
    pc = vllm_config.parallel_config
    fix = " Use --kv-backend vllm for this setup."
    if pc.tensor_parallel_size > 1 or pc.pipeline_parallel_size > 1:
        raise KVBackendError(
            f"--kv-backend ulacache does not run DeepSeek-V4 with tensor or pipeline "
            f"parallelism yet (tensor_parallel_size {pc.tensor_parallel_size}, "
            f"pipeline_parallel_size {pc.pipeline_parallel_size}): its replicated caches under "
            f"the arena are verified on one rank only.{fix}")
    refuse_context_parallel(pc, "--kv-backend ulacache (DeepSeek-V4)", f" yet.{fix}")
    if vllm_config.speculative_config is not None:
        raise KVBackendError(
            "--kv-backend ulacache does not run speculative decoding with DeepSeek-V4: vLLM's "
            "CPU build has no V4 draft (its MTP and DSpark drafts raise NotImplementedError "
            "there). Drop --speculative-config.")
    sc = vllm_config.scheduler_config
    if sc.async_scheduling:
        # The arena fences a step's pages until its output is processed (one batch in flight).
        logger.info("ulacache v4: async scheduling is turned off (the arena runs with "
                    "synchronous scheduling)")
        sc.async_scheduling = False
