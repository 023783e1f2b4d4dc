"""Fuzz driver for the v4 line's scheduler side and its worker halves together (no model, no V4
kernel: it runs on every host), against a reference of what each request holds and what each
page and CSA row must contain.

DeepSeek-V4's caches are built with vLLM's own spec classes from a V4 config
(`planner.v4_check.vllm_specs`: the parameters V4's ``get_kv_cache_spec`` methods pass), sized
by the line (`engine.v4.sizing.get_kv_cache_configs`) with a small device pool and host pool,
and run through a real `V4KVCacheManager` (vLLM's managers over the arena, the CSA group on its
logical block pool). Random admit (whole or chunked prefill, prefix hits) / decode / finish /
preempt / abort / reset sequences run one engine step at a time: schedule, take the step's
payload, hand the arena's plan to a real `ArenaWorker` and the dead CSA blocks to a real
`CsaRows` (its `begin` with the step's CSA slot mapping, computed as vLLM's V4 metadata does:
the row of every 4th token through the CSA block table), "run the forward" (fill every new page
with a value of its own; write every new CSA row with a value that is a function of the layer
and the tokens it compresses, so a prefix hit's rows are checked too; read a random selection
of each scheduled request's rows through ``resolve``, as the attention does, which drives the
settles that promote), mark the step processed. After every step:

* the arena's live pages are exactly the pages requests hold (with prefix caching: held or
  free-but-cached; ref counts match); live pages, free extents and withheld bytes tile the
  arena; every page holds the value written into it, wherever it moved;
* every request holds one indexer-key and one HCA page per 256 tokens, its newest window and
  state pages real; one CSA block per 256 tokens, none held twice (or ref counts match);
  the CSA pool's free blocks are the total less the held and cached ones;
* every CSA row a request has computed is mapped (device or host, never both), and holds the
  value of its layer and tokens; a read through ``resolve`` returns it.

With ``fault_every``, a copy fails now and then (an arena page move or a CSA row demotion,
promotion or staging copy, `engine/faults.py`): the requests holding what it lost (pages, or
CSA blocks whose rows it dropped, reported as the worker does) end with an error through the
manager's `lost_block_owners`, and only those; everything above still holds for the others.

At the end everything is released (and the cache reset): the arena holds only its null page,
the CSA pool is all free, the CSA rows' tables are empty.
`tests/test_v4_fuzz.py` runs a few hundred steps.
"""
from __future__ import annotations

import random
import zlib
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from lab.arena_fuzz import Harness, Requests, check_tiling

CSA_RATIO = 4
CONFIG = dict(num_hidden_layers=4, compress_ratios=[0, 4, 128, 4], head_dim=512,
              qk_rope_head_dim=64, index_head_dim=128, sliding_window=128, index_topk=512)
# Layer schedules (compress ratio per layer: 0 window only, 4 CSA, 128 HCA) the long runs draw.
SCHEDULES = ([0, 4, 128, 4], [4, 128], [4], [0, 0, 4, 128, 4, 128], [4, 4, 128, 128, 4])


def v4_config(ratios: list[int]) -> dict:
    return dict(CONFIG, num_hidden_layers=len(ratios), compress_ratios=list(ratios))


@dataclass
class V4FuzzStats:
    ops: dict = field(default_factory=dict)
    steps: int = 0
    refused: int = 0  # admissions the arena's bytes or the CSA pool could not hold
    preempted: int = 0
    hit_tokens: int = 0
    resets: int = 0
    rows_written: int = 0
    rows_read: int = 0
    lost_pages: int = 0  # arena pages a failed copy lost (``fault_every``)
    lost_csa_blocks: int = 0  # CSA logical blocks whose rows a failed copy lost
    csa: dict = field(default_factory=dict)  # the CSA rows' counters at the end
    arena: dict = field(default_factory=dict)  # the manager's figures at the end


class _CacheConfig:
    num_gpu_blocks_override = None
    kv_cache_layout = "NHD"
    mamba_cache_mode = "none"
    block_size = 256
    prefix_match_unit = None

    def __init__(self, caching: bool, retention: int | None) -> None:
        self.enable_prefix_caching = caching
        self.prefix_cache_retention_interval = retention


def vllm_config(cfg: dict, max_model_len: int, batch: int, seqs: int, caching: bool,
                retention: int | None = 0):
    """The fields of `VllmConfig` the v4 line's sizing and vLLM's block-size rule read."""
    hf = SimpleNamespace(**cfg)
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len, hf_config=hf,
                                     hf_text_config=hf),
        scheduler_config=SimpleNamespace(
            max_num_batched_tokens=batch, max_num_scheduled_tokens=batch,
            enable_chunked_prefill=True, max_num_seqs=seqs, async_scheduling=False,
            disable_hybrid_kv_cache_manager=False),
        cache_config=_CacheConfig(caching, retention),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, data_parallel_size=1, pipeline_parallel_size=1,
            decode_context_parallel_size=1, prefill_context_parallel_size=1),
        speculative_config=None, kv_transfer_config=None, max_in_flight_tokens=batch,
        max_concurrent_batches=1, additional_config={})


def manager(arena_bytes: int, host_gib: float, device_rows: int, *, cfg: dict = CONFIG,
            max_model_len: int = 2048, batch: int = 512, seqs: int = 4, caching: bool = False,
            force_moves: int = 0):
    """A `V4KVCacheManager` over the line's own sizing of V4's specs (vLLM's classes)."""
    import dataclasses

    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    from ulacache_vllm.engine.config import UlaSettings
    from ulacache_vllm.engine.v4 import sizing
    from ulacache_vllm.planner.v4_check import vllm_specs
    from ulacache_vllm.planner.v4_layout import v4_caches

    vc = vllm_config(cfg, max_model_len, batch, seqs, caching)
    specs = vllm_specs(v4_caches(cfg), cfg)
    settings = UlaSettings(host_pool_gib=host_gib, v4_csa_device_rows=device_rows)

    def no_stock(*_):
        raise RuntimeError("stock's figure is not needed here")

    csa = sizing.plan_csa(vc, sizing.csa_layers(specs), 0, settings)
    cfg = sizing.get_kv_cache_configs(no_stock, vc, [specs], [arena_bytes + csa.device_bytes],
                                      settings)[0]
    # Every kind's new pages zeroed (V4's fp8 caches are not, in the engine): the step plan
    # then names every new page, which the harness refills (placement is unchanged).
    lay = cfg.layout
    cfg.layout = dataclasses.replace(
        lay, groups=[dataclasses.replace(g, zeroed=True) for g in lay.groups],
        zero_new_pages=True, force_moves_every=force_moves)
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(cfg, vc)
    mgr = cfg.layout.manager_cls()(cfg, max_model_len=max_model_len,
                                   scheduler_block_size=sched_bs, hash_block_size=hash_bs,
                                   enable_caching=caching, max_in_flight_tokens=batch,
                                   log_stats=caching)
    return mgr, settings, hash_bs


def row_chain(tokens: list[int], chain: list[int]) -> list[int]:
    """``chain`` extended to every complete row of ``tokens``: row r's CRC over tokens
    ``0 .. 4r + 3`` (a compressed row depends on the whole prefix through the layers below)."""
    for r in range(len(chain), len(tokens) // CSA_RATIO):
        part = torch.tensor(tokens[CSA_RATIO * r:CSA_RATIO * r + CSA_RATIO], dtype=torch.int32)
        chain.append(zlib.crc32(part.numpy().tobytes(), chain[-1] if chain else 0))
    return chain


def row_value(layer: int, crc: int) -> int:
    """What a CSA row holds: a function of its layer and its prefix's CRC (`row_chain`)."""
    return zlib.crc32(bytes([layer]), crc) % 255 + 1


class V4Harness(Harness):
    """The arena fuzz's harness (pages, fills, hashes) over the v4 payload, plus the CSA rows."""

    def __init__(self, mgr, settings, rng: random.Random) -> None:
        from ulacache_vllm.engine.v4.rows import CsaRows
        from ulacache_vllm.engine.v4.worker import csa_lost_id

        super().__init__(mgr)
        self.lost_id = csa_lost_id
        self.lost_csa: set[int] = set()
        self.rng = rng
        self.csa_group = mgr.layout.csa.group
        self.csa = CsaRows(mgr.layout.csa, settings.lru, settings.promote_after)
        self.rows_written = self.rows_read = 0
        self._chains: dict[str, list[int]] = {}

    def values(self, req, layer: int, rows: list[int]) -> list[int]:
        chain = row_chain(req.all_token_ids, self._chains.setdefault(req.request_id, []))
        return [row_value(layer, chain[r]) for r in rows]

    def arena_ids(self, rid: str) -> list[list[int]]:
        ids = self.mgr.get_block_ids(rid)
        return [g for i, g in enumerate(ids) if i != self.csa_group]

    def csa_ids(self, rid: str) -> list[int]:
        return list(self.mgr.get_block_ids(rid)[self.csa_group])

    def _slot(self, blocks: list[int], row: int) -> int:
        rpb = self.mgr.layout.csa.rows_per_block
        return blocks[row // rpb] * rpb + row % rpb

    def step(self, schedule):
        """One engine step (`Harness.step`'s order) with the CSA rows' contract: the dead
        blocks freed, `begin` with the step's slot mapping, the new rows written at their
        write slots, a selection of each scheduled request's rows read and checked."""
        mgr = self.mgr
        mgr.new_step_starts()
        scheduled = schedule()
        payload = mgr.take_step()
        plan = payload.plan
        self.csa.free(payload.csa_dead)
        self.worker.apply(plan)
        self.lost = self.worker.take_lost()
        for vid in self.lost:  # (their requests are the caller's to end)
            self.content.pop(vid, None)
            self.by_hash = {k: v for k, v in self.by_hash.items() if k[1] != vid}
        for vid in mgr.arena.p2v(plan.new[:, 0]).tolist():  # (every kind zeroed: `manager`)
            self.content.pop(vid, None)  # a new page (a recycled vid): refilled below
            self.by_hash = {k: v for k, v in self.by_hash.items() if k[1] != vid}
            assert bool((self.page(vid) == 0).all()), f"new page {vid} not zeroed"
        self.check_pages()
        slots, written = [], []  # the CSA slot mapping of the step (one row per 4th token)
        for req, n in scheduled.items():
            blocks = self.csa_ids(req.request_id)
            for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
                if (p + 1) % CSA_RATIO == 0:
                    slots.append(self._slot(blocks, p // CSA_RATIO))
                    written.append((req, p // CSA_RATIO))
                else:
                    slots.append(-1)
        self.csa.begin(torch.tensor(slots, dtype=torch.int64) if slots else None)
        # Rows a failed copy dropped: their requests end after the step (the caller), as the
        # worker reports them (`V4Worker.take_lost`); the forward does not read them.
        self.lost_csa = self.csa.take_lost()
        self.lost |= {self.lost_id(b) for b in self.lost_csa}
        for li, rows in enumerate(self.csa.layers.values()):  # the compressor's writes
            if not slots:
                break
            keep = rows.write_slots >= 0
            assert bool((keep == (torch.tensor(slots) >= 0)).all()), "a new row without a row"
            vals = torch.tensor([self.values(req, li, [r])[0] for req, r in written],
                                dtype=torch.uint8)
            rows.rows2d[rows.write_slots[keep]] = vals.unsqueeze(1).expand(-1, rows.rows2d.shape[1])
            self.rows_written += len(written)
        for req, n in scheduled.items():
            req.num_computed_tokens += n
            for ids in self.arena_ids(req.request_id):
                for vid in ids:
                    if vid and vid not in self.content:
                        self.fill(vid)
        self.read_rows(scheduled)
        self.check_hashes()
        mgr.step_processed(payload)
        self.plan = plan
        return scheduled

    def check_pages(self) -> None:
        """`Harness.check_pages` on every 61st byte of each page (V4's pages reach 150 KB):
        a page moved onto another's bytes, or not moved, still shows."""
        live = {int(v) for v in self.mgr.arena.live_pages()[0]} - {0}
        for vid in list(self.content):
            if vid not in live:
                del self.content[vid]
        for vid, val in self.content.items():
            page = self.page(vid)
            sample = torch.cat([page[::61], page[-1:]])
            assert bool((sample == val).all()), f"page {vid} lost its bytes ({val}: {page[:4]})"

    def read_rows(self, scheduled) -> None:
        """The attention's reads: a random selection of each scheduled request's computed rows
        through ``resolve`` (kept for the next settle, which promotes), checked."""
        for req in scheduled:
            n_rows = req.num_computed_tokens // CSA_RATIO
            blocks = self.csa_ids(req.request_id)
            if not n_rows or self.lost_csa.intersection(blocks):
                continue
            pick = sorted(self.rng.sample(range(n_rows), min(n_rows, self.rng.randint(1, 48))))
            logical = torch.tensor([self._slot(blocks, r) for r in pick])
            for li, rows in enumerate(self.csa.layers.values()):
                phys = rows.resolve(logical)
                assert bool((phys >= 0).all()), f"{req.request_id}: a computed row is unmapped"
                got = rows.rows2d[phys, 0].tolist()
                want = self.values(req, li, pick)
                assert got == want, f"{req.request_id} layer {li}: rows {pick} hold {got}"
                self.rows_read += len(pick)

    def check_rows(self, live: dict) -> None:
        """Every computed row of every live request: mapped in one tier, holding its value."""
        for req in live.values():
            n_rows = req.num_computed_tokens // CSA_RATIO
            if not n_rows:
                continue
            blocks = self.csa_ids(req.request_id)
            logical = torch.tensor([self._slot(blocks, r) for r in range(n_rows)])
            for li, rows in enumerate(self.csa.layers.values()):
                dev, host = rows.mapping.locate(logical)
                assert bool(((dev >= 0) ^ (host >= 0)).all()), \
                    f"{req.request_id}: a row mapped in neither tier or both"
                got = rows.rows2d[rows.physical(logical), 0].tolist()
                want = self.values(req, li, list(range(n_rows)))
                assert got == want, f"{req.request_id} layer {li}: a row lost its bytes"


def _check_holdings(mgr, h: V4Harness, live: dict, caching: bool) -> None:
    """What each request holds, and that the pools hold nothing else (module doc)."""
    csa_held, arena_held = [], []
    groups = mgr.kv_cache_config.kv_cache_groups
    for req in live.values():
        n = req.num_computed_tokens
        for gi, (g, blocks) in enumerate(zip(groups, mgr.get_block_ids(req.request_id))):
            spec = g.kv_cache_spec
            real = [b for b in blocks if b]
            if gi == h.csa_group:
                assert len(real) == len(blocks) == -(-n // spec.block_size), \
                    (req.request_id, "CSA", len(blocks), n)
                csa_held.extend(real)
                continue
            arena_held.extend(real)
            if getattr(spec, "sliding_window", None) is None:  # indexer keys, HCA rows
                assert len(real) == len(blocks) == -(-n // spec.block_size), \
                    (req.request_id, g.layer_names[0], len(blocks), n)
            elif n:
                assert len(blocks) == -(-n // spec.block_size) and blocks[-1], \
                    (req.request_id, g.layer_names[0], "the newest window/state page", blocks)
    pool = mgr.csa_pool
    free = pool.get_num_free_blocks()
    live_vids = set(mgr.arena.live_pages()[0].tolist()) - {0}
    if not caching:
        assert len(csa_held) == len(set(csa_held)), "a CSA block held twice"
        assert free == pool.num_gpu_blocks - 1 - len(csa_held), (free, len(csa_held))
        assert len(arena_held) == len(set(arena_held)), "an arena page held twice"
        assert live_vids == set(arena_held), f"leaked pages {sorted(live_vids - set(arena_held))}"
        return
    for b, k in Counter(csa_held).items():
        assert pool.blocks[b].ref_cnt == k, ("CSA", b, pool.blocks[b].ref_cnt, k)
    assert free == pool.num_gpu_blocks - 1 - len(set(csa_held)), (free, len(set(csa_held)))
    st = mgr._state
    holders = Counter(arena_held)
    lru = {v for p in st.pools for v in p.lru}
    assert not lru & set(holders), "a held page in the free-but-cached LRU"
    for v, k in holders.items():
        assert st.live[v].ref_cnt == k, (v, st.live[v].ref_cnt, k)
    assert live_vids == set(holders) | lru, f"leaked pages {sorted(live_vids - set(holders) - lru)}"


def run(seed: int, num_steps: int, *, caching: bool = False, arena_requests: float = 2.5,
        host_requests: float = 2.5, force_moves: int = 0, max_model_len: int = 2048,
        batch: int = 512, ratios: list[int] | None = None,
        fault_every: int = 0, csa_faults: bool = False) -> V4FuzzStats:
    """``num_steps`` engine steps of random operations. The arena holds about
    ``arena_requests`` requests of max_model_len, the CSA host pool ``host_requests``, the
    CSA device pool one step's new rows and a little more (so rows live on the host);
    ``ratios``: the layer schedule (`CONFIG`'s by default); ``fault_every``: about one step in
    this many has a failing arena copy (0: none): the requests holding a lost page end, and only
    those (a CSA block id is no arena page); ``csa_faults``: the failing copy is a CSA row
    move half the time (demotion, promotion or staging). Runs on one thread: page-sized
    tensor ops are far slower over OpenMP's threads, and slower still on a busy host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(seed, num_steps, caching, arena_requests, host_requests, force_moves,
                    max_model_len, batch, ratios, fault_every, csa_faults)
    finally:
        torch.set_num_threads(threads)


def _run(seed, num_steps, caching, arena_requests, host_requests, force_moves, max_model_len,
         batch, ratios, fault_every, csa_faults) -> V4FuzzStats:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from ulacache_vllm.engine.dsa.sizing import GIB
    from ulacache_vllm.engine.faults import MoveFaults

    rng = random.Random(seed)
    seqs = 4
    rows_per_request = max_model_len // CSA_RATIO
    cfg = v4_config(ratios) if ratios else CONFIG
    csa_layers = cfg["compress_ratios"].count(4)
    host_gib = (host_requests * rows_per_request * 584 * csa_layers + 1) / GIB
    device_rows = batch // CSA_RATIO + seqs + rng.randint(0, 64)
    probe, _, _ = manager(1 << 30, host_gib, device_rows, cfg=cfg, max_model_len=max_model_len,
                          batch=batch, seqs=seqs, caching=caching)
    per_request = probe.layout.request_bytes()
    arena = int(arena_requests * per_request) + probe.layout.null_page_bytes
    mgr, settings, hash_bs = manager(arena, host_gib, device_rows, cfg=cfg,
                                     max_model_len=max_model_len, batch=batch, seqs=seqs,
                                     caching=caching, force_moves=force_moves)
    hasher = None
    if caching:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        hasher = get_request_block_hasher(hash_bs, sha256)
        prng = random.Random(seed + 1000)
        prefixes = [[prng.randint(1, 999) for _ in range(prng.randint(1, 4) * 256
                                                          + prng.randint(0, 40))]
                    for _ in range(3)]
    h = V4Harness(mgr, settings, random.Random(seed + 7))
    stats = V4FuzzStats()
    reqs = Requests(mgr, stats)
    live, waiting, prefill_left = reqs.live, reqs.waiting, reqs.prefill_left
    end = reqs.end
    counter = 0
    sent: list[list[int]] = []  # every prompt so far (some are sent again)

    def schedule() -> dict:
        """vLLM's order: running requests (the next prefill chunk or one decoded token),
        preempting the newest while one does not fit; then waiting ones, within the step's
        token budget and max_num_seqs."""
        done: dict = {}
        budget = batch
        for req in list(live.values()):
            if req.request_id not in live:
                continue  # preempted for an older request this step
            left = prefill_left.get(req.request_id, 0)
            if left:
                n = min(left, budget, rng.choice((64, 256, 300, batch)))
            elif req.num_tokens >= max_model_len - 1:
                end(req, "finish")
                continue
            else:
                n = 1
            if n <= 0:
                continue
            if not left:
                req.append_output_token_ids(rng.randint(1, 999))
            if reqs.scheduled(req, n, left):
                done[req] = n
                budget -= n
        for req in [r for r in done if r.request_id not in live]:
            del done[req]
        for req in list(waiting[:rng.randint(0, 2)]):
            if len(live) >= seqs or budget <= 0:
                break
            hit_blocks, hit = None, 0
            if caching:
                hit_blocks, hit = mgr.get_computed_blocks(req)[:2]
            todo = req.num_tokens - hit
            n = min(todo, budget)
            if mgr.allocate_slots(req, n, num_new_computed_tokens=hit,
                                  new_computed_blocks=hit_blocks) is None:
                stats.refused += 1
                break
            reqs.admitted(req, hit, todo - n)
            done[req] = n
            budget -= n
        return done

    for _ in range(num_steps):
        if fault_every and rng.random() < 1 / fault_every:
            if csa_faults and rng.random() < 0.5:
                moves = rng.choice((("demote",), ("promote",), ("stage",),
                                    ("demote", "promote", "stage")))
                h.csa.faults = MoveFaults("raise", moves=moves, count=1,
                                          skip=rng.randint(0, 2))
            else:
                h.worker.faults = MoveFaults("raise", moves=("arena",), count=1)
        reqs.leave(rng, finish=0.02, abort=0.04)
        stats.resets += bool(reqs.maybe_reset(rng) if caching else None)
        while len(waiting) < 3:
            counter += 1
            n = rng.randint(1, max_model_len - 64)
            tokens = [rng.randint(1, 999) for _ in range(n)]
            if caching and sent and rng.random() < 0.3:  # an earlier prompt, extended or not
                tokens = (rng.choice(sent) + tokens[:rng.choice((0, 0, 8, 300))])
                tokens = tokens[:max_model_len - 64]
            elif caching and rng.random() < 0.6:  # a shared prefix
                tokens = (rng.choice(prefixes) + tokens)[:max_model_len - 64]
            sent.append(tokens)
            waiting.append(Request(f"r{counter}", tokens, SamplingParams(max_tokens=1 << 20),
                                   None, block_hasher=hasher))
        h.step(schedule)
        if h.lost:  # the scheduler ends the requests holding lost pages or rows (an error)
            lost_csa = h.lost_csa
            stats.lost_pages += len(h.lost) - len(lost_csa)
            stats.lost_csa_blocks += len(lost_csa)

            def holds(rid):
                return (any(h.lost.intersection(ids) for ids in h.arena_ids(rid))
                        or bool(lost_csa.intersection(h.csa_ids(rid))))
            for rid in sorted(mgr.lost_block_owners(h.lost, live.values())):
                assert holds(rid), f"{rid} ended by a lost page or row it does not hold"
                end(live[rid], "ended_by_fault")
            for req in live.values():
                assert not holds(req.request_id), f"{req.request_id} lost KV and runs on"
            if caching:  # no lost CSA block is a prefix hit again
                assert not any(mgr.csa_pool.blocks[b].block_hash for b in lost_csa), \
                    "a lost CSA block stays in the prefix cache"
        stats.steps += 1
        _check_holdings(mgr, h, live, caching)
        h.check_rows(live)
        check_tiling(mgr.arena)
    for req in list(live.values()):
        end(req, "finish")
    if caching:
        assert mgr.reset_prefix_cache(), "the cache did not reset with nothing held"
    h.step(dict)  # an empty step: the last frees reach the worker, the fences pass
    assert mgr.arena.used_bytes == mgr.arena.page_bytes[0], "arena pages left after every free"
    assert mgr.arena.pending_bytes == 0, "arena bytes still withheld"
    pool = mgr.csa_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, "CSA blocks left"
    c = h.csa.counters()
    assert c["device_used"] == 0 and c["host_used"] == 0, f"CSA rows left: {c}"
    stats.csa = c
    stats.arena = mgr.stats()
    stats.rows_written, stats.rows_read = h.rows_written, h.rows_read
    return stats
