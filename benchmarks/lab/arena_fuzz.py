"""Fuzz driver for the arena's scheduler side and its worker together, against a reference
model of which request holds which pages and what each page holds.

Random admit (whole or chunked prefill) / decode / finish / preempt / abort sequences run on a
real `ArenaKVCacheManager` (vLLM's full-attention, sliding-window and state managers over the
arena, no engine), one engine step at a time: schedule (with compactions and relayouts when
an admission needs room, and forced every few steps), ship the step plan to a real
`ArenaWorker` over a byte buffer, "run the forward" (fill every new page with a value of its
own), mark the step processed. Optionally the worker's copies fail now and then
(``faults``): the requests holding lost pages are ended, as the scheduler does. After every
step:

* no page is held twice, by two requests or two groups; the null page is never handed out;
  the arena's live pages are exactly the pages requests hold (no leak);
* every request holds the pages its tokens need: one full-attention page per 32 tokens, one
  state page, and at most the window's pages of the sliding group (the rest are null);
* live pages, free extents and withheld bytes tile the arena exactly;
* the worker's copy of every page holds the value written into it, wherever the page now
  lives; new pages reach the forward zeroed where the layout zeroes them.

With ``caching`` vLLM's prefix caching runs over the arena: prompts start with one of a few
shared prefixes, admissions take prefix hits (vLLM's own lookup), the state kind runs Mamba's
"align" mode, and now and then the cache is reset. Then also: a page is held by as many
requests as its ref count says; every live page is held or free-but-cached (hashed, in its
pool's LRU); a hash names the same bytes for as long as it is cached (a cached page keeps the
value its first writer gave it, across moves, until it is evicted); cold cached pages are
evicted when the arena needs room.

At the end everything is released (and the cache reset): the arena holds only its null page
and withholds nothing.
`tests/test_arena_fuzz.py` runs a few hundred steps; `benchmarks/fuzz_manager.py --arena`
runs 10^5 operations or more.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

BS = 32
MAX_LEN = 512
WINDOW = 64


@dataclass
class ArenaFuzzStats:
    ops: dict = field(default_factory=dict)
    steps: int = 0
    refused: int = 0  # admissions the byte gate or the ladder could not place
    preempted: int = 0
    compactions: int = 0
    relayouts: int = 0
    bytes_copied: int = 0
    zeroed_pages: int = 0
    lost_pages: int = 0
    ended_by_faults: int = 0
    hit_tokens: int = 0  # prompt tokens admissions took from the prefix cache
    cache_evictions: int = 0
    cached_pages_moved: int = 0
    state_moves_saved: int = 0  # decode crossings that kept the GDN state in its page
    resets: int = 0


def specs(caching: bool = False):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32,
                            sliding_window=WINDOW)
    # A state page of 3 KiB next to 2 KiB attention pages: the alignment is 1 KiB.
    state = MambaSpec(block_size=MAX_LEN, shapes=((3, 256),), dtypes=(torch.float32,))
    if caching:  # "align": a state checkpoint per page, as the engine runs it with caching
        state = MambaSpec(block_size=BS, shapes=((3, 256),), dtypes=(torch.float32,),
                          mamba_cache_mode="align")
    return {"sliding": ("l0", swa), "full": ("l1", full), "state": ("l2", state)}


def manager(total_bytes: int, force_moves: int = 0, caching: bool = False,
            zero_new_pages: bool = True, retention: int | None = None):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from ulacache_vllm.engine.arena.manager import ArenaKVCacheManager
    from ulacache_vllm.engine.arena.sizing import ArenaGroup, ArenaLayout
    from ulacache_vllm.engine.line import UlaKVCacheConfig

    sp = specs(caching)
    bands = {"sliding": "low", "full": "high", "state": "low"}
    per_req = {"sliding": WINDOW // BS + 2, "full": MAX_LEN // BS, "state": 1}
    groups = [ArenaGroup(k, bands[k], (name,), spec.page_size_bytes, spec.block_size, per_req[k])
              for k, (name, spec) in sp.items()]
    pages = [g.page_bytes for g in groups]
    align = 1 << min((p & -p).bit_length() - 1 for p in pages)
    total = total_bytes // align * align
    layout = ArenaLayout(groups, align, total, total + max(pages), total + max(pages), MAX_LEN,
                         force_moves_every=force_moves, zero_new_pages=zero_new_pages)
    cfg = KVCacheConfig(num_blocks=layout.num_granules, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec([n], s) for n, s in sp.values()],
                        prefix_cache_retention_interval=retention)
    cfg = UlaKVCacheConfig.of(cfg, layout)
    sched_bs = math.lcm(*(s.block_size for _, s in sp.values()))  # as vLLM computes it
    return ArenaKVCacheManager(cfg, max_model_len=MAX_LEN, scheduler_block_size=sched_bs,
                               hash_block_size=BS, enable_caching=caching,
                               max_in_flight_tokens=BS, log_stats=caching)


def worker(mgr):
    from ulacache_vllm.engine.arena.worker import ArenaWorker

    buf = torch.zeros(mgr.layout.buffer_bytes, dtype=torch.int8)
    return ArenaWorker(mgr.layout, {n: buf for g in mgr.layout.groups for n in g.layer_names})


class Harness:
    """Drives the manager the way vLLM's scheduler and the connector do, one step at a time,
    and keeps each page's expected value to check the worker's copy of the arena."""

    def __init__(self, mgr) -> None:
        self.mgr, self.worker = mgr, worker(mgr)
        self.content: dict[int, int] = {}  # vid -> the byte value its page was filled with
        self.next_fill = 1
        self.lost: set[int] = set()
        self.by_hash: dict = {}  # block hash -> the value of the page cached under it

    def step(self, schedule):
        """One engine step. ``schedule()`` allocates this step's slots through the manager
        and returns {request: new tokens} for the requests it scheduled; the step's plan then
        goes to the worker, every page is checked, new pages are filled, and the step is
        marked processed. Returns what ``schedule`` did; ``self.plan`` is the step's plan,
        ``self.lost`` the vids a failed copy lost
        (their requests are the caller's to end)."""
        self.mgr.new_step_starts()
        scheduled = schedule()
        plan = self.mgr.take_step()
        self.worker.apply(plan)
        self.lost = self.worker.take_lost()
        for vid in self.lost:
            self.content.pop(vid, None)  # not checked, refilled below
            self.by_hash = {k: v for k, v in self.by_hash.items() if k[1] != vid}
        for vid in self.mgr.arena.p2v(plan.new[:, 0]).tolist():
            self.content.pop(vid, None)  # a new page (a recycled vid): refilled below
            self.by_hash = {k: v for k, v in self.by_hash.items() if k[1] != vid}
            if self.mgr.layout.zero_new_pages:
                assert bool((self.page(vid) == 0).all()), f"new page {vid} not zeroed"
        self.check_pages()
        for req, n in scheduled.items():
            req.num_computed_tokens += n
            for ids in self.mgr.get_block_ids(req.request_id):
                for vid in ids:
                    if vid and vid not in self.content:
                        self.fill(vid)
        self.check_hashes()
        self.mgr.step_processed(plan)
        self.plan = plan
        return scheduled

    def check_hashes(self) -> None:
        """A hash names the same bytes for as long as it is cached."""
        # (vLLM does not dedup: two pages may carry one hash, each its own bytes.)
        cached = {(b.block_hash, v): v for v, b in self.mgr._state.live.items()
                  if b.block_hash is not None}
        self.by_hash = {k: val for k, val in self.by_hash.items() if k in cached}
        for k, vid in cached.items():
            if vid not in self.content:
                continue  # lost by a failed copy: evicted by the scheduler's hook
            want = self.by_hash.setdefault(k, self.content[vid])
            assert self.content[vid] == want, f"hash of page {vid} names other bytes"

    def page(self, vid: int) -> torch.Tensor:
        off = int(self.worker.v2g[vid]) * self.mgr.layout.alignment
        return self.worker.buf[off:off + self.mgr.arena.page_bytes[self.kind(vid)]]

    def kind(self, vid: int) -> int:
        return int(self.mgr.arena._ids.kind_of([vid])[0])

    def fill(self, vid: int) -> None:
        self.content[vid] = self.next_fill % 127 + 1
        self.next_fill += 1
        self.page(vid).fill_(self.content[vid])

    def check_pages(self) -> None:
        live = {int(v) for v in self.mgr.arena.live_pages()[0]} - {0}
        for vid in list(self.content):
            if vid not in live:
                del self.content[vid]  # freed (its vid may come back for a new page)
        for vid, val in self.content.items():
            page = self.page(vid)
            assert bool((page == val).all()), f"page {vid} lost its bytes ({val}: {page[:4]})"


def check_tiling(arena) -> None:
    """Live pages, free extents and withheld bytes tile the arena exactly."""
    _, offs, sizes = arena.live_pages()
    spans = sorted([(int(o), int(o + n)) for o, n in zip(offs, sizes)] + list(arena.free_extents())
                   + [(o, o + n) for o, (n, _) in arena.ledger.pending().items()])
    pos = 0
    for a, b in spans:
        assert a == pos, f"gap or overlap at {pos}..{a}"
        pos = b
    assert pos == arena.total_bytes


def _check_holdings(mgr, live: dict, last: dict, caching: bool = False) -> None:
    """``last``: each request's tokens of the step just run (vLLM drops the window's old
    pages at a request's next allocation, so a prefill holds all of its chunk's pages)."""
    held = []
    kinds = list(specs(caching))
    for req in live.values():
        ids = mgr.get_block_ids(req.request_id)
        for kind, blocks in zip(kinds, ids):
            real = [b for b in blocks if b]
            held.extend(real)
            n = req.num_computed_tokens
            if kind == "full":
                assert len(real) == len(blocks) == -(-n // BS), (req.request_id, kind, blocks, n)
            elif kind == "sliding":
                assert len(blocks) == -(-n // BS), (req.request_id, kind, blocks, n)
                most = -(-(WINDOW + last.get(req.request_id, 0)) // BS) + 1
                assert len(real) <= most, (req.request_id, kind, blocks, most)
                assert blocks[-1], (req.request_id, "the newest sliding page is null")
            elif caching:  # align: the running state (+ last step's, freed next step)
                assert 1 <= len(real) <= 3 and blocks[-1], (req.request_id, kind, blocks)
            else:
                assert len(real) == 1, (req.request_id, kind, blocks)
    assert 0 not in held, "the null page handed out"
    live_vids = set(mgr.arena.live_pages()[0].tolist()) - {0}
    if not caching:
        assert len(held) == len(set(held)), "a page held twice"
        assert live_vids == set(held), f"leaked pages {sorted(live_vids - set(held))[:8]}"
        return
    st = mgr._state
    holders: dict[int, int] = {}
    for v in held:
        holders[v] = holders.get(v, 0) + 1
    lru = {v for p in st.pools for v in p.lru}
    assert not lru & set(holders), "a held page in the free-but-cached LRU"
    for v in lru:
        assert st.live[v].ref_cnt == 0 and st.live[v].block_hash is not None, v
    for v, n in holders.items():
        assert st.live[v].ref_cnt == n, (v, st.live[v].ref_cnt, n)
    assert live_vids == set(holders) | lru, f"leaked pages {sorted(live_vids - set(holders) - lru)[:8]}"
    assert set(st.live) == live_vids, "a live block without its page (or the reverse)"


class Requests:
    """A fuzz run's requests as vLLM's scheduler keeps them: running ones holding pages (in
    arrival order), waiting ones (new or preempted: no pages), the prompt tokens each running
    one has yet to compute; each operation is counted in ``stats.ops`` (preemptions also in
    ``stats.preempted``). Shared by this driver and `v4_fuzz`."""

    def __init__(self, mgr, stats) -> None:
        self.mgr, self.stats = mgr, stats
        self.live: dict = {}
        self.waiting: list = []
        self.prefill_left: dict[str, int] = {}

    def bump(self, op: str) -> None:
        self.stats.ops[op] = self.stats.ops.get(op, 0) + 1

    def end(self, req, op: str) -> None:
        self.mgr.free(req)
        self.live.pop(req.request_id, None)
        self.prefill_left.pop(req.request_id, None)
        self.bump(op)

    def preempt(self, victim) -> None:
        from vllm.v1.request import RequestStatus

        self.end(victim, "preempt")
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        self.waiting.append(victim)
        self.stats.preempted += 1

    def scheduled(self, req, n: int, left: int) -> bool:
        """``n`` more tokens of running ``req`` (``left``: its prompt tokens not computed yet,
        0 when it decodes), preempting the newest running request while they do not fit (vLLM's
        rule); False when ``req`` itself was preempted."""
        while self.mgr.allocate_slots(req, n) is None:
            self.preempt(list(self.live.values())[-1])
            if req.request_id not in self.live:
                return False
        self.prefill_left[req.request_id] = left - n if left else 0
        self.bump("prefill_chunk" if left else "decode")
        return True

    def admitted(self, req, hit: int, left: int) -> None:
        """``req`` got its slots: running, ``hit`` prompt tokens from the prefix cache, ``left``
        prompt tokens still to compute after this step (``stats.hit_tokens`` counts hits)."""
        from vllm.v1.request import RequestStatus

        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = hit
        self.stats.hit_tokens += hit
        self.waiting.remove(req)
        self.live[req.request_id] = req
        self.prefill_left[req.request_id] = left
        self.bump("admit_hit" if hit else "admit")

    def leave(self, rng: random.Random, finish: float, abort: float) -> None:
        """Requests leave between steps: each running one finishes with probability
        ``finish`` or is aborted with ``abort - finish``; now and then a waiting one aborts."""
        for req in list(self.live.values()):
            r = rng.random()
            if r < finish:
                self.end(req, "finish")
            elif r < abort:
                self.end(req, "abort")
        if self.waiting and rng.random() < 0.03:
            self.waiting.pop(rng.randrange(len(self.waiting)))
            self.bump("abort_waiting")

    def maybe_reset(self, rng: random.Random) -> bool | None:
        """Now and then a prefix-cache reset, half the time after draining the running
        requests (as vLLM's reset with running requests); vLLM resets only when no page is
        held, else it refuses and changes nothing. None: no reset this step."""
        if rng.random() >= 0.02:
            return None
        if rng.random() < 0.5:
            for req in list(self.live.values()):
                self.preempt(req)
        ok = self.mgr.reset_prefix_cache()
        assert ok == (not self.live), (ok, len(self.live))
        self.bump("reset")
        return ok


def run(seed: int, num_steps: int, total_pages: int = 96, force_moves: int = 3,
        fault_every: int = 0, caching: bool = False,
        zero_new_pages: bool = True, retention: int | None = None) -> ArenaFuzzStats:
    """``num_steps`` engine steps of random operations; ``fault_every``: about one step in
    this many has a failing copy (0: none); ``zero_new_pages``: the layout's (off: new pages
    keep their stale bytes, as stock's blocks of one precision do); ``retention``: vLLM's
    prefix-cache retention interval (None: every page cached; 0, the engine's default for
    hybrids: only reachable boundaries, and the GDN state kept in its page past them)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from ulacache_vllm.engine.faults import MoveFaults

    rng = random.Random(seed)
    page = specs()["full"][1].page_size_bytes
    mgr = manager(total_pages * page, force_moves, caching, zero_new_pages, retention)
    hasher = None
    if caching:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        hasher = get_request_block_hasher(BS, sha256)
        prng = random.Random(seed + 1000)
        prefixes = [[prng.randint(1, 999) for _ in range(prng.randint(2, 5) * BS)]
                    for _ in range(3)]
    h = Harness(mgr)
    stats = ArenaFuzzStats()
    reqs = Requests(mgr, stats)
    live, waiting, prefill_left = reqs.live, reqs.waiting, reqs.prefill_left
    end = reqs.end
    counter = 0

    def schedule() -> dict:
        """Running requests first (the next prefill chunk, or one decoded token), preempting
        the newest running request while one does not fit; then up to two waiting ones."""
        done: dict = {}
        for req in list(live.values()):
            if req.request_id not in live:
                continue  # preempted for an older request this step
            left = prefill_left.get(req.request_id, 0)
            if left:
                n = min(left, rng.choice((BS, 2 * BS) if caching else (BS, 2 * BS, 100)))
            elif req.num_tokens >= MAX_LEN - 1:
                end(req, "finish")
                continue
            else:
                req.append_output_token_ids(rng.randint(1, 999))
                n = 1
            if reqs.scheduled(req, n, left):
                done[req] = n
        for req in [r for r in done if r.request_id not in live]:
            del done[req]  # preempted after it was scheduled
        for req in list(waiting[:rng.randint(0, 2)]):
            hit_blocks, hit = None, 0
            if caching:
                hit_blocks, hit, _ = mgr.get_computed_blocks(req)
            todo = req.num_tokens - hit
            n = todo if rng.random() < 0.5 else min(
                todo, rng.choice((BS, 2 * BS) if caching else (BS, 100)))
            if mgr.allocate_slots(req, n, num_new_computed_tokens=hit,
                                  new_computed_blocks=hit_blocks) is None:
                stats.refused += 1
                break  # first come, first served: the head waits
            reqs.admitted(req, hit, todo - n)
            done[req] = n
        return done

    for _ in range(num_steps):
        if fault_every and rng.random() < 1 / fault_every:
            h.worker.faults = MoveFaults("raise", moves=("arena",), count=1)
        reqs.leave(rng, finish=0.03, abort=0.05)
        ok = reqs.maybe_reset(rng) if caching else None
        if ok:  # nothing cached, nothing live but the null page
            assert mgr.arena.num_pages == 1 and not mgr._state.live, mgr.arena.num_pages
        stats.resets += bool(ok)
        while len(waiting) < 3:
            counter += 1
            n = rng.randint(1, MAX_LEN // 2)
            tokens = [rng.randint(1, 999) for _ in range(n)]
            if caching and rng.random() < 0.7:  # a shared prefix (or a whole resend)
                tokens = (rng.choice(prefixes) + tokens)[:MAX_LEN - 2]
            waiting.append(Request(f"r{counter}", tokens, SamplingParams(max_tokens=1 << 20),
                                   None, block_hasher=hasher))
        last = {r.request_id: n for r, n in h.step(schedule).items()}
        if h.lost:  # the scheduler ends the requests holding lost pages with an error
            stats.lost_pages += len(h.lost)
            # (sorted: a set of str ids iterates in PYTHONHASHSEED's order, and the order of
            # these frees decides later placements: one seed, one run in every process)
            for rid in sorted(mgr.lost_block_owners(h.lost, live.values())):
                end(live[rid], "ended_by_fault")
                stats.ended_by_faults += 1
            st = mgr._state
            assert not any(v in st.live and st.live[v].block_hash is not None
                           for v in h.lost), "a lost page is still in the prefix cache"
        stats.steps += 1
        _check_holdings(mgr, live, last, caching)
        check_tiling(mgr.arena)
    for req in list(live.values()):
        end(req, "finish")
    s = mgr.stats()
    stats.cache_evictions = s["arena_cache_evictions"]
    stats.cached_pages_moved = s["arena_cached_pages_moved"]
    stats.state_moves_saved = s["arena_state_moves_saved"]
    if caching:
        _check_holdings(mgr, live, {}, caching)
        assert mgr.reset_prefix_cache(), "the cache did not reset with no page held"
    h.step(dict)  # an empty step: the last frees' fences pass
    assert mgr.arena.used_bytes == mgr.arena.page_bytes[0], "pages left after every free"
    assert mgr.arena.pending_bytes == 0, "bytes still withheld"
    s = mgr.stats()
    stats.compactions, stats.relayouts = s["arena_compactions"], s["arena_relayouts"]
    stats.bytes_copied = h.worker.counters["bytes_copied"]
    stats.zeroed_pages = h.worker.counters["zeroed_pages"]
    return stats
